"""The entry: conversations to verified rows, or the reason each is refused."""

from __future__ import annotations

import zlib
from typing import Any

from dflash_etl.templates.limits import RenderError, RenderLimitExceeded, conversation_budget
from dflash_etl.templates.masks.encoding import (
    _encode_many,
    _Encoded,
    cut_chars,
    cut_pieces,
    encode_cut,
)
from dflash_etl.templates.masks.plan import _build_planned, _plan, _Planned
from dflash_etl.templates.masks.policy import (
    LIMIT_CODES,
    R_MASK_VERIFICATION_FAILED,
    R_RENDER_ERROR,
    R_RENDER_TIMEOUT,
    R_SPECIAL_TOKEN_IN_CONTENT,
    MaskPolicy,
    MaskRefused,
    TemplateTimingOut,
    TokenizedRow,
)
from dflash_etl.templates.masks.prepare import _prepare, _Prepared
from dflash_etl.templates.masks.renders import _classify_render_error, _render_prefix
from dflash_etl.templates.masks.rows import _RowPlan
from dflash_etl.templates.probe_record import TemplateProbe


def tokenize_conversation(
    conv: dict[str, Any],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy | None = None,
    *,
    chat_template: str | None = None,
) -> list[TokenizedRow]:
    """Rows with verified loss masks for one canonical conversation, or MaskRefused.

    `chat_template` must be the template the probe was made with when it was not the tokenizer's.
    """
    (result,) = tokenize_conversations([conv], tokenizer, probe, policy,
                                       chat_template=chat_template)
    if isinstance(result, MaskRefused):
        raise result
    return result


def tokenize_conversations(
    convs: list[dict[str, Any]],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy | None = None,
    *,
    chat_template: str | None = None,
    fast: bool = True,
    cross_check: float = 0.0,
) -> list[list[TokenizedRow] | MaskRefused]:
    """`tokenize_conversation` for many conversations: for each, its rows or why it is refused.

    Every conversation is rendered and planned first, then all row texts are encoded in one pass,
    then masked and verified. The same rows as one at a time; the encoding pass is ~a third
    cheaper when it is not interleaved with rendering (a large tokenizer's tables stay in cache).
    """
    policy = policy or MaskPolicy()
    planned: list[_Planned | MaskRefused] = []
    specials = special_strings(tokenizer) if policy.special_tokens_in_content == "quarantine" \
        else ()
    timeouts = 0
    for seen, conv in enumerate(convs, 1):
        prep = None
        with conversation_budget():
            try:
                refuse_special_token_text(conv, specials)
                prep = _prepare(conv, probe, policy)
                planned.append(_plan(prep, tokenizer, probe, policy, chat_template, fast))
            except (MaskRefused, RenderError) as exc:
                planned.append(_refusal(exc, prep, tokenizer, probe, chat_template))
        last = planned[-1]
        if isinstance(last, MaskRefused) and last.code == R_RENDER_TIMEOUT:
            timeouts += 1
            if timeouts >= 3 and timeouts > policy.max_render_timeout_share * seen:
                raise TemplateTimingOut(timeouts, seen, last.message)
    chars = cut_chars(policy.seq_length)

    def encoded_pieces(plan: _RowPlan) -> tuple[str, ...]:
        """What is encoded of a row: its cut where it is longer (encode_cut checks the cut)."""
        return cut_pieces(plan.pieces(), chars) if 0 < chars < len(plan.text) else plan.pieces()

    encodings = iter(_encode_many(tokenizer, [
        piece for item in planned if isinstance(item, _Planned)
        for plan in item.rows for piece in encoded_pieces(plan)]))
    results: list[list[TokenizedRow] | MaskRefused] = []
    for item in planned:
        if isinstance(item, MaskRefused):
            results.append(item)
            continue
        encoded = []
        for plan in item.rows:
            texts = encoded_pieces(plan)
            found = [next(encodings) for _ in texts]
            encoded.append(encode_cut(tokenizer, plan.pieces(), policy.seq_length, found)
                           if policy.seq_length and 0 < chars < len(plan.text)
                           else _Encoded.join(texts, found))
        try:
            rows = _build_planned(item, tokenizer, probe, policy, encoded)
        except (MaskRefused, RenderError) as exc:
            results.append(_refusal(exc, item.prep, tokenizer, probe, chat_template))
            continue
        if rows:  # what rendering it took, on its first row (counted after any fallback)
            rows[0].renders, rows[0].render_path = item.prep.renders_made, item.prep.render_path
        results.append(rows)
    if fast and cross_check > 0 and probe.fast_paths:
        for k, conv in enumerate(convs):
            if zlib.crc32(str(conv.get("id")).encode()) < cross_check * 2**32:
                results[k] = _cross_checked(results[k], conv, tokenizer, probe, policy,
                                            chat_template)
    return results


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (`<|im_start|>`, `<|endoftext|>`...): the strings
    an encode turns into those tokens wherever they stand. Longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
    found.update(t for t in getattr(tokenizer, "all_special_tokens", ()) if t)
    return tuple(sorted(found, key=lambda t: (-len(t), t)))


