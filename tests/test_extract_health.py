"""Hidden-state health: states that are finite and well-shaped but wrong (zeros, a row shifted by
padding) fail extract with the numbers, and `dflash-etl check` finds zeros in published states."""

from __future__ import annotations

import json

import pytest

from dflash_etl.core.errors import ContractError
from dflash_etl.validation.health import (
    HealthLimits,
    layer_health,
    reference_diff,
    shard_problems,
)
from dflash_etl.validation.model_outputs import check_states

torch = pytest.importorskip("torch")


def test_zeros_and_a_padding_leak_are_problems_and_good_states_are_not():
    good = torch.randn(50, 2, 8)
    assert not shard_problems(layer_health(good, [1, 2]), None, HealthLimits())
    zeros = good.clone()
    zeros[:, 1] = 0
    problems = shard_problems(layer_health(zeros, [1, 2]), None, HealthLimits())
    assert any("layer 2" in p and "100.0% of the values are exactly zero" in p
               for p in problems)
    shifted = torch.roll(good, 1, dims=0)  # each token holds its neighbour's state
    reference = {"row": 7, **reference_diff(shifted, good)}
    problems = shard_problems(layer_health(shifted, [1, 2]), reference, HealthLimits())
    assert problems and "row 7" in problems[0] and "padding leaks" in problems[0]
    assert not shard_problems([], {"row": 1, **reference_diff(good, good)}, HealthLimits())


def test_outliers_are_counted_not_failed():
    states = torch.ones(100, 1, 4)
    states[3] *= 1000  # a massive-activation token, as real targets have
    health = layer_health(states, [5])
    assert health[0]["outliers"] == 1 and health[0]["norm_max"] == pytest.approx(2000)
    assert not shard_problems(health, None, HealthLimits())


def test_healthy_states_record_their_numbers(default_tokenized, tiny_target, tmp_path, copy_run):
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path)
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2")
    health = doc["health"]
    assert [layer["layer"] for layer in health["layers"]] == [1, 2, 3]  # and the stored last
    assert all(layer["zero_share"] < 0.01 and layer["norm_mean"] > 0
               for layer in health["layers"])
    assert health["reference_rows"] >= 1 and health["reference_max_rel"] < 1e-3
    assert not health["problems"]
    from dflash_etl.report import build_docs
    from dflash_etl.validation.check import check_path

    assert check_path(run / "extract")["passed"]
    page = (build_docs(run) / "index.html").read_text()
    assert "Hidden-state health" in page and "max relative difference" in page
    curves = page[page.index('data-key="extract-norm-curves"'):]
    assert curves.count("<polyline") == 2  # mean and max norm by layer
    peak = max(layer["norm_mean"] for layer in health["layers"])
    assert f">{peak:.4g}</text>" in curves


@pytest.mark.parametrize("corruption", ["zeros", "padding_leak"])
def test_corrupted_states_fail_extract_with_the_numbers(default_tokenized, tiny_target, tmp_path,
                                                        monkeypatch, corruption, copy_run):
    from dflash_etl.models.target import Target
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path)
    real = Target.forward

    def corrupted(self, rows, logits=False, extra_layers=()):
        out, states = real(self, rows, logits=logits, extra_layers=extra_layers)
        if corruption == "zeros":
            states = [s * torch.tensor([1.0, 0.0, 1.0])[None, :, None] for s in states]
        elif len(rows) > 1:  # batched only: what a padding bug does
            states = [torch.roll(s, 1, dims=0) for s in states]
        return out, states

    monkeypatch.setattr(Target, "forward", corrupted)
    with pytest.raises(ContractError) as caught:  # the reply check's pass is not the subject
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    reply_check="off")
    message = str(caught.value)
    expected = "exactly zero" if corruption == "zeros" else "padding leaks"
    assert "health check failed" in message and expected in message
    stats = json.loads((run / ".extract.partial" / "stats.json").read_text())
    total = stats["total"]
    assert total["quarantine_reasons"].get(extract.Q_UNHEALTHY, 0) > 0
    assert total["rows_in"] == total["rows_out"] + total["rows_quarantined"]


def test_check_finds_zeros_in_published_states(default_tokenized, tiny_target, tmp_path,
                                               copy_run):
    from safetensors.torch import load_file, save_file

    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path)
    extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2")
    shard = sorted((run / "extract" / "hidden_states").glob("*.safetensors"))[0]
    data = load_file(str(shard))
    data["hidden_states"][:, 0] = 0  # layer 1 zeroed, shape and token ids intact
    save_file(data, str(shard))
    _, _, problems = check_states(run / "extract")
    assert any(shard.name in p and "layer 1" in p and "exactly zero" in p for p in problems)


def test_a_wide_shards_norms_come_from_a_sample_its_counts_from_every_value(monkeypatch):
    """At a 27B width the token norms are the check's costliest pass: past NORM_VALUES values
    they come from a strided sample of the tokens (within a few percent of every token's); the
    zero share and the non-finite count still see every value, a NaN outside the sample too."""
    from dflash_etl.validation import health

    monkeypatch.setattr(health, "NORM_VALUES", 4096)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(2000, 2, 64, generator=g).to(torch.bfloat16)
    states[1, 0, :32] = 0  # token 1: not in the sample (every 63rd token)
    states[3, 1, 5] = float("nan")
    every = torch.linalg.vector_norm(states.float().nan_to_num(0.0), dim=-1)
    sampled = layer_health(states, [4, 7])
    assert [s["non_finite"] for s in sampled] == [0, 1]
    assert sampled[0]["zero_share"] == round(32 / (2000 * 64), 6)
    for k in range(2):
        assert abs(sampled[k]["norm_median"] / float(every[:, k].median()) - 1) < 0.05
    assert health.all_finite(states[:, 0]) and not health.all_finite(states)
    inf = states.clone()
    inf[1999, 0, 63] = float("-inf")
    assert not health.all_finite(inf)


def test_a_shards_rows_are_checked_without_joining_them_with_the_same_numbers(monkeypatch):
    """A shard's health took a joined copy of its rows (torch.cat: 0.58 CPU s per GB at the
    27B width, more than the checks) and compared bf16 values layer by layer on strided
    views; now the rows are read in place and zeros found on the values' bits. The numbers are
    the joined tensor's: the sampled tokens continue across rows, +0.0 and -0.0 both count as
    zeros (their bits differ), a NaN in one row is counted in its layer."""
    from dflash_etl.validation import health

    monkeypatch.setattr(health, "NORM_VALUES", 3000)
    monkeypatch.setattr(health, "ZERO_SCAN_VALUES", 1000)  # several pieces a row
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        rows = [torch.randn(n, 3, 32, generator=g).to(dtype) for n in (37, 5, 60, 1)]
        rows[0][4, 1, :7] = 0.0
        rows[2][9, 1, 3] = -0.0
        rows[2][50, 2, :] = 0.0
        rows[1][2, 0, 5] = float("nan")
        joined = torch.cat(rows)
        assert health.layer_health(rows, [4, 7, 9]) == health.layer_health(joined, [4, 7, 9])
        got = health.layer_health(rows, [4, 7, 9])
        assert [s["zero_share"] for s in got] == [
            0.0, round(8 / (103 * 32), 6), round(32 / (103 * 32), 6)]
        assert [s["non_finite"] for s in got] == [1, 0, 0]
        assert health.zero_counts(joined) == [int((joined[:, k] == 0).sum()) for k in range(3)]
