"""Workers are sized to the cores the process may use, not the host's count."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_etl.core import stage
from dflash_etl.core.stage import StageContext, cpu_quota, usable_cores


@pytest.mark.parametrize(("v2", "v1", "cores"), [
    ("200000 100000", ("", ""), 2), ("150000 100000", ("", ""), 2),
    ("max 100000", ("", ""), None), ("", ("-1", "100000"), None),
    ("", ("50000", "100000"), 1), ("", ("", ""), None), ("garbage", ("", ""), None)])
def test_a_cgroup_quota_is_read_in_whole_cores(v2: str, v1: tuple[str, str],
                                               cores: int | None) -> None:
    assert cpu_quota(v2, *v1) == cores


def test_a_quota_below_the_affinity_caps_the_default_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # a container's --cpus 1
    assert usable_cores(tmp_path) == 1
    monkeypatch.setattr(stage, "CGROUP", tmp_path)
    assert StageContext.n_workers(SimpleNamespace(workers=None)) == 1  # type: ignore[arg-type]
    assert StageContext.n_workers(SimpleNamespace(workers=3)) == 3  # type: ignore[arg-type]
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == 4


def test_without_a_quota_the_affinity_counts_not_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # taskset -c 3
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores(tmp_path) == 1
