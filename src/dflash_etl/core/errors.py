"""Errors a user sees: each says what is wrong, where, and what to do about it."""

from __future__ import annotations

import errno
import re
from importlib import metadata

# torch is no dependency of the package: its build must match the machine (CPU, CUDA)
TORCH_HINT = ("install torch first, the build for this machine (`pip install torch==2.13.0` is "
              "the CPU build here; see the README's set-up)")


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, Kubernetes, Slurm, `docker stop`): handled as Ctrl-C is (the stage
    is marked failed, its completed work kept), and said as what it was."""


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
    if isinstance(exc, ModuleNotFoundError) and not (exc.name or "").startswith("dflash_etl"):
        return missing_module(exc, stage)
    if isinstance(exc, BrokenProcessPool):
        return StageError(
            f"{stage}: a worker process died (killed by the operating system — often out of "
            "memory — or crashed). Completed work is kept: rerun to resume, with fewer "
            "--workers if memory is short (see `dmesg` for the kernel's reason)")
    if not isinstance(exc, OSError) and _disk_full(exc):  # a library's own words for ENOSPC
        return StageError(f"{stage}: the disk is full ({type(exc).__name__}: "
                          f"{str(exc)[:200]}). Completed work is kept: free space and rerun to "
                          "resume")
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


# how writers that are not Python's own say ENOSPC: safetensors (Rust: "os error 28",
# "StorageFull"), torch's zip writer ("unexpected pos": its write came back short)
DISK_FULL = re.compile(r"os error 28|StorageFull|No space left on device|"
                       r"PytorchStreamWriter failed writing file .*unexpected pos")


def _disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is a full disk."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if not isinstance(exc, OSError) and DISK_FULL.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def missing_module(exc: ModuleNotFoundError, stage: str) -> StageError:
    """An optional dependency that is not installed, as what to install: the extra of this
    package that lists it (read from the installed metadata, pyproject.toml's one copy)."""
    module = (exc.name or "").split(".")[0]
    if module == "torch":
        return StageError(f"{stage} needs torch, which is not installed: {TORCH_HINT}")
    try:
        requirements = metadata.requires("dflash-etl") or []
    except metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        extra = re.search(r"extra == ['\"]([\w-]+)['\"]", requirement)
        if name and extra and name[0].lower().replace("-", "_") == module.lower():
            return StageError(f"{stage} needs {module}, which is not installed: pip install "
                              f"'dflash-etl[{extra[1]}]'")
    return StageError(f"{stage} needs the Python module {module}, which is not installed: "
                      f"pip install {module}")
