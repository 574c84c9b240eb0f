"""The shared types of the masks: the policy, the reason codes a refusal carries, the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_etl.templates.limits import RenderTimeout, RenderTooLarge

# Filters: the row is fine but there is nothing (or too little) to train on; counted as filtered.
R_NEEDS_RESPONSE = "needs_response"
R_NO_ASSISTANT_TURN = "no_assistant_turn"
R_TOO_FEW_SUPERVISED = "too_few_supervised_tokens"
R_EXCEEDS_SEQ_LENGTH = "exceeds_seq_length"
# Quarantine: the row (or the template) cannot be masked correctly; someone must look at it.
R_INVALID_CONVERSATION = "invalid_conversation"
R_EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
R_ROLE_ORDER = "template_rejects_role_order"
R_RENDER_ERROR = "template_render_error"
R_DROPS_SYSTEM = "template_drops_system"
R_DROPS_TOOLS = "template_drops_tools"
R_DROPS_TOOL_CALLS = "template_drops_tool_calls"
R_DROPS_TOOL_MESSAGES = "template_drops_tool_messages"
R_REASONING_NOT_RENDERED = "reasoning_not_rendered"
R_NOT_PREFIX_STABLE = "template_not_prefix_stable"
R_GENERATION_PROMPT_MISMATCH = "generation_prompt_mismatch"
R_EMPTY_THINK_SUPERVISED = "would_supervise_empty_think"
R_REPLY_MISSING_CONTENT = "reply_missing_content"
R_EOT_NOT_FOUND = "eot_not_found"
R_NO_EOS = "no_eos_token"
R_GENERATION_TAGS_UNUSABLE = "generation_tags_unusable"
R_TOKEN_STRADDLES_BOUNDARY = "token_straddles_boundary"
R_MASK_VERIFICATION_FAILED = "mask_verification_failed"
R_RENDER_TIMEOUT = RenderTimeout.code  # "template_render_timeout": over [tokenize] limits
R_OUTPUT_TOO_LARGE = RenderTooLarge.code  # "template_output_too_large"
LIMIT_CODES = frozenset({R_RENDER_TIMEOUT, R_OUTPUT_TOO_LARGE})  # final: never retried otherwise
# a turn that would train two think blocks (an empty prompt block then reasoning, or reasoning
# left in the content by a splitter that missed a generation prompt's `<think>\n` prefill)
R_DUPLICATED_THINK = "duplicated_think_markup"
# the generation prompt opens a reasoning block (R1 distills: "<think>\n") the template's turns
# lack, and the turn has no reasoning: what the model writes before closing the block is unknown
R_PREFILL_NEEDS_REASONING = "prefill_needs_reasoning"
# a message's text holds a special token's string (`<|im_end|>`): encoded, it would become the
# real token, a fake turn in the prompt or supervised in a reply
R_SPECIAL_TOKEN_IN_CONTENT = "special_token_in_content"
THINK_TAGS = ("<think>", "</think>")

FILTER_CODES = frozenset(
    {R_NEEDS_RESPONSE, R_NO_ASSISTANT_TURN, R_TOO_FEW_SUPERVISED, R_EXCEEDS_SEQ_LENGTH}
)
QUARANTINE_CODES = frozenset(
    {
        R_INVALID_CONVERSATION,
        R_EMPTY_ASSISTANT_TURN,
        R_ROLE_ORDER,
        R_RENDER_ERROR,
        R_DROPS_SYSTEM,
        R_DROPS_TOOLS,
        R_DROPS_TOOL_CALLS,
        R_DROPS_TOOL_MESSAGES,
        R_REASONING_NOT_RENDERED,
        R_NOT_PREFIX_STABLE,
        R_GENERATION_PROMPT_MISMATCH,
        R_EMPTY_THINK_SUPERVISED,
        R_REPLY_MISSING_CONTENT,
        R_EOT_NOT_FOUND,
        R_NO_EOS,
        R_GENERATION_TAGS_UNUSABLE,
        R_TOKEN_STRADDLES_BOUNDARY,
        R_MASK_VERIFICATION_FAILED,
        R_RENDER_TIMEOUT,
        R_OUTPUT_TOO_LARGE,
        R_DUPLICATED_THINK,
        R_PREFILL_NEEDS_REASONING,
        R_SPECIAL_TOKEN_IN_CONTENT,
    }
)


def duplicated_think(text: str) -> str | None:
    """The think tag `text` holds more than once, or None."""
    return next((t for t in THINK_TAGS if text.count(t) > 1), None)


class MaskRefused(Exception):
    """A row that cannot be tokenized with a verifiably right mask; `code` is a reason code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def is_filter(self) -> bool:
        return self.code in FILTER_CODES


@dataclass(frozen=True)
class MaskPolicy:
    """How to mask: which strategy, which turns, end-of-turn, reasoning and length handling."""

    strategy: Literal["auto", "generation", "render_diff", "per_turn"] = "auto"
    include_eot: bool = True
    supervise_reasoning: bool = True
    turns: Literal["all", "last"] = "all"
    seq_length: int | None = None
    truncation: Literal["right", "drop"] = "right"
    min_supervised_tokens: int = 2
    # "quarantine": a conversation whose text holds a special token's string is refused
    # (R_SPECIAL_TOKEN_IN_CONTENT); "keep": it is tokenized as it is (the string becomes the token)
    special_tokens_in_content: Literal["quarantine", "keep"] = "quarantine"
    # a template that times out on more than this share of the conversations seen (and on 3 or
    # more) is broken as a whole: tokenizing stops instead of spending the limit on every row
    max_render_timeout_share: float = 0.05


class TemplateTimingOut(Exception):
    """The template ran over render_timeout_s on too many of the conversations seen."""

    def __init__(self, timeouts: int, seen: int, detail: str) -> None:
        super().__init__(f"the template ran over the render time limit on {timeouts} of the "
                         f"{seen} conversations seen ({detail})")
        self.timeouts, self.seen = timeouts, seen


@dataclass
class TokenizedRow:
    """One training row. `turn`: ordinal of the supervised assistant turn, -1 when the row
    supervises several turns (one row per conversation)."""

    input_ids: list[int]
    loss_mask: list[int]
    turn: int
    normalizations: list[str]
    strategy: str = ""
    text: str = ""  # the rendered row text (before an appended eos and truncation)
    char_spans: list[tuple[int, int]] = field(default_factory=list)  # reply spans in `text`
    expected: list[str] = field(default_factory=list)  # decoded text each span must give
    eos_appended: bool = False
    truncated: bool = False
    split_at: int | None = None  # per-turn rows: prompt and reply are encoded separately here
    cross_checked: bool = False  # also made without shortcuts, and equal (`cross_check`)
    prefill: str = ""  # the reasoning opener the prompt ends with; the reply continues after it
    # on a conversation's first row: the renders its rows took, and how (`render_path`:
    # "one_render", "generation_tags" or "render_every_turn": N+1 renders for N replies or more)
    renders: int = 0
    render_path: str = ""
