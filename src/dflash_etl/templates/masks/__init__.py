"""Tokenize a canonical conversation with the target's chat template and build a verified loss mask.

A mask is either verifiably right or the row is refused with a reason code (DESIGN principle 2).
The supervised span of an assistant turn is what the model would generate after the prompt: the
text of `render(history<=k)` after `render(history<k, add_generation_prompt=True)`, cut at the
template's end-of-turn marker. Everything after that marker (a newline, an assistant header some
templates append) is prompt. Each row is re-checked by `verify_row` before it is returned.

Decisions (documented so reviewers can check them):
- BPE merges across the prompt/reply boundary: a per-turn row is encoded as
  encode(prompt) + encode(reply), exactly as at inference (the prompt is tokenized alone, the
  model generates the reply), so no token can straddle. In a one-row-per-conversation row a token
  is supervised iff its first character lies inside a reply span; a token straddling a span
  boundary sends the conversation to per-turn rows (or refuses it, `token_straddles_boundary`,
  when the policy forces one row).
- An empty think block (`<think>\n\n</think>\n\n`) is never supervised for a turn without
  reasoning: for such turns the thinking-off generation prompt is tried first (Qwen3.6:
  `enable_thinking=False`), which puts the empty block in the prompt; a variant whose reply would
  start by closing an empty think block is rejected.
- A generation prompt that pre-fills a *closed empty* think block the rendered turn lacks
  (QwQ / DeepSeek-R1 distills with thinking off) is prompt: the row is that prompt + the reply as
  rendered.
- A generation prompt that leaves a reasoning block *open* (`<think>
`: DeepSeek-R1 distills,
  QwQ and DeepCoder with thinking on) while the template strips reasoning from its turns: the row
  is that prompt, opener included, + what the model writes after it, the rest of the reasoning,
  `
</think>

` (the layout `inline_reasoning` gives), then the turn as rendered (content,
  end of turn); one row per turn, `TokenizedRow.prefill` names the opener and `verify_row` checks
  the prompt ends with it and the reply closes it once. A turn without reasoning there is refused
  (`prefill_needs_reasoning`); any other pre-fill mismatch is refused
  (`generation_prompt_mismatch`), never guessed.
- Without a template end-of-turn marker the eos token (tokenizer, else generation_config.json) is
  appended and supervised when `include_eot` (probe.json `eos_appended` says which and why); such
  rows are always one row per turn, so no eos is ever inserted into a history the target would
  not see.
- `turns="all"`: one row for the whole conversation when every turn's prompt+reply is a prefix of
  the full render (by default, else with the template's stable kwarg such as
  `preserve_thinking=True`); otherwise one row per assistant turn with its exact history.

Modules, in the order a conversation meets them: `conversations` (the entry), `prepare` (the
messages made template-ready), `plan` (which rows, by strategy), `per_turn`, `render_diff`,
`generation` and `prefill` (the strategies), `renders` (every render and HF mask call, and the
shortcuts that save renders), `rows`, `encoding` and `verify` (ids, mask, the re-check);
`policy` holds the types they share, `shortcuts` checks the shortcuts per template.
"""

from dflash_etl.templates.masks.conversations import tokenize_conversation, tokenize_conversations
from dflash_etl.templates.masks.policy import (
    FILTER_CODES,
    QUARANTINE_CODES,
    MaskPolicy,
    MaskRefused,
    TemplateTimingOut,
    TokenizedRow,
)
from dflash_etl.templates.masks.verify import verify_row

__all__ = [
    "FILTER_CODES",
    "QUARANTINE_CODES",
    "MaskPolicy",
    "MaskRefused",
    "TemplateTimingOut",
    "TokenizedRow",
    "tokenize_conversation",
    "tokenize_conversations",
    "verify_row",
]
