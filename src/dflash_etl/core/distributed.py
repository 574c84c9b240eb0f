"""Ranks under torchrun: the runner joins them, the torchrun executor splits work over them.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) starts one
process per rank, on one node or many with a shared run directory. Rank 0 alone owns the run
directory (lock, partial directory, manifest, report); every collective has a deadline (the
process group's timeout), so a rank that died or hangs makes the others fail instead of wait.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from dflash_etl.core.errors import StageError, describe_error

DEFAULT_TIMEOUT_S = 1800


def rank_world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment; (0, 1) without one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_gpu() -> int:
    """This rank's GPU index: LOCAL_RANK where every GPU of the node is visible (one GPU per
    rank), else the first it sees (each rank restricted to its own GPUs with
    CUDA_VISIBLE_DEVICES: G GPUs per model replica, `device_map = "auto"` over them)."""
    import torch

    return local_rank() if local_rank() < torch.cuda.device_count() else 0


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun (or similar) launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def join(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """(rank, world size); joins the launcher's process group when there is one: NCCL with one
    GPU per LOCAL_RANK where CUDA is available, else gloo (CPU). Every collective of the group
    fails after `timeout_s` rather than wait for a rank that is gone."""
    rank, world = rank_world()
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():  # this rank's GPU, before NCCL picks one
            torch.cuda.set_device(rank_gpu())
        try:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # the store or a peer unreachable: torch raises many types
            raise StageError(
                f"rank {rank} of {world} could not join the others within {timeout_s:g} s "
                f"(MASTER_ADDR {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}):"
                f" {exc}. Start every rank (each node's torchrun) with the same --rdzv/--master"
                " settings") from exc
    return dist.get_rank(), world


def leave() -> None:
    """Destroy the process group this process joined, if any. A process that exits with gloo's
    threads still running can abort at interpreter shutdown (SIGABRT, "terminate called
    without an active exception": pytorch#190489), which torchrun reports as the rank failing
    after the work succeeded."""
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_for_rank(device: str) -> str:
    """The device a rank's model goes to: under a launcher, `auto`/`cuda` mean this rank's GPU
    (`rank_gpu`), so the ranks of a node never share one."""
    import torch

    if rank_world()[1] > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{rank_gpu()}"
    return device


def assign_by_cost(costs: list[int], world: int) -> list[list[int]]:
    """Work item positions per rank, balanced by cost: the costliest item first, each to the
    least loaded rank (the lowest on a tie). Deterministic, so every rank computes the same
    assignment without talking to the others."""
    loads, mine = [0] * world, [[] for _ in range(world)]
    for n in sorted(range(len(costs)), key=lambda n: (-costs[n], n)):
        r = min(range(world), key=lambda r: (loads[r], r))
        mine[r].append(n)
        loads[r] += costs[n]
    return [sorted(m) for m in mine]


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        _collective(dist.barrier)


def agree(error: BaseException | None, world: int, stage: str) -> None:
    """Every rank says whether its work succeeded; when one failed, every rank raises (rank 0
    then records the failing ranks' messages in the manifest). A rank that died before it got
    here (killed, out of memory) makes the others fail at the group's timeout at the latest."""
    if world == 1:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    mine = None if error is None else str(error if isinstance(error, StageError)
                                          else describe_error(error, stage))
    said: list[Any] = [None] * world
    _collective(dist.all_gather_object, said, mine)
    failed = [(r, m) for r, m in enumerate(said) if m is not None]
    if error is not None:
        raise error
    if failed:
        raise StageError(f"{stage}: " + "; ".join(f"rank {r} failed: {m}" for r, m in failed)
                         + ". The other ranks' finished work is kept: fix that and rerun to "
                         "resume")


def _collective(call: Any, *args: Any) -> Any:
    """A collective whose failure (a peer gone, the timeout) is a StageError saying so."""
    try:
        return call(*args)
    except StageError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError and its subclasses
        rank, world = rank_world()
        raise StageError(
            f"rank {rank} of {world} lost the other ranks ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): another rank died (killed, out "
            "of memory) or did not answer within the timeout; see its error above. Finished "
            "work is kept: rerun to resume") from exc
