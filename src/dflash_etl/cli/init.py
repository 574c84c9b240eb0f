"""`dflash-etl init DIR`: the embedded default (pipeline.toml, its sources, its tokenizer) written
out as files to edit, the start of one's own pipeline. `dflash-etl run` alone runs the default
from wherever the package is (a checkout's data/ or the copy in an installed wheel)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dflash_etl.core.config import DEFAULT_CONFIG
from dflash_etl.core.errors import StageError

# data/'s scripts rebuild the default in a checkout; they are not part of a pipeline
NOT_COPIED = shutil.ignore_patterns("*.py", "__pycache__")


def write_default(out: Path) -> Path:
    """The default's folder copied to `out` (new or empty, so nothing of the user's is
    overwritten); returns the copied pipeline.toml, whose paths are relative to itself."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StageError(f"init writes a new pipeline into {out}, which "
                         f"{'is not empty' if out.is_dir() else 'is a file'}: name a new or "
                         "empty directory")
    shutil.copytree(DEFAULT_CONFIG.parent, out, ignore=NOT_COPIED, dirs_exist_ok=True)
    return out / DEFAULT_CONFIG.name


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`init` among `dflash-etl`'s subcommands."""
    parser = commands.add_parser("init", help="write the embedded default (config, sources, "
                                 "tokenizer) into a directory, to edit into one's own pipeline")
    parser.add_argument("dir", type=Path, help="a new or empty directory")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    config = write_default(args.dir)
    print(f"wrote the embedded default to {args.dir} ({config.name}, sources/, tokenizer/)\n"
          f"run it:  cd {args.dir} && dflash-etl run --config {config.name}", flush=True)
    return 0
