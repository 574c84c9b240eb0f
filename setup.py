"""The build hook: contracts/, expectations/ and the embedded default (data/) live at the top of
the repository, their one source; a built wheel carries a copy of them in dflash_etl/_bundled/,
where `dflash_etl.core.config.project_path` finds them once installed. Nothing is copied into
the source tree, and an editable install reads the checkout's own files."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = ("contracts", "expectations", "data")
# data/'s scripts rewrite the default from a checkout; an installed package only reads it
SKIPPED = shutil.ignore_patterns("*.py", "__pycache__")


class BuildWithProjectData(build_py):
    """build_py, then the top-level data folders into the build's dflash_etl/_bundled/."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "dflash_etl" / "_bundled"
        for name in BUNDLED:
            if target.joinpath(name).exists():
                shutil.rmtree(target / name)
            shutil.copytree(ROOT / name, target / name, ignore=SKIPPED)


setup(cmdclass={"build_py": BuildWithProjectData})
