"""The report's pages: the run summary (index.html) and one page per validation."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from dflash_etl.report.collect import StageInfo, coverage_curve
from dflash_etl.report.html import badge, esc, page, table, truncate
from dflash_etl.report.svg import curve_svg, histogram_svg

HIST_LABELS = {
    "n_turns": "turns per conversation",
    "seq_len": "tokens per row (seq_len)",
    "supervised_tokens": "supervised tokens per row",
    "supervised_fraction": "supervised fraction per row",
}
PROBE_KEYS = ("strategy", "reason", "template_sha256", "template_source", "system_mode",
              "tool_role", "tool_call_args", "reasoning_placement", "prefix_stable",
              "prefix_detail", "generation_prompt", "prefill_reasoning", "eos_appended",
              "accepted_role_orders", "rejected_role_orders", "fast_paths")
POLICY_KEYS = ("strategy", "include_eot", "supervise_reasoning", "turns", "seq_length",
               "truncation", "min_supervised_tokens", "draft_vocab_size", "chat_template",
               "model", "cross_check")


# --------------------------------------------------------------- pieces
def _render_paths(stats: dict[str, Any]) -> str:
    """How the written conversations were rendered (one render, the tags' one render, or every
    turn) and the renders per conversation: the stage's largest cost."""
    total = stats.get("total", {})
    paths, renders, out = total.get("render_paths"), total.get("renders"), total.get("rows_out")
    if not paths or not out:
        return ""
    return "<h3>Renders</h3>" + table(["render path", "conversations"], sorted(paths.items())) \
        + f"<p>{renders / out:.2f} renders per written conversation</p>"


def _reasons(counts: dict[str, int] | None) -> str:
    if not counts:
        return "0"
    inner = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda x: -x[1]))
    return f"{sum(counts.values())} ({inner})"


def accounting_section(stage: StageInfo) -> str:
    if not stage.stats:
        return '<p class="muted">no stats.json: the stage stopped before its accounting</p>'
    total = stage.stats["total"]
    key = stage.name
    rows = [
        ("rows in", f'<span data-key="{key}-rows_in">{total["rows_in"]}</span>'),
        ("rows out", f'<span data-key="{key}-rows_out">{total["rows_out"]}</span>'),
        ("quarantined (by reason)", escape(_reasons(total.get("quarantine_reasons")))),
        ("filtered (by reason)", escape(_reasons(total.get("rows_filtered")))),
    ]
    for extra in ("rows_written", "tokens", "supervised_tokens", "rows_truncated",
                  "cross_checked"):
        if extra in total:
            rows.append((extra.replace("_", " "), f'<span data-key="{key}-{extra}">'
                         f"{total[extra]}</span>"))
    html = table(["", "count"], rows, raw=True)
    sources = []
    for name, s in stage.stats.get("sources", {}).items():
        rate = s["rows_quarantined"] / s["rows_in"] if s["rows_in"] else 0.0
        mix = s.get("mix") or {}
        sources.append([name, s["rows_in"], s["rows_out"], s["rows_quarantined"],
                        f"{rate:.1%}", _reasons(s.get("rows_filtered")),
                        s.get("rows_written", mix.get("target_share"))])
    last = "rows written" if stage.name == "tokenize" else "target share (weight)"
    html += "<h3>Per source</h3>" + table(
        ["source", "in", "out", "quarantined", "quarantine rate", "filtered", last], sources)
    warnings = stage.stats.get("warnings") or []
    if warnings:  # e.g. a source that yielded no rows (ingest)
        html += (f'<h3>Warnings</h3><ul data-key="{key}-warnings">'
                 + "".join(f"<li>{escape(str(w))}</li>" for w in warnings) + "</ul>")
    return html


def quarantine_section(stage: StageInfo) -> str:
    if not stage.quarantine:
        return "<p>No quarantined rows.</p>"
    parts = []
    for item in stage.quarantine:
        rows = []
        for ex in item["examples"]:
            where = f"{ex.get('file') or ''}:{ex.get('line') or ''}"
            rows.append([ex.get("source"), ex.get("id") or where, truncate(ex.get("message")),
                         truncate(ex.get("raw"), 200) if "raw" in ex else None])
        parts.append(f"<h3><code>{escape(item['reason'])}</code>: {item['count']} rows</h3>"
                     + table(["source", "where", "message", "raw"], rows))
    return "".join(parts)


