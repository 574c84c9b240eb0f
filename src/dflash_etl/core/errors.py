"""Errors a user sees: each says what is wrong, where, and what to do about it."""

from __future__ import annotations

import errno


class StageError(RuntimeError):
    """A stage cannot produce a trustworthy output (empty output, failed gate, bad inputs)."""


class ContractError(StageError):
    """A stage output broke its contract; `report` holds the failing checks and sample rows."""

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


def describe_error(exc: BaseException, stage: str) -> StageError | BaseException:
    """An unexpected exception as one paragraph: what went wrong, where, what to do."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(exc, KeyboardInterrupt):
        return exc
    if isinstance(exc, BrokenProcessPool):
        return StageError(
            f"{stage}: a worker process died (killed by the operating system — often out of "
            "memory — or crashed). Completed work is kept: rerun to resume, with fewer "
            "--workers if memory is short (see `dmesg` for the kernel's reason)")
    if isinstance(exc, OSError):
        where = exc.filename or "the run directory"
        if exc.errno == errno.ENOSPC:
            return StageError(f"{stage}: the disk is full (writing {where}). Completed work is "
                              "kept: free space and rerun to resume")
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return StageError(f"{stage}: cannot write {where} ({exc.strerror}): make the run "
                              "directory writable or choose another --run")
        return StageError(f"{stage}: {exc.strerror or exc} ({where}); rerun with --debug for "
                          "the traceback")
    if isinstance(exc, MemoryError):
        return StageError(f"{stage}: out of memory; rerun with fewer --workers or a smaller "
                          "batch (completed work is kept)")
    return StageError(f"{stage}: internal error {type(exc).__name__}: {exc}. This is a bug in "
                      "dflash_etl: rerun with --debug for the traceback and report it with the "
                      "run's manifest.json")
