"""The run directory: manifest.json, atomic stage outputs, skip-when-complete and resume.

A stage writes into `<run>/.<stage>.partial/` and renames it to `<run>/<stage>/` only when the
output is complete and has passed its gates, so a crash never leaves a finished-looking output.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from dflash_etl import __version__

PACKAGES = (
    "polars", "pyarrow", "pandera", "orjson", "great-expectations", "transformers", "tokenizers",
    "datasets", "torch", "numpy",
)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: str | Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "dflash-etl": __version__}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


class RunDir:
    """One run: `<root>/manifest.json` plus one directory per completed stage."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        if self.manifest_path.exists():
            return json.loads(self.manifest_path.read_text())
        return {"tool": {"name": "dflash-etl", "version": __version__}, "stages": {}}

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        manifest.update(fields)
        manifest["packages"] = package_versions()
        write_json_atomic(self.manifest_path, manifest)
        return manifest

    def update_stage(self, stage: str, **fields: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        manifest.setdefault("stages", {}).setdefault(stage, {}).update(fields)
        manifest["packages"] = package_versions()
        write_json_atomic(self.manifest_path, manifest)

    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def partial_dir(self, stage: str) -> Path:
        return self.root / f".{stage}.partial"

    def is_complete(self, stage: str, fingerprint: str) -> bool:
        info = self.manifest().get("stages", {}).get(stage, {})
        return (
            self.stage_dir(stage).is_dir()
            and info.get("status") == "complete"
            and info.get("fingerprint") == fingerprint
        )

    def completed_stats(self, stage: str, fingerprint: str) -> dict[str, Any] | None:
        """The stats of a stage already complete for these inputs (marked skipped), or None."""
        if not self.is_complete(stage, fingerprint):
            return None
        doc = json.loads((self.stage_dir(stage) / "stats.json").read_text())
        doc["skipped"] = True
        return doc

    def begin(self, stage: str, fingerprint: str) -> Path:
        """A partial directory to write into; kept (for resume) when its fingerprint matches."""
        partial = self.partial_dir(stage)
        marker = partial / "FINGERPRINT"
        if partial.exists() and (not marker.exists() or marker.read_text() != fingerprint):
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        marker.write_text(fingerprint)
        self.update_stage(stage, status="running", fingerprint=fingerprint, started_at=now())
        return partial

    def commit(self, stage: str, summary: dict[str, Any], seconds: float,
               **timings: Any) -> Path:
        """Publish the partial directory as the stage output and mark it complete. Timings
        (`seconds`, and e.g. train's `steps_per_s`) are kept here, in the manifest, never in the
        stage's files: two runs of the same inputs give byte-identical data files."""
        partial, final = self.partial_dir(stage), self.stage_dir(stage)
        (partial / "FINGERPRINT").unlink(missing_ok=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        self.update_stage(
            stage, status="complete", finished_at=now(), seconds=round(seconds, 3), **timings,
            counts=summary,
        )
        return final

    def fail(self, stage: str, error: str) -> None:
        self.update_stage(stage, status="failed", finished_at=now(), error=error)


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
