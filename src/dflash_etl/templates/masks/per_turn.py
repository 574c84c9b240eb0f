"""Per turn: each assistant turn rendered as the final one, its prompt (history + generation
prompt) and the reply the model generates after it, checked against the message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_etl.templates.limits import RenderError, RenderLimitExceeded
from dflash_etl.templates.masks.policy import (
    R_DUPLICATED_THINK,
    R_EMPTY_THINK_SUPERVISED,
    R_EOT_NOT_FOUND,
    R_GENERATION_PROMPT_MISMATCH,
    R_NO_EOS,
    R_REASONING_NOT_RENDERED,
    R_RENDER_ERROR,
    R_REPLY_MISSING_CONTENT,
    MaskRefused,
    duplicated_think,
)
from dflash_etl.templates.masks.prefill import (
    _open_reasoning_prefill,
    _reply_after_prefill,
    _thinking_on_drops_reasoning,
)
from dflash_etl.templates.masks.prepare import _Masking, _Prepared
from dflash_etl.templates.masks.renders import _render_prefix, _upto_from_next_prompt
from dflash_etl.templates.probe_record import TemplateProbe
from dflash_etl.templates.render import (
    EMPTY_REASONING_AT_END_RE,
    LEADING_EMPTY_THINK_RE,
    TRAILING_MARKER_RE,
    common_prefix_len,
)


@dataclass
class _Turn:
    """One assistant turn rendered as the final turn: prompt + the reply the model generates."""

    ordinal: int
    index: int
    prompt: str
    reply: str
    append_eos: bool
    kwargs: dict[str, Any]
    notes: list[str]
    prefill: str = ""  # the pre-filled reasoning opener the prompt ends with, when supervised after


def _variants(probe: TemplateProbe, has_reasoning: bool) -> list[dict[str, Any]]:
    """Thinking-mode kwargs to try for one turn, most faithful first."""
    if has_reasoning:
        return [{}] + [{k: True} for k in probe.thinking_kwargs]
    return [{k: False} for k in probe.thinking_kwargs] + [{}]


def _turn_variants(probe: TemplateProbe, prep: _Prepared, i: int) -> list[dict[str, Any]]:
    """`_variants`, thinking-on first for a turn whose reasoning the template never renders: a
    generation prompt that opens a reasoning block lets the row supervise it after that opener."""
    if prep.raw_reasoning.get(i) and not prep.reasoning_passed.get(i, False):
        on = [{k: True} for k in probe.thinking_kwargs]
        return on + [v for v in _variants(probe, False) if v not in on]
    return _variants(probe, prep.reasoning_passed.get(i, False))


@dataclass
class _TurnAttempt:
    """One assistant turn's mask attempt: message i (the conversation's `ordinal`-th assistant
    turn) tried under its variants in order (`variants`) until one gives a reply that checks
    out; `failures` keeps why each one before it did not, the refusal when none does."""

    masking: _Masking
    i: int
    ordinal: int
    failures: list[tuple[str, str]] = field(default_factory=list)

    def variants(self) -> list[dict[str, Any]]:
        return _turn_variants(self.masking.probe, self.masking.prep, self.i)

    def kwargs(self, base: dict[str, Any], variant: dict[str, Any]) -> dict[str, Any]:
        """A variant's render kwargs: the probe's, then `base`, then the variant's own."""
        return {**self.masking.probe.render_kwargs, **base, **variant}

    def render(self, base: dict[str, Any], next_prompt_at: int | None = None) -> _Turn:
        """Prompt (history<i + generation prompt) and the reply of message i rendered as final turn.

        With `next_prompt_at` (the next target turn's index, whose prompt was rendered first, on a
        template prefix-stable under these kwargs) the history up to this turn is read off that
        prompt instead of rendered: N+1 renders for N replies, not 2N."""
        tokenizer, template = self.masking.tokenizer, self.masking.template
        probe, prep, i = self.masking.probe, self.masking.prep, self.i
        for variant in self.variants():
            kw = self.kwargs(base, variant)
            try:
                prompt = _render_prefix(tokenizer, prep, i, True, kw, template)
                upto = (_upto_from_next_prompt(probe, prep, i, next_prompt_at, prompt, kw)
                        if next_prompt_at is not None else None)
                if upto is None:
                    upto = _render_prefix(tokenizer, prep, i + 1, False, kw, template)
            except RenderLimitExceeded:
                raise  # the conversation's verdict: another variant would spend the limit again
            except RenderError as exc:
                self.failures.append((R_RENDER_ERROR, f"{variant or 'default'}: {exc}"))
                continue
            turn = self.turn(prompt, upto, variant)
            if turn is not None:
                return turn
        raise self.refusal()

    def refusal(self) -> MaskRefused:
        """The turn refused: why its first try failed, and every try's reason when there were
        several."""
        failures = self.failures
        code, message = failures[0] if failures else (R_RENDER_ERROR, "no variant rendered")
        detail = "; ".join(f"[{c}] {m}" for c, m in failures)
        return MaskRefused(
            code,
            f"assistant turn {self.ordinal}: {message}"
            + (f" (all tries: {detail})" if len(failures) > 1 else ""),
        )

    def turn(self, prompt: str, upto: str, variant: dict[str, Any]) -> _Turn | None:
        """The turn made of `prompt` and the reply read off `upto` (the turn's render up to its
        end) under `variant`, or None after recording why the reply does not check out."""
        ok = self._check(prompt, upto, variant)
        if ok is None:
            return None
        reply, append_eos, notes, prefill = ok
        if variant:
            notes.append(
                "generation_prompt_kwargs:" + ",".join(f"{k}={v}" for k, v in variant.items())
            )
        return _Turn(self.ordinal, self.i, prompt, reply, append_eos, variant, notes, prefill)

    def _check(
        self, prompt: str, upto: str, variant: dict[str, Any]
    ) -> tuple[str, bool, list[str], str] | None:
        """(reply, append_eos, notes, prefill) for one variant, or None after recording why it
        failed. `prefill` is the reasoning opener the prompt ends with when the reply is
        supervised after it."""
        tag = str(variant or "default")
        if _thinking_on_drops_reasoning(self.masking.prep, self.i, prompt, variant):
            return None  # a try made only for an opener that is not there: not the turn's verdict
        notes: list[str] = []
        found = self._reply_body(prompt, upto, tag, notes)
        if found is None or self._bad_think_markup(prompt, found[0], tag):
            return None
        body, prefill = found
        cut = self._cut_end_of_turn(body, tag, notes)
        if cut is None:
            return None
        content_part, reply, append_eos = cut
        if self._lacks_content(content_part, reply, tag):
            return None
        return reply, append_eos, notes, prefill

    def _reply_body(
        self, prompt: str, upto: str, tag: str, notes: list[str]
    ) -> tuple[str, str] | None:
        """(what the model generates after `prompt`: the turn's render up to its end, the
        pre-filled opener it continues or ""), or None after recording why the prompt and turn
        disagree."""
        probe, prep, i, failures = self.masking.probe, self.masking.prep, self.i, self.failures
        h = common_prefix_len(prompt, upto)
        if h == len(prompt):  # the prompt is a prefix of the history-with-this-turn render
            return upto[h:], ""
        m = EMPTY_REASONING_AT_END_RE.search(prompt)
        reasoning = _reasoning_text(prep, i)
        at = upto.rfind(reasoning[:40]) if reasoning else -1
        gp = probe.generation_prompt
        if m and m.start() <= h and not prep.reasoning_passed.get(i):
            notes.append("generation_prompt_empty_think_is_prompt")
            return _after_empty_think(prompt, upto, m.start()), ""
        if (
            len(gp.strip()) >= 3
            and prompt.endswith(gp)
            and 0 <= (hs := upto.find(gp, max(0, h - len(gp)))) <= h
        ):
            # the template renders text after the last message (Command-R tool use: a trailing
            # instruction) and then the generation prompt; the turn starts with that header
            notes.append("generation_prompt_after_trailing_text")
            return upto[hs + len(gp) :], ""
        if reasoning and 0 <= at <= h:
            # the generation prompt pre-fills the start of the reasoning (Apriel: "Here are my
            # reasoning steps:"); the model continues with the reasoning as the template renders it
            notes.append("generation_prompt_prefill_is_prompt")
            return upto[at:], ""
        if (opened := _open_reasoning_prefill(prompt, upto)) is not None:
            after = _reply_after_prefill(prep, i, prompt, upto, opened, tag, failures)
            if after is not None:
                notes.append(f"reasoning_supervised_after_prefill:{after[1]!r}")
            return after
        failures.append((
            R_GENERATION_PROMPT_MISMATCH,
            f"{tag}: generation prompt ends {prompt[h:][-60:]!r} but the turn renders as "
            f"{upto[h:][:60]!r}",
        ))
        return None

    def _bad_think_markup(self, prompt: str, body: str, tag: str) -> bool:
        """The turn would train a think tag twice, or an empty think block the model did not
        generate (recorded in `failures`)."""
        prep, i, failures = self.masking.prep, self.i, self.failures
        eot = self.masking.probe.eot_text.strip()
        head = prompt[prompt.rfind(eot) + len(eot):] if eot and eot in prompt else ""
        if tag_twice := duplicated_think(head + body):
            failures.append((R_DUPLICATED_THINK, f"{tag}: the turn holds {tag_twice!r} twice: "
                             f"{(head + body)[:80]!r}"))
            return True
        if not prep.reasoning_passed.get(i) and LEADING_EMPTY_THINK_RE.match(body):
            failures.append(
                (
                    R_EMPTY_THINK_SUPERVISED,
                    f"{tag}: reply would start with an empty think block the model did not "
                    "generate",
                )
            )
            return True
        return False

    def _cut_end_of_turn(
        self, body: str, tag: str, notes: list[str]
    ) -> tuple[str, str, bool] | None:
        """(the turn's text before its end-of-turn marker, the reply the policy supervises,
        whether an eos is appended to it): the body without what the template puts after the
        marker. None after recording why the turn's end is not found."""
        probe, policy, failures = self.masking.probe, self.masking.policy, self.failures
        post = probe.post_eot
        if post:
            if not body.endswith(post):
                failures.append((R_EOT_NOT_FOUND, f"{tag}: turn does not end with {post!r}"))
                return None
            body = body[: -len(post)]
        if probe.eot_source == "template":
            m2 = TRAILING_MARKER_RE.search(body)
            eot = probe.eot_text.strip()
            if eot and body.endswith(eot):
                cut = len(body) - len(eot)
            elif m2:  # another marker ends this turn (gpt-oss: <|call|> after a tool call)
                cut = m2.start()
            else:
                failures.append(
                    (R_EOT_NOT_FOUND, f"{tag}: no end-of-turn marker at {body[-40:]!r}"))
                return None
            return body[:cut], body if policy.include_eot else body[:cut], False
        if not policy.include_eot:
            return body, body, False
        if probe.eos_fallback_id is None:
            failures.append((R_NO_EOS, "no end-of-turn marker and no eos token to supervise"))
            return None
        notes.append(f"eot_appended:{probe.eos_fallback_token}({probe.eot_source})")
        return body, body, True

    def _lacks_content(self, content_part: str, reply: str, tag: str) -> bool:
        """The rendered turn lacks a text of message i (its content, reasoning, tool calls) or
        the reply is empty (recorded in `failures`)."""
        prep, i, failures = self.masking.prep, self.i, self.failures
        missing = [p for p in prep.pieces.get(i, []) if p not in content_part]
        if missing:
            code = R_REPLY_MISSING_CONTENT
            if prep.reasoning_passed.get(i) and missing[0] in _reasoning_of(prep, i):
                code = R_REASONING_NOT_RENDERED
            failures.append((code, f"{tag}: rendered reply lacks {missing[0][:60]!r}"))
            return True
        if not reply:
            failures.append((R_REPLY_MISSING_CONTENT, f"{tag}: empty reply"))
            return True
        return False


