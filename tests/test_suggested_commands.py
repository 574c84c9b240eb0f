"""Every `dflash-etl ...` command a message of the package suggests is one the command line
takes: no flag it does not have, no subcommand that does not exist (train's corrupt-row error
suggested `dflash-etl check --run R`, which the CLI refused). The messages are read from the
source: each string literal (f-strings with their fields as placeholders, adjacent literals
joined as Python joins them)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dflash_etl.cli.main import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "dflash_etl"
# what a missing value or argument says: a mention of a command, not a wrong one
MENTION = ("the following arguments are required", "expected one argument")


def _texts(tree: ast.AST) -> list[str]:
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else "X"
                                 for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return texts


def _suggested() -> list[tuple[str, str]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for text in _texts(ast.parse(path.read_text())):
            for command in re.findall(r"`dflash-etl ([^`]+)`", text):
                found.append((command, path.relative_to(SRC).as_posix()))
    return found


def test_the_messages_suggest_commands():
    assert len(_suggested()) >= 20


@pytest.mark.parametrize(("command", "where"), _suggested())
def test_a_suggested_command_is_one_the_cli_takes(command, where):
    argv = [a for a in shlex.split(command) if a != "..."]  # "...": and the rest of its flags
    if argv[0] in ("X", "<stage>", "STAGE"):  # the stage is the message's own: extract takes
        argv[0] = "extract"  # every common flag and the launcher
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        build_parser().parse_args(argv)
    problem = err.getvalue().strip()
    assert not problem or any(m in problem for m in MENTION), f"{where}: {command}: {problem}"