def mix_filters_section(stage: StageInfo) -> str:
    """What decontamination and near-dedup removed: counts, and the first removals with what
    they matched (a benchmark item's shared words; the kept row and the similarity)."""
    found, html = stage.mix_filters, ""
    if "benchmarks" in found:
        html += ('<h3>Benchmark files</h3><div data-key="ingest-benchmarks">'
                 + table(["benchmark", "file", "items", "items looked for", "rows removed"],
                         found["benchmarks"]) + "</div>")
    if "contamination" in found:
        c = found["contamination"]
        html += ('<h3>Benchmark contamination</h3><div data-key="ingest-contamination">'
                 + table(["benchmark", "source", "rows removed"], c["per"])
                 + table(["source", "where", "benchmark", "item", "shared words"], [
                     [ex["source"], f"{ex['file']}:{ex['line']}", ex["benchmark"], ex["item"],
                      truncate(ex["shared"], 200)] for ex in c["examples"]]) + "</div>")
    if "near_duplicates" in found:
        n = found["near_duplicates"]
        rows = []
        for ex in n["examples"]:
            kept = ex.get("kept") or {}
            rows.append([f"{ex['similarity']:.3f}", f"{ex['source']} {ex['file']}:{ex['line']}",
                         truncate(ex.get("raw"), 240),
                         f"{kept.get('source', '')} {kept.get('file', '')}:{kept.get('line', '')}",
                         truncate(kept.get("text"), 240)])
        html += ('<h3>Near-duplicates</h3><div data-key="ingest-near-duplicates">'
                 f"<p>{n['rows']} rows removed in {n['clusters']} clusters (each kept row with "
                 "the rows that repeat it)</p>"
                 + table(["source", "rows removed"], n["per_source"])
                 + "<p>The least similar removals (estimated Jaccard):</p>"
                 + table(["similarity", "removed (where)", "removed (source line)", "kept (where)",
                          "kept (first user message)"], rows) + "</div>")
    return html


def charts_section(stage: StageInfo) -> str:
    profile = (stage.validation or {}).get("profile") or {}
    if not profile:
        return '<p class="muted">no histograms: the suite did not run on this output</p>'
    figures = []
    for name, hist in profile.items():
        label = HIST_LABELS.get(name, name)
        mean = f", mean {hist['mean']:.3g}" if hist.get("mean") is not None else ""
        figures.append(f"<figure>{histogram_svg(hist, label)}<figcaption>{escape(label)}: "
                       f"{hist.get('n', 0)} rows{mean}</figcaption></figure>")
    return f'<div class="charts">{"".join(figures)}</div>'


def eos_appended_note(probe: dict[str, Any], settings: dict[str, Any] | None) -> str:
    """Say which token is appended to every reply and why: without it a reviewer reads the
    supervised eos as a token after the turn."""
    eos = probe.get("eos_appended")
    if not isinstance(eos, dict):
        return ""
    if settings and settings.get("include_eot") is False:
        return ('<p class="eos-appended"><b>No end of turn:</b> the template renders none, and '
                "include_eot = false: nothing is appended or supervised after the replies.</p>")
    token = "no token" if eos.get("token") is None else f"<code>{escape(str(eos['token']))}</code>"
    ident = "" if eos.get("id") is None else f" (id {esc(eos['id'])}, {esc(eos.get('source'))})"
    return (f'<p class="eos-appended"><b>Appended end of turn:</b> {token}{ident}: '
            f"{esc(eos.get('why'))}</p>")


def _asked(mix: dict[str, Any]) -> str:
    """A weighted source's asked share: of rows (ingest sampled them; its section shows the
    share reached), or of the weighted sources' supervised tokens, with the share reached."""
    if "asked_supervised_share" in mix:
        return (f"{mix['asked_supervised_share']:.1%} of supervised tokens "
                f"({mix['achieved_supervised_share']:.1%})")
    return f"{mix['asked_row_share']:.1%} of rows" if "asked_row_share" in mix else ""


