"""The run directory: manifest.json, atomic stage outputs, skip-when-complete and resume.

A stage writes into `<run>/.<stage>.partial/` and renames it to `<run>/<stage>/` only when the
output is complete and has passed its gates, so a crash never leaves a finished-looking output.
`RunDir` is the one handle every reader of a run goes through: its stages' records
(`StageRecord`), which of them is stale, and the current output of a kind (`output`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from dflash_etl import __version__
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import Output

OutputT = TypeVar("OutputT", bound=Output)

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


FINGERPRINT = "FINGERPRINT"  # in a partial directory: the inputs its work is for
PLAN_FILE = "extract.plan.json"  # `extract --plan`'s dry-run report, beside the manifest
FILES_JSON = "files.json"  # in each published output: every file's size (and sha256 if small)
HASHED_MAX_BYTES = 16 * 2**20


def list_files(directory: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256 (files up to 16 MiB)}} of every file below `directory`."""
    listing: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == FILES_JSON:
            continue
        size = path.stat().st_size
        listing[rel] = {"size": size,
                        "sha256": sha256_file(path) if size <= HASHED_MAX_BYTES else None}
    return listing


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never part of it (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


TEMPORARY_SUFFIX = ".tmp"  # a file or folder being written, renamed to its real name when whole


def remove_tree(path: Path) -> None:
    """Delete a directory so that a kill in the middle never leaves part of it under its name:
    renamed to a *.tmp name first (which `drop_temporaries` removes), then deleted."""
    if not path.exists():
        return
    doomed = path.with_name(f".{path.name}.del{TEMPORARY_SUFFIX}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def drop_temporaries(directory: Path) -> None:
    """Remove what a killed process left half written below `directory`: every file or folder
    named *.tmp (the convention of every writer here: write `X.tmp`, rename it to `X`)."""
    if not directory.is_dir():
        return
    for path in sorted(directory.rglob(f"*{TEMPORARY_SUFFIX}"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StageRecord:
    """One stage's entry in the manifest: what ran, with which result, built on what."""

    name: str
    entry: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        """complete, running, publishing or failed; None: the stage never ran here."""
        return self.entry.get("status")

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def fingerprint(self) -> str | None:
        return self.entry.get("fingerprint")

    @property
    def content(self) -> str | None:
        """Its output's identity by content (see `content_identity`), else None."""
        return content_identity(self.entry)

    @property
    def built_on(self) -> dict[str, str]:
        """upstream stage -> the identity of its output this stage read."""
        return dict(self.entry.get("built_on") or {})

    @property
    def error(self) -> str | None:
        return self.entry.get("error")

    @property
    def settings(self) -> dict[str, Any]:
        """The settings it ran with, as recorded when it began."""
        return dict(self.entry.get("settings") or {})

    def get(self, key: str, default: Any = None) -> Any:
        """A figure the stage recorded itself (train's steps_per_s, extract's ranks...)."""
        return self.entry.get(key, default)


class RunDir:
    """One run: `<root>/manifest.json` plus one directory per completed stage."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_text())
            except ValueError as exc:  # cut or edited by hand: name it, never "internal error"
                raise StageError(
                    f"{self.manifest_path} is not valid JSON ({exc}): it records this run's "
                    "stages; restore it (a copy, version control), or move it away and rerun "
                    "the stages, which then redo their outputs") from exc
            if not isinstance(manifest, dict):
                raise StageError(f"{self.manifest_path} holds no JSON object: restore it, or "
                                 "move it away and rerun the stages")
            return manifest
        return {"tool": {"name": "dflash-etl", "version": __version__}, "stages": {}}

    def records(self) -> dict[str, StageRecord]:
        """Every stage the manifest records, in the order they first ran."""
        stages = self.manifest().get("stages")
        return {name: StageRecord(name, entry) for name, entry in
                (stages.items() if isinstance(stages, dict) else ()) if isinstance(entry, dict)}

    def record(self, stage: str) -> StageRecord:
        """The stage's record (an empty one when it never ran here)."""
        return self.records().get(stage) or StageRecord(stage)

    def source_file_changed(self, path: str) -> str | None:
        """How a source file differs from what ingest read (its size and sha256, recorded in
        the manifest), or None: unchanged, or not a source ingest recorded."""
        recorded = next((i for i in self.manifest().get("inputs") or []
                         if isinstance(i, dict) and i.get("path") == path), None)
        if recorded is None:
            return None
        try:
            size = os.path.getsize(path)
        except OSError:
            return "it is gone"
        if size != recorded.get("size"):
            return f"{recorded.get('size')} bytes when ingest read it, {size} now"
        if sha256_file(path) != recorded.get("sha256"):
            return "its content changed since ingest read it"
        return None

    def stale(self) -> dict[str, str]:
        """Complete stages whose output no longer follows from the run's, each with why."""
        return {s["stage"]: f"built on the {s['upstream']} output of its time, which is "
                            f"{s['why']}" for s in stale_stages(self.manifest().get("stages"))}

    def output(self, kind: type[OutputT], writers: Sequence[str], reader: str,
               stale: str = "error", hint: str = "", stale_hint: str = "") -> OutputT:
        """The current output of `kind` for `reader`: that of the last stage among `writers` (the
        stages before the reader that write this kind, in pipeline order) that ran here, or
        whose output is here (copied in, without a record). One that ran but is not complete,
        is stale or lost its files is an error naming what to rerun, or with
        `stale="previous"` a warning, and the writer before it is read: never a silent fallback
        to an older output. `hint`: the reader's alternative in every error (train --online);
        `stale_hint`: in the errors about a writer that ran."""
        records = self.records()
        present = [w for w in writers if w in records or kind.found_in(self.stage_dir(w))]
        words = kind.kind.replace("_", " ")
        if not present:
            raise StageError(f"{reader} reads {words}, which no stage of this run wrote yet: run "
                             f"`dflash-etl {writers[0] if writers else '<stage>'}` for this run "
                             f"first{hint} (run directory {self.root})")
        stale_now = self.stale()
        for k in range(len(present) - 1, -1, -1):
            name, record = present[k], records.get(present[k])
            found = kind.found_in(self.stage_dir(name))
            if found and (record is None or (record.complete and name not in stale_now)):
                return kind.read(self.stage_dir(name))
            if record is not None and record.complete and not found:
                raise StageError(f"{name}'s output is gone ({self.stage_dir(name) / kind.marker} "
                                 f"is missing): run `dflash-etl {name}` first{hint}")
            if record is None or not record.complete:
                why = f"is {record.status if record else 'missing'}, not complete"
            else:
                replaced = _replaced(record, records)
                why = f"was made from an older {replaced} output ({replaced} was rerun since)"
            earlier = present[k - 1] if k else None
            message = f"{name}'s output {why}" + (
                f": {reader} would read {earlier}'s {words} instead" if earlier else "")
            if stale != "previous" or earlier is None:
                raise StageError(f"{message}. Rerun `dflash-etl {name} --run {self.root}` first"
                                 f"{stale_hint}{hint}")
            print(f"{reader}: WARNING: {message}", file=sys.stderr, flush=True)
        raise AssertionError("unreachable: the first writer returns or raises")

    def published(self, kind: type[OutputT]) -> tuple[OutputT, StageRecord] | None:
        """The run's published output of `kind` and its stage's record, for a reader after the
        pipeline (export, eval, show, the report): that of the last complete stage, in the order
        the stages ran, whose output is of this kind; None when no complete stage wrote one."""
        for record in reversed(list(self.records().values())):
            if record.complete and kind.found_in(self.stage_dir(record.name)):
                return kind.read(self.stage_dir(record.name)), record
        return None

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

    def completed_stats(self, stage: str, fingerprint: str,
                        say: Any = None) -> dict[str, Any] | None:
        """The stats of a stage already complete for these inputs (marked skipped), or None;
        None also when a published file went missing or changed (`say` is told which)."""
        if not self.is_complete(stage, fingerprint):
            return None
        changed = self.changed_files(stage)
        if changed:
            if say is not None:
                say(f"{stage}: the published output changed since it was made "
                    f"({'; '.join(changed)}): redoing the stage")
            return None
        doc = json.loads((self.stage_dir(stage) / "stats.json").read_text())
        doc["skipped"] = True
        return doc

    def begin(self, stage: str, fingerprint: str) -> Path:
        """A partial directory to write into; kept (for resume) when its fingerprint matches.
        What a killed writer left half written in it (*.tmp) is removed."""
        self.refuse_foreign_output(stage)
        partial = self.partial_dir(stage)
        marker = partial / FINGERPRINT
        if partial.exists() and (not marker.exists() or marker.read_text() != fingerprint):
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        drop_temporaries(partial)
        if not marker.exists():  # never rewritten in place: a kill then would lose the partial
            write_text_atomic(marker, fingerprint)
        # the complete output this run would replace: what a failure or a kill leaves in place
        self.update_stage(stage, status="running", fingerprint=fingerprint, started_at=now(),
                          published=self.published_entry(stage))
        return partial

    def refuse_foreign_output(self, stage: str) -> None:
        """Publishing renames `<stage>/` away and removes it: refuse, before any work, a folder
        there that this tool did not publish (every output it publishes holds files.json), and a
        symlink, which the rename would replace with a folder on the run's disk."""
        final = self.stage_dir(stage)
        if final.is_symlink():
            raise StageError(f"{final} is a symlink (to {os.readlink(final)}): a stage output is "
                             "published by renaming it into the run directory, which would "
                             "replace the link; put the whole run directory on that disk "
                             "(--run) instead. Nothing was changed")
        if final.exists() and not (final / FILES_JSON).is_file():
            raise StageError(f"{final} exists and is not an output this tool published (no "
                             f"{FILES_JSON} in it): move it away or choose another --run; "
                             "publishing would replace it. Nothing was changed")

    def published_entry(self, stage: str) -> dict[str, Any] | None:
        """The stage's manifest entry as it was when its output in `<stage>/` was published
        (complete, or kept under `published` while a rerun runs), or None: no complete output."""
        info = self.manifest().get("stages", {}).get(stage) or {}
        if not self.stage_dir(stage).is_dir():
            return None
        entry = info if info.get("status") == "complete" else info.get("published")
        if not entry:
            return None
        return {k: v for k, v in entry.items() if k not in ("published", "last_attempt")}

    def commit(self, stage: str, summary: dict[str, Any], seconds: float,
               **timings: Any) -> Path:
        """Publish the partial directory as the stage output and mark it complete. The old output
        is renamed away before the new one is renamed in, so `<stage>/` is never half deleted.
        Timings (`seconds`, and e.g. train's `steps_per_s`) are kept here, in the manifest, never
        in the stage's files: two runs of the same inputs give byte-identical data files.

        A kill at any moment leaves a state `recover` finishes: the manifest says `publishing`,
        with the listing's hash, before anything is renamed, and `complete` after."""
        partial, final = self.partial_dir(stage), self.stage_dir(stage)
        drop_temporaries(partial)
        listing = {rel: entry for rel, entry in list_files(partial).items() if rel != FINGERPRINT}
        write_json_atomic(partial / FILES_JSON, listing)
        self.update_stage(
            stage, status="publishing", finished_at=now(), seconds=round(seconds, 3), **timings,
            counts=summary,
            files={"count": len(listing), "bytes": sum(e["size"] for e in listing.values()),
                   "listing_sha256": sha256_file(partial / FILES_JSON),
                   "data_sha256": data_digest(listing)}, error=None,
        )
        self._publish(stage)
        return final

    def old_dir(self, stage: str) -> Path:
        return self.root / f".{stage}.old"

    def _publish(self, stage: str) -> None:
        """The renames of a commit the manifest records as `publishing`; each step can be
        repeated after a kill."""
        partial, final, old = self.partial_dir(stage), self.stage_dir(stage), self.old_dir(stage)
        if partial.is_dir():  # not yet renamed in
            (partial / FINGERPRINT).unlink(missing_ok=True)
            swap_in(partial, final, old)
        self._mark_complete(stage)
        shutil.rmtree(old, ignore_errors=True)

    def _mark_complete(self, stage: str) -> None:
        """Complete: the output that was being replaced, and an earlier failed attempt, are
        history now."""
        manifest = self.manifest()
        entry = manifest.setdefault("stages", {}).setdefault(stage, {})
        entry["status"] = "complete"
        entry.pop("published", None)
        entry.pop("last_attempt", None)
        manifest["packages"] = package_versions()
        write_json_atomic(self.manifest_path, manifest)

    def recover(self, stage: str) -> str | None:
        """Finish what a process killed in `commit` left: a stage the manifest says is
        `publishing` whose verified listing is in the partial directory (not yet renamed in) or
        already in `<stage>/` is published and marked complete; otherwise a leftover
        `.<stage>.old` is put back where no output is, or removed. Returns what was done (for
        the user), or None."""
        info = self.manifest().get("stages", {}).get(stage, {})
        partial, final, old = self.partial_dir(stage), self.stage_dir(stage), self.old_dir(stage)
        done = None
        if info.get("status") == "publishing":
            want = (info.get("files") or {}).get("listing_sha256")
            for where in (partial, final):
                listing = where / FILES_JSON
                if where.is_dir() and listing.is_file() and sha256_file(listing) == want:
                    self._publish(stage)
                    done = (f"{stage}: finished publishing the output an interrupted run had "
                            "completed")
                    break
        status = self.manifest().get("stages", {}).get(stage, {}).get("status")
        if old.exists() and status != "publishing" and not self._restore_old(stage):
            shutil.rmtree(old, ignore_errors=True)
        return done

    def _restore_old(self, stage: str) -> bool:
        """A commit whose second rename failed left the old output at `.<stage>.old` and none at
        `<stage>/`: put it back (True when it did)."""
        return restore_old(self.stage_dir(stage), self.old_dir(stage))

    def changed_files(self, stage: str) -> list[str]:
        """What differs between the published output and what was published (missing, resized,
        or re-hashed files); [] when it is intact."""
        final = self.stage_dir(stage)
        info = self.manifest().get("stages", {}).get(stage, {}).get("files")
        listing_path = final / FILES_JSON
        if not info or not listing_path.exists():
            return [f"{FILES_JSON} (the list of published files) is missing"]
        if sha256_file(listing_path) != info.get("listing_sha256"):
            return [f"{FILES_JSON} was edited"]
        problems = []
        for rel, entry in json.loads(listing_path.read_text()).items():
            path = final / rel
            if not path.is_file():
                problems.append(f"{rel}: missing")
            elif path.stat().st_size != entry["size"]:
                problems.append(f"{rel}: {path.stat().st_size} bytes, published {entry['size']}")
            elif entry.get("sha256") and sha256_file(path) != entry["sha256"]:
                problems.append(f"{rel}: content changed")
            if len(problems) >= 5:
                break
        return problems

    def fail(self, stage: str, error: str) -> None:
        self.update_stage(stage, status="failed", finished_at=now(), error=error)

    def keep_complete(self, stage: str, entry: dict[str, Any], error: str) -> None:
        """A failed attempt on a complete stage: its entry from before (`entry`) goes back as it
        was (status, fingerprint, counts, files), with the attempt under `last_attempt`."""
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        manifest.setdefault("stages", {})[stage] = {
            **entry, "last_attempt": {"status": "failed", "finished_at": now(), "error": error}}
        manifest["packages"] = package_versions()
        write_json_atomic(self.manifest_path, manifest)


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def swap_in(partial: Path, final: Path, old: Path) -> None:
    """Publish `partial` as `final`: an existing `final` is renamed to `old` first, and put back
    when the second rename fails, so `final` is never half deleted, nor gone with nothing in
    its place. The caller removes `old` once it has recorded the publish."""
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    try:
        os.replace(partial, final)
    except BaseException:
        restore_old(final, old)
        raise


def restore_old(final: Path, old: Path) -> bool:
    """The old output back at `final` where a publish left none there (True when it did)."""
    if old.is_dir() and not final.exists():
        os.replace(old, final)
        return True
    return False


# ---------------------------------------------------------------- what a stage was built on
# a gate's record in a published output: its great_expectations run record (ids, times) differs
# from one validation of the same data to the next, so it is not the output's data
REPORTS = ("validation.json",)


def data_digest(listing: dict[str, dict[str, Any]]) -> str:
    """The hash of a published listing's data files: every file but the gates' records."""
    data = {rel: entry for rel, entry in listing.items() if Path(rel).name not in REPORTS}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def output_identity(entry: dict[str, Any] | None) -> str | None:
    """A complete stage's published output, as the stages after it record what they read: its
    fingerprint (inputs and settings) and its data files (not the gates' records: a forced
    rerun that makes the same data is the same output); None when it is not complete."""
    if not entry or entry.get("status") != "complete":
        return None
    if content := content_identity(entry):
        return content
    files = entry.get("files") or {}
    return f"{entry.get('fingerprint')}:{files.get('data_sha256') or files.get('listing_sha256')}"


def content_identity(entry: dict[str, Any]) -> str | None:
    """A stage's output named by its content alone, where the stage recorded a digest of it
    (extract's states: `content_sha256`): the same states written in another layout are the
    same output, and what was built on them stays valid. None: the stage records none."""
    content = (entry.get("counts") or {}).get("content_sha256")
    return f"content:{content}" if content else None


def stale_stages(stages: Any) -> list[dict[str, str]]:
    """Complete stages built on an upstream output that has since been replaced by another, is
    no longer complete, or is itself stale: their output no longer follows from the run's
    (rerun them)."""
    stages = stages if isinstance(stages, dict) else {}
    found: dict[str, dict[str, str]] = {}
    changed = True
    while changed:  # a stage built on a stale one is stale too: until nothing more is found
        changed = False
        for name, entry in stages.items():
            if name in found or not isinstance(entry, dict) or entry.get("status") != "complete":
                continue
            for upstream, identity in (entry.get("built_on") or {}).items():
                current = output_identity(stages.get(upstream))
                why = ("stale" if upstream in found else "replaced since" if current != identity
                       and current else "not complete now" if current != identity else None)
                if why:
                    found[name] = {"stage": name, "upstream": upstream, "why": why}
                    changed = True
                    break
    return list(found.values())


def _replaced(record: StageRecord, records: dict[str, StageRecord]) -> str:
    """The upstream stage whose output changed under a stale stage."""
    for upstream, identity in record.built_on.items():
        if output_identity(records.get(upstream, StageRecord(upstream)).entry) != identity:
            return upstream
    return next(iter(record.built_on), "upstream")


def setting_changes(before: dict[str, Any] | None, after: dict[str, Any]) -> list[str]:
    """`key old -> new` for each resolved setting (a stage's prepare document, inputs aside)
    that differs from the published output's; nested dicts compared key by key."""
    if not before:
        return []
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += [f"{key}.{c}" for c in setting_changes(old, new)]
        elif old != new:
            changes.append(f"{key} {json.dumps(old, default=str)} -> "
                           f"{json.dumps(new, default=str)}")
    return changes
