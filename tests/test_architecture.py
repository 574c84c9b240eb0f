"""The layering of src/dflash_etl stays as it is (tools/arch_measures.py measures it).

A new import circle, an import from a floor up into a higher one (docs/architecture.md: its
floors), a circle between sibling packages, a function past 80 lines or a module past 600 fails
here, naming them. (No cap on how many functions pass 50 lines: it forced splits for their own
sake.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "arch_measures.py"
MAX_FUNCTION_LINES = 80


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


def test_no_arrow_runs_back_up(measures: dict) -> None:
    assert measures["arrows_up"] == []
    assert measures["package_cycles"] == []


def test_functions_and_modules_stay_readable(measures: dict) -> None:
    longest = measures["longest_functions"]
    assert not longest or longest[0][0] <= MAX_FUNCTION_LINES, longest[:3]
    assert measures["modules_over_600_lines"] == []


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
    assert found["arrows_up"] == [("dflash_etl.core.runner", "dflash_etl.stages.ingest")]


def test_the_measure_sees_a_circle_between_sibling_packages(tool: ModuleType, tmp_path: Path
                                                            ) -> None:
    """models.fleet -> models.generation.completions and models.generation.fleet ->
    models.fleet: no module circle, but a circle between the two parts of models/."""
    pkg = tmp_path / "dflash_etl"
    (pkg / "models" / "generation").mkdir(parents=True)
    for init in (pkg, pkg / "models", pkg / "models" / "generation"):
        (init / "__init__.py").write_text("")
    (pkg / "models" / "fleet.py").write_text("from dflash_etl.models.generation import http\n")
    (pkg / "models" / "generation" / "http.py").write_text("")
    (pkg / "models" / "generation" / "fleet.py").write_text("from dflash_etl.models import fleet\n")
    found = tool.measures(tmp_path)
    assert found["import_cycles"] == []
    assert found["package_cycles"] == [["dflash_etl.models.fleet", "dflash_etl.models.generation"]]
