"""Progress where a person looks: a bar on a terminal; in a log (stderr not a terminal) a line
every LOG_EVERY_S seconds with the same figures; and, for `dflash-etl status` in another
terminal, a small record in the run directory that the work rewrites as it goes."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# a log line at most this long after the last one (or the process's start) while a stage works:
# the promise is 30 s, and a ticker wakes once a second
LOG_EVERY_S = 28.0
RECORD_EVERY_S = 1.0  # the status record, rewritten at most this often
_last_line = [time.monotonic()]  # when this process last logged a progress line (or started)


def _due(now: float) -> bool:
    """Whether a log line is due: LOG_EVERY_S since the last one any reporter printed."""
    return now - _last_line[0] >= LOG_EVERY_S


def _log_line(text: str) -> None:
    _last_line[0] = time.monotonic()
    print(text, file=sys.stderr, flush=True)


def drop_stale_records(run_root: str | Path) -> None:
    """Remove the half-written progress records a killed stage left (`<record>.<pid>.tmp`);
    called under the run's lock, when no stage of the run can be writing one."""
    for tmp in Path(run_root).glob(".*.progress.json.*.tmp"):
        tmp.unlink(missing_ok=True)


def progress_record(run_root: str | Path, stage: str) -> Path:
    """Where a stage's progress is recorded while it runs (outside its output)."""
    return Path(run_root) / f".{stage}.progress.json"


def progress_figures(done: int, total: int, elapsed: float) -> dict[str, Any]:
    """done/total, the rate and the time left at that rate."""
    rate = done / elapsed if elapsed > 0 else 0.0
    left = (total - done) / rate if rate > 0 and total > done else (0.0 if done >= total else None)
    return {"done": done, "total": total, "elapsed_s": round(elapsed, 1),
            "rate_per_s": round(rate, 3), "eta_s": round(left, 1) if left is not None else None}


def progress_text(label: str, unit: str, figures: dict[str, Any]) -> str:
    """`label: 12/40 shards (30%), 0.80/s, ETA 35 s` (the log line and `status`'s)."""
    done, total = figures["done"], figures["total"]
    share = f" ({done / total:.0%})" if total else ""
    eta = figures.get("eta_s")
    when = f", ETA {_seconds(eta)}" if eta is not None and done < total else ""
    return (f"{label}: {done}/{total} {unit}{share}, {figures['rate_per_s']:.2f}/s, "
            f"{_seconds(figures['elapsed_s'])} so far{when}")


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h")