def refuse_special_token_text(conv: dict[str, Any], specials: tuple[str, ...]) -> None:
    """MaskRefused when any text of the conversation (a message's content, reasoning, tool
    calls, the tools) holds a special token's string: the template's markup alone may make
    special tokens, or a reply could supervise a fake turn through them."""
    if not specials or not _any_special(conv, specials):
        return
    for where, text in _texts(conv):
        for token in specials:
            if token in text:
                raise MaskRefused(R_SPECIAL_TOKEN_IN_CONTENT, (
                    f"{where} holds the special token {token!r} as text: encoded it would be the "
                    "real token (a fake turn in the context, or supervised in a reply); clean "
                    "the source, or set [tokenize] special_tokens_in_content = \"keep\" to "
                    "tokenize it as it is"))


def _any_special(conv: dict[str, Any], specials: tuple[str, ...]) -> bool:
    """Whether any text holds a special token's string: one search of all the texts joined,
    the common case (none) without naming where each text is."""
    if any("\0" in token for token in specials):
        return True
    texts: list[str] = []
    stack: list[Any] = [*(conv.get("messages") or []), conv.get("tools") or []]
    while stack:
        value = stack.pop()
        if type(value) is dict:  # a message: mostly strings and None, read without the stack
            for item in value.values():
                if type(item) is str:
                    texts.append(item)
                elif item is not None:
                    stack.append(item)
        elif isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    joined = "\0".join(texts)  # no special token holds NUL, so none matches across two texts
    return any(token in joined for token in specials)


def _texts(conv: dict[str, Any]) -> Any:
    """(where, text) for every string in the conversation's messages and tools."""
    def walk(value: Any, where: str) -> Any:
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{where}.{key}")
        elif isinstance(value, list | tuple):
            for k, item in enumerate(value):
                yield from walk(item, f"{where}[{k}]")

    for k, message in enumerate(conv.get("messages") or []):
        yield from walk(message, f"message {k} ({(message or {}).get('role', '?')})")
    yield from walk(conv.get("tools") or [], "tools")


def _cross_checked(
    result: list[TokenizedRow] | MaskRefused,
    conv: dict[str, Any],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    template: str | None,
) -> list[TokenizedRow] | MaskRefused:
    """The conversation tokenized again without shortcuts (every turn rendered, HF's tag mask
    compared): rows that differ are quarantined, since one of the two is wrong."""
    (slow,) = tokenize_conversations([conv], tokenizer, probe, policy, chat_template=template,
                                     fast=False)
    if _outcome(slow) != _outcome(result):
        return MaskRefused(R_MASK_VERIFICATION_FAILED, (
            f"cross-check: the shortcut gives {_describe(result)} but rendering every turn "
            f"gives {_describe(slow)}; set [tokenize] strategy = \"render_diff\" for this "
            "template and report it"))
    for row in () if isinstance(result, MaskRefused) else result:
        row.cross_checked = True
    if not isinstance(result, MaskRefused) and result and not isinstance(slow, MaskRefused):
        result[0].renders += slow[0].renders  # the cross-check's renders are this row's cost
    return result


def _describe(result: list[TokenizedRow] | MaskRefused) -> str:
    if isinstance(result, MaskRefused):
        return f"a refusal ({result.code})"
    return f"{len(result)} row(s) of {[len(r.input_ids) for r in result]} tokens, " \
        f"{[sum(r.loss_mask) for r in result]} supervised"


def _outcome(result: list[TokenizedRow] | MaskRefused) -> Any:
    if isinstance(result, MaskRefused):
        return result.code
    return [(r.input_ids, r.loss_mask, r.turn, r.normalizations, r.strategy) for r in result]


def _refusal(
    exc: MaskRefused | RenderError,
    prep: _Prepared | None,
    tokenizer: Any,
    probe: TemplateProbe,
    template: str | None,
) -> MaskRefused:
    """The refusal to report. A template that rejects the conversation as such (its role order,
    with its own error text) is the reason, whatever step failed first: the full default render
    is the test, made only for refused conversations."""
    if isinstance(exc, RenderLimitExceeded):  # rendering it again would spend the limit again
        return MaskRefused(exc.code, str(exc))
    if isinstance(exc, MaskRefused) and (exc.is_filter or prep is None or exc.code in LIMIT_CODES):
        return exc
    assert prep is not None
    kw = dict(probe.render_kwargs)
    try:
        _render_prefix(tokenizer, prep, len(prep.messages), False, kw, template)
    except RenderLimitExceeded as err:
        return MaskRefused(err.code, str(err))
    except RenderError as err:
        return _classify_render_error(tokenizer, prep, kw, template, err)
    if isinstance(exc, RenderError):
        return MaskRefused(R_RENDER_ERROR, str(exc))
    return exc
