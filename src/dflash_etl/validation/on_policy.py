"""The on-policy check: the drafter must see replies rendered the way the target will serve them.

A thinking-mode mismatch between the training data and serving is a known cause of low
acceptance: replies generated with thinking on but tokenized behind a thinking-off generation
prompt (an empty think block the server never emits), or reasoning generated and then left out
of the loss. regenerate's settings say how the replies were made; tokenize counts how each row's
generation prompt was rendered. Pure: dicts in, a report out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _switch_counts(prompt_kwargs: Mapping[str, int]) -> tuple[int, int]:
    """(rows rendered behind a thinking-on switch, behind a thinking-off one) from tokenize's
    `generation_prompt_kwargs` counts ("enable_thinking=False": n, ...)."""
    on = sum(n for k, n in prompt_kwargs.items() if k.endswith("=True"))
    off = sum(n for k, n in prompt_kwargs.items() if k.endswith("=False"))
    return on, off


def on_policy_report(generated_with: Mapping[str, Any] | None, supervise_reasoning: bool,
                     rows: int, prompt_kwargs: Mapping[str, int],
                     max_share: float) -> dict[str, Any]:
    """What the replies were generated with, what tokenize rendered, the serving settings that
    match, and the mismatches (empty when on-policy). `generated_with` is regenerate's settings
    (None: the replies are the source data's, whose generation settings are unknown)."""
    on, off = _switch_counts(prompt_kwargs)
    rendered = {"rows": rows, "supervise_reasoning": supervise_reasoning,
                "generation_prompt_kwargs": dict(sorted(prompt_kwargs.items()))}
    report: dict[str, Any] = {"generated_with": dict(generated_with or {}) or None,
                              "rendered_with": rendered, "serve_with": None, "problems": []}
    if not generated_with:
        return report
    thinking = generated_with.get("thinking", "keep")
    serve: dict[str, Any] = {"temperature": generated_with.get("temperature"),
                             "max_tokens": generated_with.get("max_new_tokens")}
    if thinking != "keep":
        serve["chat_template_kwargs"] = {"enable_thinking": thinking == "on"}
    report["serve_with"] = serve
    problems = report["problems"]
    limit = max_share * rows
    if thinking == "on" and not supervise_reasoning:
        problems.append("replies were generated with thinking on ([regenerate] thinking = on) "
                        "but tokenize leaves reasoning out of the loss (supervise_reasoning = "
                        "false): the drafter would never learn the reasoning the target serves")
    if thinking == "on" and off > limit:
        problems.append(f"replies were generated with thinking on ([regenerate] thinking = on) "
                        f"but {off} of {rows} rows were rendered behind a thinking-off "
                        f"generation prompt ({_names(prompt_kwargs, '=False')}), which the "
                        "target never serves with thinking on: those replies came back without "
                        "reasoning (a server without its reasoning parser?)")
    if thinking == "off" and on > limit:
        problems.append(f"replies were generated with thinking off ([regenerate] thinking = "
                        f"off) but {on} of {rows} rows were rendered behind a thinking-on "
                        f"generation prompt ({_names(prompt_kwargs, '=True')})")
    return report


def _names(prompt_kwargs: Mapping[str, int], suffix: str) -> str:
    return ", ".join(k for k in sorted(prompt_kwargs) if k.endswith(suffix))
