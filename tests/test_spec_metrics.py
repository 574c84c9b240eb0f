"""The served acceptance is read from vLLM's own Prometheus counters: their names and layout as
vLLM's v1/spec_decode/metrics.py registers them (prometheus_client appends `_total` and adds
`_created` samples; one sample per engine, labelled with the model)."""

from __future__ import annotations

import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.spec_metrics import metrics_url, parse_counters, served_acceptance

PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 32.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 20.0
vllm:generation_tokens_total{engine="0",model_name="m"} 500.0
"""


def test_counters_are_summed_over_engines_for_the_model_only():
    c = parse_counters(PAGE, "m")
    assert c.found and (c.drafts, c.draft_tokens, c.accepted) == (40.0, 600.0, 120.0)
    assert c.per_position == {0: 32.0, 1: 20.0} and c.generated == 500.0
    assert parse_counters(PAGE).drafts == 139.0  # no model named: every engine and model
    assert not parse_counters("vllm:generation_tokens_total 5.0\n").found


def test_served_tau_is_vllms_mean_acceptance_length_between_readings():
    before = parse_counters(PAGE, "m")
    after = parse_counters(PAGE.replace("30.0", "50.0").replace("} 120.0", "} 180.0")
                           .replace("} 500.0", "} 800.0"), "m")
    doc = served_acceptance(before, after, completion_tokens=250)
    assert doc["drafts"] == 20 and doc["accepted_tokens"] == 60
    assert doc["tau"] == 1 + 60 / 20  # vLLM: 1 + accepted / drafts (the bonus token)
    assert doc["other_traffic_tokens"] == 50  # 300 generated, 250 of them ours
    with pytest.raises(StageError, match="counters did not move"):
        served_acceptance(before, before, completion_tokens=10)


def test_the_metrics_page_sits_beside_v1():
    assert metrics_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://h:1") == "http://h:1/metrics"


def test_counters_that_cannot_be_true_are_refused_with_what_likely_happened():
    """A restarted engine of a data-parallel deployment made the counters go backwards: "served
    tau -5.667", rc 0; NaN counters were internal errors (reliability issue, item 7)."""
    before = parse_counters(PAGE, "m")
    restarted = parse_counters(PAGE.replace("30.0", "5.0").replace("} 120.0", "} 160.0"), "m")
    with pytest.raises(StageError, match=r"went backwards .* an engine restarted"):
        served_acceptance(before, restarted, completion_tokens=10)
    broken = parse_counters(PAGE.replace("30.0", "NaN"), "m")
    with pytest.raises(StageError, match="not finite numbers"):
        served_acceptance(before, broken, completion_tokens=10)