class _Bar:
    def __init__(self, label: str, total: int, unit: str, progress: Any = None, task: Any = None,
                 log: bool = False, record: Path | None = None) -> None:
        self._progress, self._task = progress, task
        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self._log, self._record = log, record
        self._start = self._last_record = time.monotonic()
        self._logged = False
        self._writing = threading.Lock()  # the ticker and the work both write
        self._write_record()
        # the figures go on while an item takes long (a shard of a big target, a slow server):
        # a log line and the record on time, not only when an item ends
        self._stop = threading.Event()
        self._ticker = None
        if log or record is not None:
            self._ticker = threading.Thread(target=self._tick, name=f"progress {label}",
                                            daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(max(0.05, min(LOG_EVERY_S, max(RECORD_EVERY_S, 1.0)))):
            self._report()

    def advance(self, n: int = 1) -> None:
        if not n:
            return
        self.done += n
        if self._progress is not None:
            self._progress.advance(self._task, n)
        self._report()

    def _report(self) -> None:
        """The log line and the record, each when its interval has passed."""
        now = time.monotonic()
        if self._log and _due(now):
            self._say()
        if self._record is not None and now - self._last_record >= RECORD_EVERY_S:
            self._last_record = now
            self._write_record()

    def note(self, text: str) -> None:
        """A line above the bar on a terminal, or on stderr in a log."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """The last figures: a log line when the log had any (a short stage stays quiet)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self._log and self._logged:
            self._say()
        self._write_record()

    def _figures(self) -> dict[str, Any]:
        return progress_figures(self.done, self.total, time.monotonic() - self._start)

    def _say(self) -> None:
        with self._writing:
            self._logged = True
            _log_line(progress_text(self.label, self.unit, self._figures()))

    def _write_record(self) -> None:
        if self._record is None:
            return
        with self._writing:
            _write_record(self._record, {"label": self.label, "unit": self.unit,
                                         **self._figures()})


def _write_record(record: Path, doc: dict[str, Any]) -> None:
    """The status record, replaced whole (a reader never sees half of it)."""
    tmp = record.with_name(record.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({**doc, "pid": os.getpid(), "updated": time.time()}))
        os.replace(tmp, record)
    except OSError:  # a full or read-only disk: progress is not worth failing the work
        pass


@contextmanager
def progress_bar(label: str, total: int, enabled: bool | None = None, *,
                 record: Path | None = None, unit: str = "items") -> Iterator[_Bar]:
    """A rich bar when stderr is a terminal (or `enabled`); a line every LOG_EVERY_S seconds
    when it is not (a log, `nohup`, a cluster job) and `enabled` is None; nothing with
    `enabled` False. `record`: where `dflash-etl status` reads the figures meanwhile."""
    log = enabled is None and not sys.stderr.isatty()
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        bar = _Bar(label, total, unit, log=log, record=record)
        try:
            yield bar
        finally:
            bar.close()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        f"[bold]{label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        bar = _Bar(label, total, unit, progress, progress.add_task(label, total=total),
                   record=record)
        try:
            yield bar
        finally:
            bar.close()


class _Steps:
    """What a stage does after its work items or its work (merging their results, the
    accounting, the contract, the suite, publishing: a minute at a million rows): in a log a
    line when one is due, and the step in the status record, so neither goes quiet."""

    def __init__(self, label: str, log: bool, record: Path | None) -> None:
        self.label, self._log, self._record = label, log, record
        self.step, self._since = "", time.monotonic()
        self._stop, self._ticker = threading.Event(), None
        self._writing = threading.Lock()  # the ticker and the stage both report

    def now(self, step: str) -> None:
        self.step, self._since = step, time.monotonic()
        self._report()
        if self._ticker is None and (self._log or self._record is not None):
            self._ticker = threading.Thread(target=self._tick, name=f"steps {self.label}",
                                            daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._report()

    def _report(self) -> None:
        with self._writing:
            elapsed = time.monotonic() - self._since
            if self._log and _due(time.monotonic()):
                _log_line(step_text(self.label, self.step, elapsed))
            if self._record is not None:
                _write_record(self._record, {"label": self.label, "step": self.step,
                                             "elapsed_s": round(elapsed, 1)})

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)


def step_text(label: str, step: str, elapsed: float) -> str:
    """`tokenize: checking the contract, 35 s so far` (the log line and `status`'s)."""
    return f"{label}: {step}, {_seconds(elapsed)} so far"


def record_text(doc: dict[str, Any], stage: str) -> str:
    """A status record as `status` shows it: the work's figures, or the step after it."""
    if "step" in doc:
        return step_text(doc.get("label", stage), doc["step"], float(doc.get("elapsed_s", 0)))
    return progress_text(doc.get("label", stage), doc.get("unit", "items"), doc)


@contextmanager
def working(label: str, enabled: bool | None = None, *,
            record: Path | None = None) -> Iterator[_Steps]:
    """The steps after the work (`steps.now("checking the contract")`): a line when one is due
    (on a terminal too: the bar is gone by then) unless `enabled` is False, and the step in
    `record` for `status`; silent until the first step."""
    steps = _Steps(label, enabled is not False, record)  # a terminal gets the lines too
    try:
        yield steps
    finally:
        steps.close()


def size_text(n: float) -> str:
    """Bytes as a person reads them: GiB from 128 MiB up, MiB from 1 MiB, KiB, then bytes (a
    small figure is never rounded to 0.0)."""
    if n >= 2**27:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{int(n)} B"
