"""The embedded default's tiny random target ends its replies, as a real target does: a
first-time user's `dflash-etl run` then warns of nothing they could act on (a random model
otherwise runs every reply to max_new_tokens, whatever the setting)."""

from __future__ import annotations

import json

from dflash_etl.core.config import DEFAULT_CONFIG, load_config


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
