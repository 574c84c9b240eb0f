"""Fixture chat templates × real fixture conversations, with the real Qwen3.6 tokenizer.

Each row is either masked correctly (re-checked here independently of dflash_etl's own
verification) or refused with a reason code. Every template is checked (~20 s on 2 cores);
`DFLASH_CONFORMANCE=sample` checks every fourth (sorted by path) plus Qwen3.6, and
`DFLASH_CONFORMANCE=report pytest tests/test_template_conformance.py` also writes
benchmarks/results/template_conformance.md.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

try:
    from tests.templates_helpers import (
        TEMPLATES_DIR,
        independent_problems,
        qwen_tokenizer,
        representative_conversations,
        require_fixtures,
    )
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from templates_helpers import (
        TEMPLATES_DIR,
        independent_problems,
        qwen_tokenizer,
        representative_conversations,
        require_fixtures,
    )

from dflash_etl.templates import (
    MaskRefused,
    TemplateUnusable,
    probe_template,
    tokenize_conversation,
    tokenize_conversations,
)

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "template_conformance.md"
QWEN36 = "qwen36/Qwen3.6-27B.official-reconstructed.jinja"


def _one_template(path: Path) -> tuple[str, dict]:
    tok = qwen_tokenizer()
    convs = representative_conversations()
    name = path.relative_to(TEMPLATES_DIR).as_posix()
    src = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    res = {
        "strategy": "",
        "correct": 0,
        "rows": 0,
        "refused": collections.Counter(),
        "wrong": [],
        "unusable": None,
        "probe": None,
        "ok_ids": set(),
        "used": set(),
        "batch_differs": [],
    }
    try:
        probe = probe_template(tok, src)
    except TemplateUnusable as exc:
        res["unusable"] = str(exc)
        return name, res
    res["probe"] = probe
    res["strategy"] = probe.strategy
    alone = []
    for c in convs:
        try:
            rows = tokenize_conversation(c, tok, probe, chat_template=src)
        except MaskRefused as exc:
            res["refused"][exc.code] += 1
            alone.append(exc.code)
            continue
        alone.append([(r.input_ids, r.loss_mask, r.turn, r.strategy) for r in rows])
        bad = [p for r in rows for p in independent_problems(c, r, tok, probe)]
        if bad:
            res["wrong"].append((c["id"], bad[:3]))
        else:
            res["correct"] += 1
            res["ok_ids"].add(c["id"])
            res["rows"] += len(rows)
            res["used"].update(r.strategy for r in rows)
    # the stage tokenizes a chunk at a time: the same rows or refusals as one at a time
    together = tokenize_conversations(convs, tok, probe, chat_template=src)
    for c, one, many in zip(convs, alone, together, strict=True):
        many = (many.code if isinstance(many, MaskRefused)
                else [(r.input_ids, r.loss_mask, r.turn, r.strategy) for r in many])
        if many != one:
            res["batch_differs"].append(c["id"])
    # the shortcuts the probe allowed (one render for tag templates, N+1 renders for N replies)
    # change no row and no refusal against rendering every turn
    slow = tokenize_conversations(convs, tok, probe, chat_template=src, fast=False)
    res["fast_differs"] = [c["id"] for c, f, s in zip(convs, together, slow, strict=True)
                           if _outcome(f) != _outcome(s)]
    if res["used"] - {probe.strategy}:  # e.g. render_diff, but some conversations per turn
        res["strategy"] = f"{probe.strategy} (rows: {'/'.join(sorted(res['used']))})"
    res["seconds"] = time.perf_counter() - t0
    return name, res


def _outcome(result):
    if isinstance(result, MaskRefused):
        return result.code
    return [(r.input_ids, r.loss_mask, r.turn, r.strategy, r.normalizations) for r in result]


ALL = os.environ.get("DFLASH_CONFORMANCE") != "sample"
REPORT_REQUESTED = os.environ.get("DFLASH_CONFORMANCE") == "report"


def _templates_to_check() -> list[Path]:
    paths = sorted(TEMPLATES_DIR.rglob("*.jinja"))
    if ALL:
        return paths
    return sorted({*paths[::4], TEMPLATES_DIR / QWEN36})


def _run_all():
    """Templates are independent: spread them over the cores (forked after the tokenizer and the
    conversations are loaded, so each worker parses nothing again)."""
    tok = qwen_tokenizer()
    convs = representative_conversations()
    paths = _templates_to_check()
    workers = min(os.cpu_count() or 1, 4)
    if workers == 1:
        done = [_one_template(p) for p in paths]
    else:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            done = list(pool.map(_one_template, paths))
    return tok, convs, dict(done)


@pytest.fixture(scope="module")
def conformance():
    require_fixtures()
    return _run_all()


def _summary(results) -> dict[str, int]:
    renderable = {k: v for k, v in results.items() if v["unusable"] is None}
    ok_templates = [k for k, v in renderable.items() if v["correct"] > 0 and not v["wrong"]]
    wrong = sum(len(v["wrong"]) for v in results.values())
    return {"renderable": len(renderable), "ok": len(ok_templates), "wrong": wrong}


def _write_report(convs, results) -> dict[str, int]:
    summary = _summary(results)
    renderable, ok, wrong = summary["renderable"], summary["ok"], summary["wrong"]
    total_refused = collections.Counter()
    for v in results.values():
        total_refused.update(v["refused"])  # empty for unusable templates
    lines = [
        "# Chat-template conformance",
        "",
        f"{len(results)} templates × {len(convs)} real fixture conversations, Qwen3.6 tokenizer. "
        "A conversation is *correct* when every row it yields passes an independent re-check "
        "(spans decode to the assistant contents + end-of-turn, no prompt text supervised, no "
        "token straddles a boundary, no empty think supervised); otherwise it must be refused "
        "with a reason code. Generated by "
        "`DFLASH_CONFORMANCE=report pytest tests/test_template_conformance.py`.",
        "",
        f"- templates renderable by transformers: **{renderable}** of {len(results)}",
        f"- renderable templates masking ≥1 conversation correctly with none wrong: "
        f"**{ok}** ({100 * ok / max(renderable, 1):.1f}%)",
        f"- silently wrong conversations: **{wrong}**",
        "- refusals by reason (all templates): "
        + ", ".join(f"`{k}` {n}" for k, n in total_refused.most_common()),
        "",
        "| template | strategy | correct | rows | refused (by reason) | wrong | eot | prefill |",
        "|---|---|---:|---:|---|---:|---|---|",
    ]
    for name, v in results.items():
        if v["unusable"] is not None:
            lines.append(f"| {name} | unusable | 0 | 0 | {_md(v['unusable'][:90])} | 0 | | |")
            continue
        p = v["probe"]
        refused = ", ".join(f"{k} {n}" for k, n in v["refused"].most_common())
        eot = p.eot_text.strip() or f"({p.eot_source})"
        lines.append(
            f"| {name} | {v['strategy']} | {v['correct']} | {v['rows']} | {refused} | "
            f"{len(v['wrong'])} | {_md(eot)} | {_md(repr(p.generation_prefill)[1:-1])} |"
        )
    if wrong:
        lines += ["", "## Silently wrong rows", ""]
        for name, v in results.items():
            for cid, probs in v["wrong"]:
                lines.append(f"- {name} / {cid}: {_md('; '.join(probs))}")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return summary


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def test_conformance_templates(conformance):
    _tok, convs, results = conformance
    if ALL:
        summary = _write_report(convs, results) if REPORT_REQUESTED else _summary(results)
        assert len(results) >= 100, "expected the ~109 fixture templates"
    else:
        summary = _summary(results)
        assert len(results) >= 25, "expected every fourth of the ~109 fixture templates"
    differs = {name: v["batch_differs"] for name, v in results.items() if v["batch_differs"]}
    assert not differs, f"tokenize_conversations differs from one at a time: {differs}"
    fast_differs = {name: v["fast_differs"] for name, v in results.items() if v.get("fast_differs")}
    assert not fast_differs, f"the shortcuts change rows: {fast_differs}"
    shortcut = [name for name, v in results.items()
                if v["probe"] is not None and any(v["probe"].fast_paths.values())]
    assert len(shortcut) >= 0.5 * len(results), f"shortcuts used on only {shortcut}"
    wrong = {name: v["wrong"][:2] for name, v in results.items() if v["wrong"]}
    assert summary["wrong"] == 0, f"silently wrong rows: {wrong}"
    # ≥95% over all templates (recorded in the report); a quarter of them is a sample, so 90%.
    share = 0.95 if ALL else 0.90
    assert summary["ok"] >= share * summary["renderable"], (
        f"only {summary['ok']}/{summary['renderable']} templates mask a row correctly"
    )


def test_qwen36_masks_reasoning_and_tool_calls(conformance):
    _tok, convs, results = conformance
    res = results[QWEN36]
    multi_reason_tools = [c["id"] for c in convs if c["id"].startswith("agentic_reasoning")]
    assert multi_reason_tools and set(multi_reason_tools) <= res["ok_ids"], res["refused"]
    multi_turn = [
        c["id"] for c in convs if sum(m["role"] == "assistant" for m in c["messages"]) > 1
    ]
    assert set(multi_turn) - res["ok_ids"] <= {"sharegpt_axolotl_fixtures.jsonl:1"}, (
        "multi-turn conversations must mask (only the one with an empty gpt turn is refused)"
    )