def tokenize_section(stage: StageInfo) -> str:
    html = ""
    if stage.probe:
        probe_rows = [(k, stage.probe.get(k)) for k in PROBE_KEYS if k in stage.probe]
        html += "<h3>Template probe and mask strategy</h3>" + table(["", "value"], probe_rows)
        html += eos_appended_note(stage.probe, stage.settings)
    if stage.settings:
        policy = [(k, stage.settings.get(k)) for k in POLICY_KEYS if k in stage.settings]
        html += "<h3>Mask policy (settings)</h3>" + table(["", "value"], policy)
    mix = (stage.stats or {}).get("learning_mix")
    if mix:
        html += ("<h3>What the drafter learns from, per source</h3>" + table(
            ["source", "rows", "share", "tokens", "share", "supervised tokens", "share",
             "weight asked (reached)"],
            [(name, m["rows_written"], f"{m['rows_written_share']:.1%}", m["tokens"],
              f"{m['tokens_share']:.1%}", m["supervised_tokens"],
              f"{m['supervised_tokens_share']:.1%}", _asked(m))
             for name, m in mix.items()]))
    html += _row_views(stage)
    strategies = (stage.stats or {}).get("total", {}).get("strategies")
    if strategies:
        html += "<h3>Rows per mask strategy</h3>" + table(
            ["strategy", "rows"], sorted(strategies.items()))
    html += _render_paths(stage.stats or {})
    policy = (stage.stats or {}).get("on_policy")
    if policy:
        html += on_policy_section(policy)
    if stage.draft_vocab or stage.token_freq:
        dv, tf = stage.draft_vocab or {}, stage.token_freq or {}
        coverage = dv.get("coverage")
        html += "<h3>Draft vocabulary</h3>" + table(["", "value"], [
            ("draft vocab size", dv.get("size")),
            ("coverage of supervised tokens",
             f"{coverage:.2%}" if isinstance(coverage, float | int) else None),
            ("distinct supervised tokens", tf.get("distinct_tokens")),
            ("supervised tokens", tf.get("supervised_tokens")),
            ("target vocab size", tf.get("vocab_size")),
        ])
        if tf:
            html += ("<figure>" + curve_svg(coverage_curve(tf), "coverage",
                                            "k most frequent supervised tokens")
                     + "<figcaption>share of supervised tokens covered by the k most frequent "
                       "tokens</figcaption></figure>")
    return html


def _row_views(stage: StageInfo) -> str:
    """Sample rows decoded with their supervised tokens highlighted (published output only:
    a failed stage's partial rows may not be whole)."""
    model = (stage.settings or {}).get("model")
    if stage.partial or not model or not Path(model).is_dir():
        return ""
    from dflash_etl.models.tokenizer import load_tokenizer
    from dflash_etl.report.rows import row_views, rows_html

    try:
        return rows_html(row_views(stage.directory, load_tokenizer(model)))
    except Exception as exc:  # the report never fails a stage
        return f'<p class="muted">rows not shown: {escape(str(exc)[:200])}</p>'


def on_policy_section(policy: dict[str, Any]) -> str:
    """How the replies were generated, how the rows were rendered, and the serving settings the
    drafter must be used with (a mismatch fails tokenize; its problems are listed)."""
    def shown(value: Any) -> str:
        return json.dumps(value, sort_keys=True) if value is not None else "unknown"

    serve = policy.get("serve_with")
    rows = [("replies generated with", shown(policy.get("generated_with"))),
            ("rows rendered with", shown(policy.get("rendered_with"))),
            ("serve the drafter with", shown(serve) if serve else
             "the settings the source data was generated with (not regenerated here)")]
    rows += [("mismatch", problem) for problem in policy.get("problems", [])]
    return "<h3>On-policy check</h3>" + table(["", "value"], rows)