def _after_empty_think(prompt: str, upto: str, start: int) -> str:
    """Thinking off: the closed empty block the generation prompt ends with (at `start`) is
    prompt; a (partial) empty block the turn renders in its place is that same block
    (DeepSeek-V3.2 renders "</think>" where the prompt has "<think></think>")."""
    body = upto[start:]
    lead = LEADING_EMPTY_THINK_RE.match(body)
    if lead:
        body = body[lead.end() :]
        if prompt[-1:].isspace():
            body = body.lstrip()
    return body


def _reasoning_text(prep: _Prepared, i: int) -> str:
    """The reasoning passed to the template for message i ("" if none)."""
    if not prep.reasoning_passed.get(i):
        return ""
    pieces = prep.pieces.get(i, [])
    m = prep.messages[i]
    for key in ("reasoning_content", "reasoning", "thinking"):
        if isinstance(m.get(key), str) and m[key]:
            return m[key].strip()
    return next((p for p in pieces if p and p in str(m.get("content"))), "")


def _reasoning_of(prep: _Prepared, i: int) -> str:
    m = prep.messages[i]
    return " ".join(
        str(v)
        for k, v in m.items()
        if k in ("reasoning_content", "reasoning", "thinking", "content") and v
    )


def _spans_in(full: str, turns: list[_Turn]) -> list[tuple[int, int]] | str:
    """Each turn's reply span in `full`, or why the turns do not sit in it as rendered alone."""
    spans: list[tuple[int, int]] = []
    for t in turns:
        if not full.startswith(t.prompt):
            return f"generation prompt before turn {t.ordinal} is not a prefix of the full render"
        s = len(t.prompt)
        if not full.startswith(t.reply, s):
            return f"reply of turn {t.ordinal} is rendered differently inside the conversation"
        spans.append((s, s + len(t.reply)))
    return spans
