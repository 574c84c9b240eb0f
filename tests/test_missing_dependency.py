"""A missing optional dependency is what to install, in one line, from every stage that needs it
(core.errors.describe_error, which the runner applies), never "a bug in dflash_etl"."""

from __future__ import annotations

from dflash_etl.core.errors import describe_error


def _missing(module: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named '{module}'", name=module)


def test_a_missing_extra_names_the_extra_to_install():
    said = str(describe_error(_missing("transformers"), "tokenize"))
    assert said == ("tokenize needs transformers, which is not installed: "
                    "pip install 'dflash-etl[tokenize]'")
    assert "'dflash-etl[regenerate]'" in str(describe_error(_missing("httpx"), "regenerate"))


def test_a_missing_torch_says_to_install_it_first_for_the_machine():
    said = str(describe_error(_missing("torch"), "extract"))
    assert said.startswith("extract needs torch, which is not installed: install torch first")
    assert "\n" not in said


def test_a_missing_module_of_the_package_itself_stays_a_bug():
    said = str(describe_error(_missing("dflash_etl.nowhere"), "ingest"))
    assert "internal error ModuleNotFoundError" in said and "pip install" not in said