def extract_section(stage: StageInfo) -> str:
    total = (stage.stats or {}).get("total", {})
    keys = ("layers", "stored_layers", "n_layers", "hidden_size", "dtype", "format",
            "padding_share")
    html = "<h3>Hidden states</h3>" + table(["", "value"], [
        (k.replace("_", " "), total.get(k)) for k in keys if k in total])
    health = (stage.stats or {}).get("health")
    if health:
        rel = health.get("reference_max_rel")
        html += ("<h3>Hidden-state health</h3><p>per layer over every shard; "
                 f"{health.get('reference_rows', 0)} batched rows re-run alone, max relative "
                 f"difference {rel if rel is None else f'{rel:.2e}'}</p>" + table(
                     ["layer", "tokens", "zero share", "mean norm", "max norm", "non-finite",
                      "outliers (> 50x median)"],
                     [(h["layer"], h["tokens"], f"{h['zero_share']:.2%}", h["norm_mean"],
                       h["norm_max"], h["non_finite"], h["outliers"])
                      for h in health.get("layers", [])]))
        html += norm_curves(health.get("layers", []))
    return html


def norm_curves(layers: list[dict[str, Any]]) -> str:
    """Mean and max per-token L2 norm by target layer: a healthy target's norms grow with depth
    (a flat zero line, or one layer far off the others, is what the zeros of a broken kernel and
    a leaking pad look like)."""
    if not layers:
        return ""
    charts = []
    for key, what in (("norm_mean", "mean"), ("norm_max", "max")):
        peak = max(float(h[key]) for h in layers) or 1.0
        points = [(float(h["layer"]), float(h[key]) / peak) for h in layers]
        charts.append(curve_svg(points, f"{what} token L2 norm per layer", "target layer",
                                top=f"{peak:.4g}"))
    return ('<h3>Norms per layer</h3><div class="charts" data-key="extract-norm-curves">'
            + "".join(charts) + "</div>")


def train_section(stage: StageInfo) -> str:
    """The drafter's acceptance length before and after training, and its loss curve."""
    total = (stage.stats or {}).get("total", {})
    ev = stage.evaluation or {}

    def tau(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float | int) else "n/a"

    html = "<h3>Acceptance length (tau)</h3>" + table(["", "value"], [
        ("tau, untrained drafter", f'<span data-key="train-tau_untrained">'
                                   f"{tau(ev.get('tau_untrained'))}</span>"),
        ("tau, trained drafter", f'<span data-key="train-tau_final">'
                                 f"{tau(ev.get('tau_final'))}</span>"),
        ("held-out prompts / tokens decoded each",
         f"{ev.get('prompts')} / {ev.get('max_new_tokens')}"),
        ("block size (max tau)", total.get("block_size")),
    ], raw=True)
    # steps/s and the steps this run made are the run's record: the manifest's stage entry has
    # them, stats.json does not
    numbers = {**total, "steps_per_s": stage.manifest.get("steps_per_s"),
               "steps_this_run": stage.manifest.get("steps_this_run")}
    html += "<h3>Training</h3>" + table(["", "value"], [
        (k.replace("_", " "), numbers.get(k)) for k in (
            "steps", "steps_this_run", "steps_per_s", "final_loss", "draft_layers",
            "target_layers", "drafter_parameters", "mask_token_id", "online")])
    history = ev.get("history") or []
    if len(history) > 2:
        html += table(["step", "tau"], [(h["step"], tau(h["tau"])) for h in history])
    losses = [(float(r["step"]), float(r["loss"])) for r in stage.train_log if "loss" in r]
    if losses:
        peak = max(v for _, v in losses) or 1.0
        html += ("<figure>" + curve_svg([(x, v / peak) for x, v in losses], "training loss",
                                        "step", top=f"{peak:.2f}")
                 + "<figcaption>training loss (decay-weighted block cross-entropy) per step"
                   "</figcaption></figure>")
    return html


NO_SUITE = ("extract", "train")  # gated by their contracts only


def gate_cells(stage: StageInfo, link: bool = True) -> list[str]:
    contract = badge(stage.contract_passed)
    suite = badge(None, "NO SUITE") if stage.name in NO_SUITE else badge(stage.gate_passed)
    if link and stage.validation is not None:
        suite += f' <a href="validations/{stage.name}.html">validation page</a>'
    status_ok = None if stage.status in ("running", "unknown") else stage.status == "complete"
    where = f"{stage.directory}" + (" (partial: not published)" if stage.partial else "")
    return [escape(stage.name), badge(status_ok, stage.status.upper()), contract, suite,
            f"<code>{escape(where)}</code>"]


