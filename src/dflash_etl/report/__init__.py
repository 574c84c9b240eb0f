"""The run report, runs/<name>/docs/: a summary page and one page per validation.

Self-contained on purpose: inline CSS and SVG, relative links, no scripts, nothing fetched, so it
opens offline and from a CI artifact. Built from the files a run leaves (no great_expectations
import), so rebuilding it (`dflash-etl docs --run RUN`) takes well under a second.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.report.collect import collect
from dflash_etl.report.pages import check_page, summary_page, validation_page

__all__ = ["build_check_report", "build_docs", "publish_docs"]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# in a docs folder the report wrote: a folder without it (a project's own docs/, with `--run .`)
# is never written into, nor its files deleted
MARKER = ".dflash-etl-report"


def _ours(docs: Path) -> bool:
    """Whether the report may write into `docs`: new, marked as the report's, or holding only
    the report's own pages (a run's report from before the marker)."""
    if not docs.exists() or (docs / MARKER).exists():
        return True
    files = [p.relative_to(docs).as_posix() for p in docs.rglob("*") if p.is_file()]
    return all(f == "index.html" or re.fullmatch(r"validations/[\w.-]+\.html", f)
               for f in files)


def build_docs(run_root: str | Path) -> Path:
    """Write <run>/docs/index.html and docs/validations/<stage>.html; returns the docs dir."""
    run_root = Path(run_root)
    if not run_root.is_dir():
        raise FileNotFoundError(f"{run_root} is not a run directory")
    docs = run_root / "docs"
    if not _ours(docs):
        raise StageError(f"{docs} holds files the report did not write: it is left as it is "
                         "and the run's report is not written; give the run a directory of its "
                         "own (--run runs/NAME)")
    docs.mkdir(parents=True, exist_ok=True)
    (docs / MARKER).touch()
    manifest, stages = collect(run_root)
    for old in (docs / "validations").glob("*.html") if (docs / "validations").is_dir() else []:
        old.unlink()
    for stage in stages:
        if stage.validation is not None:
            _write(docs / "validations" / f"{stage.name}.html", validation_page(stage))
    _write(docs / "index.html", summary_page(run_root, manifest, stages))
    return docs


def build_check_report(report: dict[str, Any], out: str | Path) -> Path:
    """`dflash-etl check --report OUT`: OUT/index.html (OUT ending in .html: that file)."""
    out = Path(out)
    path = out if out.suffix == ".html" else out / "index.html"
    _write(path, check_page(report))
    return path


def publish_docs(run_root: str | Path) -> Path | None:
    """build_docs for the stages: a report problem is printed, never allowed to hide the stage's
    own result (or its error)."""
    try:
        return build_docs(run_root) / "index.html"
    except StageError as exc:
        print(f"warning: {exc}", file=sys.stderr, flush=True)
        return None
    except Exception as exc:  # any bug here must not mask the pipeline's verdict
        print(f"warning: the HTML report of {run_root} could not be built: {exc!r}",
              file=sys.stderr, flush=True)
        return None
