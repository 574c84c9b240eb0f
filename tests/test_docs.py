"""The pages a newcomer reads say what the code does: docs/configuration.md lists every key of
every section (a setting added without a line there, or a line for a key that is gone, fails
here), and the README keeps its two set-up commands."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from dflash_etl.core.config import CORE_SECTIONS, SourceConfig
from dflash_etl.stages import PIPELINE

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "configuration.md"


def _blocks() -> dict[str, dict]:
    """Each `## [section]` heading's ```toml block, parsed (its keys are what the page lists)."""
    text = REFERENCE.read_text()
    found = {}
    for name, block in re.findall(r"^## `\[{1,2}(\w+)\]{1,2}`.*?```toml\n(.*?)```", text,
                                  re.M | re.S):
        data = tomllib.loads(block)
        found[name] = data["sources"][0] if name == "sources" else data[name]
    return found


SECTIONS = {**CORE_SECTIONS, **PIPELINE.sections(), "sources": SourceConfig}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_the_configuration_reference_lists_every_key(section):
    blocks = _blocks()
    assert section in blocks, f"docs/configuration.md has no ## `[{section}]` with a toml block"
    keys = {f.name for f in dataclasses.fields(SECTIONS[section])}
    listed = set(blocks[section])
    assert keys - listed == set(), f"[{section}] keys missing from docs/configuration.md"
    assert listed - keys == set(), f"[{section}] keys in docs/configuration.md that are gone"


def test_the_readme_keeps_its_two_commands_and_its_length():
    readme = (REPO / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert len(readme.splitlines()) <= 170  # a newcomer's five minutes; the rest is in docs/