def _tau_row(stages: list[StageInfo]) -> list[tuple[str, str]]:
    """The run's headline when it trained a drafter: tau before and after."""
    ev = next((s.evaluation for s in stages if s.name == "train" and s.evaluation), None)
    if not ev or not isinstance(ev.get("tau_final"), float | int):
        return []
    return [("drafter acceptance length tau", f"{ev['tau_untrained']:.3f} untrained -> "
             f"{ev['tau_final']:.3f} trained (block {ev.get('block_size')}, "
             f"{ev.get('prompts')} held-out prompts)")]


# --------------------------------------------------------------- pages
FAILURE_MODES = "docs/failure-modes.md"  # in dflash-etl's source tree


def failure_modes_link() -> str:
    """A line to the failure-mode table (what each data mistake costs in acceptance, and the
    check here that stops it): a link where the source tree is beside the package (a checkout,
    an editable install), else its path in the project."""
    page_path = Path(__file__).resolve().parents[3] / FAILURE_MODES
    name = (f'<a href="{escape(page_path.as_uri())}">{FAILURE_MODES}</a>' if page_path.is_file()
            else f"{FAILURE_MODES} in dflash-etl's source")
    return (f'<p class="muted">What each data mistake (dummy replies, off-policy replies, wrong '
            f"masks, cut replies, other layers) costs in acceptance, and the check here that "
            f"stops it: {name}.</p>")


def summary_page(run_root: Path, manifest: dict[str, Any], stages: list[StageInfo]) -> str:
    ok = all(s.status == "complete" and s.gate_passed is not False
             and s.contract_passed is not False for s in stages) and bool(stages)
    nav = "<nav>" + "".join(
        f'<a href="validations/{s.name}.html">{escape(s.name)} validation</a>'
        for s in stages if s.validation is not None) + "</nav>"
    body = [f"<section><h2>Run {badge(ok, 'ALL GATES PASSED' if ok else 'FAILED')}</h2>"
            + table(["", "value"], [
                ("run directory", str(run_root)),
                ("config hash", manifest.get("config_hash")),
                ("dflash-etl", (manifest.get("packages") or {}).get("dflash-etl")),
                ("great-expectations", (manifest.get("packages") or {}).get(
                    "great-expectations")),
                ("input files", len(manifest.get("inputs") or [])),
                *_tau_row(stages),
            ]) + failure_modes_link() + "<h3>Gates</h3>"
            + table(["stage", "status", "contract", "suite", "output"],
                    [gate_cells(s) for s in stages], raw=True) + "</section>"]
    for s in stages:
        error = s.manifest.get("error")
        failed = f"<h3>Error</h3><pre>{escape(error)}</pre>" if error and s.status == "failed" \
            else ""
        timing = s.manifest.get("seconds")
        body.append(
            f'<section id="stage-{s.name}"><h2>{escape(s.name)} '
            f"{badge(s.status == 'complete', s.status.upper())}</h2>{failed}"
            + (f'<p class="muted">{timing} s</p>' if timing is not None else "")
            + "<h3>Row accounting</h3>" + accounting_section(s)
            + (mix_filters_section(s) if s.name == "ingest" else "")
            + (tokenize_section(s) if s.name == "tokenize" else "")
            + (extract_section(s) if s.name == "extract" else "")
            + (train_section(s) if s.name == "train" else "")
            + "<h3>Distributions</h3>" + charts_section(s)
            + "<h3>Top quarantine reasons</h3>" + quarantine_section(s) + "</section>")
    if not stages:
        body.append("<section><p>No stage output in this run yet.</p></section>")
    body.append(evaluation_section(run_root))
    title = f"dflash-etl run {run_root.name}"
    return page(title, "".join(body), nav)


