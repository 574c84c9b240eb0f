"""The embedded default's tiny random target ends its replies, as a real target does: a
first-time user's `dflash-etl run` then warns of nothing they could act on (a random model
otherwise runs every reply to max_new_tokens, whatever the setting)."""

from __future__ import annotations

import json
import re

import pytest

from dflash_etl.core.config import DEFAULT_CONFIG
from dflash_etl.stages import load_config


def test_the_default_target_ends_its_replies_at_varied_lengths(default_cli_run):
    cwd, result = default_cli_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in (result.stdout + result.stderr).lower()
    assert "raise --max-new-tokens" not in result.stdout + result.stderr
    run = cwd / "runs" / "default"
    penalty = load_config(DEFAULT_CONFIG).section("target")["tiny"][
        "exponential_decay_length_penalty"]
    generation = json.loads((run / "target" / "generation_config.json").read_text())
    assert generation["exponential_decay_length_penalty"] == penalty
    total = json.loads((run / "regenerate" / "stats.json").read_text())["total"]
    assert total["finish_reasons"] == {"stop": total["generated_replies"]} and total[
        "generated_replies"] > 300
    max_new_tokens = load_config(DEFAULT_CONFIG).section("regenerate")["max_new_tokens"]
    replies = [json.loads(line) for line in
               (run / "regenerate" / "generations.jsonl").read_text().splitlines()]
    lengths = {reply["new_tokens"] for reply in replies}
    assert min(lengths) > penalty[0] and max(lengths) < max_new_tokens and len(lengths) >= 5


@pytest.mark.parametrize(("spec", "expected"), [
    ({"layers": 0}, "layers = 0: give a whole number from 1 to 64"),
    ({"hidden_size": -8}, "hidden_size = -8: give a whole number from 1 to 4096"),
    ({"hidden_size": 1_000_000}, "hidden_size = 1000000"),
    ({"heads": 3}, "hidden_size 64 must be a multiple of heads 3"),
    ({"seed": "x"}, "seed = 'x': give a whole number"),
])
def test_a_tiny_spec_torch_cannot_build_is_refused_naming_the_key(tmp_path, spec, expected):
    """A zero-layer or negative-width tiny target failed inside torch as an internal error;
    then it was refused when a stage first built it (after ingest: hours at scale). It is
    refused with the config, before any stage runs; the builder keeps the check too."""
    from dflash_etl.core.config import ConfigError
    from dflash_etl.core.errors import StageError
    from dflash_etl.models.tiny_model import _tiny_target

    (tmp_path / "pipeline.toml").write_text(
        '[[sources]]\npath = "a.jsonl"\n[target]\ntiny = ' + _toml(spec) + "\n")
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(tmp_path / "pipeline.toml")
    with pytest.raises(StageError, match=re.escape(expected)):
        _tiny_target(tmp_path / "run" / "target", spec)
    assert not (tmp_path / "run" / "target").exists()


def _toml(spec: dict) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in spec.items()) + " }"


@pytest.mark.parametrize(("omp", "expected"), [(None, "1"), ("2", "2")])
def test_a_small_model_runs_torch_on_one_thread_unless_the_user_set_it(tiny_target, omp,
                                                                       expected):
    """torch's default (a thread per core) made the tiny targets ~18x slower on a contended
    2-core machine; a thread count the user set is kept."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch\nfrom dflash_etl.models.loading import load_causal_lm\n"
            "torch.set_num_threads(2)\nload_causal_lm(sys.argv[1])\n"
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                            "MKL_NUM_THREADS")}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", code, str(tiny_target)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == expected
