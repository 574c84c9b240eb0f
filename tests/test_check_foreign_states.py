"""`dflash-etl check` on speculators-format states made elsewhere (a directory of
hs_<i>.safetensors, as speculators' data generation writes them from a serving engine): the
hidden-state health check that would have caught the all-zero states of hybrid targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_etl.cli.main import main

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402


def _write(directory: Path, n: int, corrupt: dict[int, str] | None = None,
           dtype=torch.float32) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        states = torch.randn(12 + i, 4, 16, generator=gen)  # [tokens, layers + last, hidden]
        kind = (corrupt or {}).get(i)
        if kind == "zeros":
            states[:, 2] = 0  # one layer all zeros: the hybrid-model failure
        elif kind == "nan":
            states[3, 1, 5] = float("nan")
        save_file({"hidden_states": states.to(dtype),
                   "input_ids": torch.arange(12 + i)}, str(directory / f"hs_{i}.safetensors"))


def test_healthy_foreign_states_pass(tmp_path, capsys):
    _write(tmp_path / "gen" / "hidden_states", 3, dtype=torch.bfloat16)
    assert main(["check", str(tmp_path / "gen")]) == 0
    out = capsys.readouterr().out
    assert "PASS speculators hidden states" in out and "3 files" in out


def test_zero_and_nan_states_fail_naming_file_and_layer(tmp_path, capsys):
    _write(tmp_path / "gen", 4, {1: "zeros", 3: "nan"})
    assert main(["check", str(tmp_path / "gen")]) == 1
    out = capsys.readouterr().out
    assert "hs_1.safetensors: layer 2: 100.0% of the values are exactly zero" in out
    assert "hs_1.safetensors: layer 2: every state is zero" in out
    assert "hs_3.safetensors: stored layer 1: 1 non-finite values" in out
    assert "2 of 4 files fail" in out and "checks FAILED" in out


def test_an_unreadable_file_fails_with_its_reason(tmp_path, capsys):
    _write(tmp_path / "gen", 2)
    (tmp_path / "gen" / "hs_1.safetensors").write_bytes(b"\x00" * 10)
    assert main(["check", str(tmp_path / "gen")]) == 1
    assert "hs_1.safetensors: cannot be read as speculators states" in capsys.readouterr().out