def evaluation_section(run_root: Path) -> str:
    """`dflash-etl eval`'s results (<run>/eval/*.json): tau per benchmark beside the untrained
    drafter's, and what each verify step added."""
    docs = []
    for path in sorted((run_root / "eval").glob("*.json")):
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    docs = [d for d in docs if isinstance(d, dict) and ("tau" in d or "served" in d)]
    if not docs:
        return ""
    html = ('<section id="evaluation"><h2>Acceptance per benchmark</h2><p>tau: the simulator\'s '
            'mean over turns of each turn\'s mean, as z-lab\'s benchmark counts it (MT-Bench: '
            'two turns per item; per item: its turns\' steps pooled); tokens per step: every '
            'step pooled, as a server\'s counters pool them; served: the deployment\'s own 1 + '
            'accepted / drafts, pooled the same way (<code>dflash-etl eval --server</code>): '
            'compare it with tokens per step, not with tau. Served and pooled differ for the '
            'same drafter when the deployment does not run what was trained.</p>' + table(
        ["benchmark", "tau", "per item", "untrained", "tokens per step", "served tokens per step",
         "prompts", "verify steps", "by category"],
        [(d.get("benchmark"), d.get("tau", ""), d.get("tau_per_item", ""), d.get("baseline", ""),
          d.get("tokens_per_step", ""), (d.get("served") or {}).get("tau", ""), d.get("prompts"),
          d.get("verify_steps"), ", ".join(f"{c} {t}" for c, t in
                                           (d.get("tau_by_category") or {}).items()))
         for d in docs]))
    html += tree_section(docs)
    for d in docs:
        steps = {int(k): v for k, v in (d.get("accepted_per_step") or {}).items()}
        if steps:
            top = max(steps)
            html += ("<figure>" + histogram_svg(
                {"counts": [steps.get(k, 0) for k in range(1, top + 1)],
                 "edges": [k - 0.5 for k in range(1, top + 2)]},
                f"{d.get('benchmark')}: tokens added per verify step")
                + "</figure>")
    return html + "</section>"


def tree_section(docs: list[dict[str, Any]]) -> str:
    """`eval --tree-budget`: per benchmark the chain's tau beside each DDTree budget's (tau,
    nodes verified per step), and per benchmark the budget curve (tau against the budget)."""
    trees = [d for d in docs if d.get("tree")]
    if not trees:
        return ""
    budgets = sorted({int(b) for d in trees for b in d["tree"]})
    rows = [(d.get("benchmark"), d.get("tau", ""), *(
        f"{t['tau']} ({t['nodes_per_step']} nodes)" if (t := d["tree"].get(str(b))) else ""
        for b in budgets)) for d in trees]
    html = ("<h3>Tree verification (DDTree)</h3><p>The same drafter verified as a tree of at "
            "most B drafts (best-first on the path's probability, greedy): tau per budget, and "
            "the nodes one verify pass reads per step (the cost; the chain reads the block)."
            "</p>" + table(["benchmark", "chain tau", *(f"tree {b}" for b in budgets)], rows))
    for d in trees:
        points = [(int(b), t["tau"]) for b, t in sorted(d["tree"].items(),
                                                         key=lambda kv: int(kv[0]))]
        top = max(t for _, t in points) or 1
        html += ("<figure>" + curve_svg([(b, t / top) for b, t in points],
                                        f"{d.get('benchmark')}: tau by tree budget",
                                        "tree budget (nodes)", top=f"tau {top:.3f}")
                 + "</figure>")
    return html


def _short(value: Any) -> Any:
    """Floats to 4 decimals (also inside lists), for tables a person reads."""
    if isinstance(value, list):
        return [_short(v) for v in value]
    return round(value, 4) if isinstance(value, float) else value


def sample_rows_table(rows: list[dict[str, Any]]) -> str:
    """The failing rows of an expectation as a small table (checked columns first)."""
    if not rows:
        return ""
    cols = [c for c in rows[0] if any(r.get(c) is not None for r in rows)]
    return table(cols, [[_short(r.get(c)) for c in cols] for r in rows])


