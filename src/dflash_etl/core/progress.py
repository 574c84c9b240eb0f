"""Progress bars that draw on a terminal and stay silent in logs and CI."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class _Bar:
    def __init__(self, progress=None, task=None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        if self._progress is not None and n:
            self._progress.advance(self._task, n)

    def note(self, text: str) -> None:
        """A line above the bar on a terminal, or on stderr in a log."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)


@contextmanager
def progress_bar(label: str, total: int, enabled: bool | None = None) -> Iterator[_Bar]:
    """A rich progress bar when stderr is a terminal (or `enabled`), otherwise a no-op."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield _Bar()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        f"[bold]{label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        yield _Bar(progress, progress.add_task(label, total=total))


def size_text(n: float) -> str:
    """Bytes as a person reads them: GiB from 128 MiB up, MiB from 1 MiB, KiB, then bytes (a
    small figure is never rounded to 0.0)."""
    if n >= 2**27:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{int(n)} B"
