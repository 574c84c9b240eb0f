"""The layering of src/dflash_etl stays as issue 25 left it (tools/arch_measures.py measures it).

A new import circle or an import from core/ up into a higher layer fails here, naming the modules;
so does a function that grows past the limits below.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "arch_measures.py"
MAX_FUNCTION_LINES = 80
MAX_FUNCTIONS_OVER_50 = 8


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arch_measures", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measures(tool: ModuleType) -> dict:
    return tool.measures()


def test_no_import_circles(measures: dict) -> None:
    assert measures["import_cycles"] == []


def test_core_imports_no_higher_layer(measures: dict) -> None:
    assert measures["core_upward_imports"] == []


def test_functions_stay_readable(measures: dict) -> None:
    longest = measures["longest_functions"]
    assert not longest or longest[0][0] <= MAX_FUNCTION_LINES, longest[:3]
    assert measures["functions_over_50_lines"] <= MAX_FUNCTIONS_OVER_50, longest


def test_the_measure_sees_circles_and_upward_imports(tool: ModuleType, tmp_path: Path) -> None:
    """A circle closed by a function-local relative import, and core reaching up, are found."""
    pkg = tmp_path / "dflash_etl"
    (pkg / "core").mkdir(parents=True)
    (pkg / "stages").mkdir()
    for init in (pkg, pkg / "core", pkg / "stages"):
        (init / "__init__.py").write_text("")
    (pkg / "core" / "runner.py").write_text("def f():\n    from ..stages import ingest\n")
    (pkg / "stages" / "ingest.py").write_text("from dflash_etl.core.runner import f\n")
    (pkg / "stages" / "tokenize.py").write_text("from dflash_etl.core import runner\n")
    found = tool.measures(tmp_path)
    assert found["import_cycles"] == [["dflash_etl.core.runner", "dflash_etl.stages.ingest"]]
    assert found["core_upward_imports"] == [("dflash_etl.core.runner", "dflash_etl.stages.ingest")]