def expectation_rows(result: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    rows, classes = [], []
    for e in result.get("expectations", []):
        observed = e.get("observed_value")
        if e.get("unexpected_count") is not None:
            pct = e.get("unexpected_percent") or 0.0
            observed = f"{e['unexpected_count']} of {e.get('element_count')} unexpected " \
                       f"({pct:.2f}%)"
        samples = ""
        if e.get("samples"):
            samples += f"values: {esc(_short(e['samples']))}"
        if e.get("sample_rows"):
            samples += sample_rows_table(e["sample_rows"])
        if e.get("error"):
            samples += f"<br>error: <code>{escape(truncate(e['error'], 500))}</code>"
        rows.append([badge(bool(e["success"])), escape(e.get("frame", "")),
                     f"<code>{escape(str(e.get('type')))}</code>"
                     f'<div class="muted">{escape(e.get("why", ""))}</div>',
                     escape(", ".join(map(str, e.get("columns", [])))) or "table",
                     esc(e.get("kwargs") or None), esc(_short(observed)), samples])
        classes.append("" if e["success"] else "failed")
    return rows, classes


def validation_body(result: dict[str, Any], heading: str) -> str:
    stats = result.get("statistics", {})
    rows, classes = expectation_rows(result)
    sources = result.get("sources") or []
    source_table = ""
    if sources:
        cols = list(sources[0])
        source_table = "<h3>Per-source frame</h3>" + table(
            cols, [[_short(r.get(c)) for c in cols] for r in sources])
    return (
        f'<section data-suite="{escape(result.get("suite", ""))}">'
        f"<h2>{escape(heading)} {badge(bool(result.get('passed')))}</h2>"
        + table(["", "value"], [
            ("suite", f"expectations/{result.get('suite')}.json"),
            ("output", result.get("stage_dir")),
            ("rows validated", result.get("rows")),
            ("expectations", f"{stats.get('successful')} of {stats.get('evaluated')} passed"),
            ("parameters", result.get("parameters")),
            ("seconds", result.get("seconds")),
        ])
        + "<h3>Expectations</h3>"
        + table(["status", "frame", "expectation (why)", "column", "limits", "observed",
                 "unexpected samples"], rows, classes, raw=True)
        + source_table + "</section>"
    )


def validation_page(stage: StageInfo) -> str:
    result = stage.validation or {}
    nav = '<nav><a href="../index.html">run summary</a></nav>'
    body = validation_body(result, f"{stage.name}: suite {result.get('suite')}")
    if stage.contract:
        contract_rows = [[f.get("check"), f.get("column"), f.get("shard"), f.get("count"),
                          f.get("samples")] for f in stage.contract.get("failures", [])]
        body += (f"<section><h2>Contract {escape(str(stage.contract.get('contract')))} "
                 f"{badge(stage.contract_passed)}</h2>"
                 f"<p>{stage.contract.get('rows')} rows in {stage.contract.get('shards')} "
                 "shards</p>"
                 + (table(["check", "column", "shard", "failing", "samples"], contract_rows)
                    if contract_rows else "<p>All contract checks passed.</p>") + "</section>")
    title = f"{stage.name} validation — {'passed' if result.get('passed') else 'FAILED'}"
    return page(title, body, nav)


def check_page(report: dict[str, Any]) -> str:
    """`dflash-etl check --report`: contracts and suites of each checked output."""
    parts = [f"<section><h2>Check {badge(bool(report.get('passed')))}</h2>"
             f"<pre>{escape(report.get('summary', ''))}</pre></section>"]
    for stage in report.get("stages", []):
        failures = [[f.get("check"), f.get("column"), f.get("shard"), f.get("count"),
                     f.get("samples")] for f in stage.get("failures", [])]
        parts.append(
            f"<section><h2>Contract {escape(str(stage.get('contract')))} on "
            f"<code>{escape(str(stage.get('path')))}</code> {badge(bool(stage.get('passed')))}"
            "</h2>" + (table(["check", "column", "shard", "failing", "samples"], failures)
                       if failures else "<p>All contract checks passed.</p>")
            + "".join(f"<p>accounting: {escape(p)}</p>"
                      for p in stage.get("accounting_problems", [])) + "</section>")
        if stage.get("suite_result"):
            parts.append(validation_body(stage["suite_result"],
                                         f"Suite {stage['suite_result'].get('suite')}"))
    return page("dflash-etl check", "".join(parts))
