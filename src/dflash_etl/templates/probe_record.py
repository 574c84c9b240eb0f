"""What probing a chat template found: the record the probe fills and the masks read.

It sits apart from the probe so that the masks (which the probe runs to check its shortcuts)
can read it without importing the probe.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

STRATEGY_GENERATION = "generation"
STRATEGY_RENDER_DIFF = "render_diff"
STRATEGY_PER_TURN = "per_turn"


@dataclass(frozen=True)
class MessageFormat:
    """How canonical messages are spelled for one template (decided by the probe)."""

    reasoning_key: str | None = "reasoning_content"  # field the template reads, None = never
    reasoning_inline: bool = False  # put reasoning into content as <think>..</think> instead
    tool_args: str = "object"  # "object" | "string": how tool-call arguments are passed
    empty_content: str = "none"  # "none" | "empty": content of a tool-call-only assistant turn
    system_mode: str = "native"  # "native" | "merge_into_user"


@dataclass
class TemplateProbe:
    """What a chat template does, as observed by rendering valid conversations."""

    template_sha256: str
    template_source: str  # "tokenizer" | "argument"
    render_kwargs: dict[str, Any]
    supplied: list[str]
    accepted_role_orders: list[str]
    rejected_role_orders: dict[str, str]
    system_mode: str
    has_generation_tags: bool
    generation_mask_usable: bool
    renders_tools: bool
    tools_required: bool
    tool_role: str  # "native" | "dropped" | "rejected" | "untested"
    tool_call_args: str | None  # "object" | "string" | None (tool calls not rendered)
    tool_call_error: str | None
    empty_content: str
    reasoning_key: str | None
    reasoning_inline: bool
    reasoning_placement: str  # "all" | "after_last_user" | "never"
    injects_empty_think: bool
    thinking_kwargs: list[str]
    prefix_stable: bool
    stable_kwargs: dict[str, Any] | None
    prefix_detail: str
    generation_prompt: str
    generation_prefill: str
    appends_assistant_header: bool
    template_uses_bos: bool
    template_emits_bos: bool
    tokenizer_adds_bos: bool
    eot_text: str
    post_eot: str
    eot_source: str  # "template" | "tokenizer_eos" | "generation_config_eos" | "none"
    eos_fallback_token: str | None
    eos_fallback_id: int | None
    strategy: str
    reason: str
    notes: list[str] = field(default_factory=list)
    # the reasoning opener ("<think>\n") a generation prompt leaves open while the template's
    # rendered turns lack it, and the kwargs under which it does (R1 distills, QwQ, MiniMax-M2)
    prefill_reasoning: str | None = None
    prefill_reasoning_kwargs: dict[str, Any] | None = None
    # the token appended to every reply when the template has no end-of-turn marker, and why
    eos_appended: dict[str, Any] | None = None
    # the shortcuts tokenize may take on this template, each checked on the probe's sample
    # conversations against the full render diff (masks.shortcuts.fast_paths_for): name -> bool
    fast_paths: dict[str, Any] = field(default_factory=dict)

    @property
    def message_format(self) -> MessageFormat:
        return MessageFormat(
            reasoning_key=self.reasoning_key,
            reasoning_inline=self.reasoning_inline,
            tool_args=self.tool_call_args or "object",
            empty_content=self.empty_content,
            system_mode=self.system_mode,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (for the run manifest)."""
        d = asdict(self)
        return json.loads(json.dumps(d, default=str))
