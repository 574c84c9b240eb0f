"""The shortcuts, checked: each is on for a template only if it gives exactly the rows of the
full render diff on the probe's sample conversations."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dflash_etl.templates.limits import RenderLimitExceeded
from dflash_etl.templates.masks.conversations import _outcome, tokenize_conversations
from dflash_etl.templates.masks.policy import MaskPolicy
from dflash_etl.templates.masks.renders import FAST_GENERATION, FAST_ONE_RENDER, FAST_TURN_END
from dflash_etl.templates.probe_record import STRATEGY_GENERATION, TemplateProbe


def _sample_conversations(probe: TemplateProbe) -> list[dict[str, Any]]:
    """Canonical conversations the shortcuts must agree on: several turns, a system turn, a
    tool round trip and reasoning where the template renders them."""
    def turn(role: str, text: str, **extra: Any) -> dict[str, Any]:
        return {"role": role, "content": text, **extra}

    convs = [
        [turn("user", "What is the capital of France?"), turn("assistant", "Paris."),
         turn("user", "And of Italy?"), turn("assistant", "Rome, since 1871."),
         turn("user", "Thanks!"), turn("assistant", "You are welcome.")],
        [turn("system", "You are terse."), turn("user", "Two plus two?"),
         turn("assistant", "Four."), turn("user", "Times three?"), turn("assistant", "Twelve.")],
        [turn("user", "Think first: 7 * 6?"), turn("assistant", "42.", reasoning="7 * 6 = 42."),
         turn("user", "And 6 * 9?"), turn("assistant", "54.", reasoning="6 * 9 = 54.")],
        # reasoning on some turns only: the turns take other thinking-mode kwargs
        [turn("user", "Hi there."), turn("assistant", "Hello!"),
         turn("user", "Think: 3 + 4?"), turn("assistant", "7.", reasoning="3 + 4 = 7."),
         turn("user", "Good."), turn("assistant", "Glad to help.")],
    ]
    tools_at = len(convs)
    if probe.tool_call_args is not None and probe.tool_role == "native":
        call = [{"type": "function", "id": "call_1",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
        convs.append([turn("user", "Weather in Paris?"),
                      turn("assistant", "", tool_calls=json.dumps(call)),
                      turn("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
                      turn("assistant", "It is 18 C and sunny in Paris.")])
    return [{"id": f"probe-{k}", "source": "probe", "messages": m,
             "tools": json.dumps([{"type": "function", "function": {
                 "name": "get_weather", "description": "Weather for a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
             if k == tools_at else None} for k, m in enumerate(convs)]


def fast_paths_for(tokenizer: Any, probe: TemplateProbe, template: str | None
                   ) -> dict[str, Any]:
    """Which shortcuts give exactly the rows of the full render diff on this template, tried on
    the sample conversations with both turn policies and both end-of-turn policies. A shortcut
    that changes any row (or any refusal) there is off for the run."""
    convs = _sample_conversations(probe)
    policies = [MaskPolicy(turns=t, include_eot=e) for t in ("all", "last") for e in (True, False)]
    out: dict[str, Any] = {}
    names = [FAST_TURN_END, FAST_ONE_RENDER] + (
        [FAST_GENERATION] if probe.strategy == STRATEGY_GENERATION else [])
    for name in names:
        trial = dataclasses.replace(probe, fast_paths={name: True})
        try:
            same = all(
                [_outcome(r) for r in tokenize_conversations(convs, tokenizer, trial, policy,
                                                              chat_template=template)]
                == [_outcome(r) for r in tokenize_conversations(
                    convs, tokenizer, probe, policy, chat_template=template, fast=False)]
                for policy in policies)
        except RenderLimitExceeded:
            same = False
        out[name] = same
    return out
