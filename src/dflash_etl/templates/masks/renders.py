"""Every render the masks make, in one place: cached per conversation, and the shortcuts
that save renders (each on only where the probe found it exact, `shortcuts.fast_paths_for`)."""

from __future__ import annotations

from typing import Any

from dflash_etl.templates.limits import RenderError, RenderLimitExceeded
from dflash_etl.templates.masks.policy import (
    R_GENERATION_TAGS_UNUSABLE,
    R_RENDER_ERROR,
    R_ROLE_ORDER,
    MaskRefused,
)
from dflash_etl.templates.masks.prepare import _Prepared
from dflash_etl.templates.probe_record import TemplateProbe
from dflash_etl.templates.render import guarded_call, render, render_generation_spans

# the shortcuts, by the names probe.fast_paths records them under
FAST_GENERATION = "generation_one_render"  # a tag template's mask from one render
FAST_TURN_END = "turn_end_from_next_prompt"  # render diff: N+1 renders for N replies
FAST_ONE_RENDER = "one_render"  # render diff: turns read off the full render's message marks
# how a conversation's rows were rendered (TokenizedRow.render_path, stats.json render_paths)
RENDER_PATH_ONE = "one_render"
RENDER_PATH_TAGS = "generation_tags"
RENDER_PATH_EVERY = "render_every_turn"


def _render_prefix(
    tokenizer: Any,
    prep: _Prepared,
    n: int,
    generation_prompt: bool,
    kwargs: dict[str, Any],
    template: str | None,
) -> str:
    """The first `n` messages rendered, once per conversation: the last turn's render-diff
    render is the full conversation's render, and each render is the stage's largest cost."""
    key = _render_key(n, generation_prompt, kwargs)
    if key not in prep.renders:
        prep.renders_made += 1
        prep.renders[key] = render(
            tokenizer, prep.messages[:n], chat_template=template, tools=prep.tools,
            add_generation_prompt=generation_prompt, kwargs=kwargs,
        )
    return prep.renders[key]


def _render_key(n: int, generation_prompt: bool, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return n, generation_prompt, tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


def _strings_in(value: Any) -> list[str]:
    """Every string inside a message (its content, reasoning, tool-call names and arguments)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _strings_in(v)]
    if isinstance(value, list):
        return [t for v in value for t in _strings_in(v)]
    return []


def _holds_marker(probe: TemplateProbe, message: dict[str, Any]) -> bool:
    """Whether the message's own text holds the template's end-of-turn marker: then the first
    marker after a reply's start need not be its end, and the shortcuts render instead."""
    eot = probe.eot_text.strip()
    return any(eot in text for text in _strings_in(message))


def _turn_end(text: str, start: int, probe: TemplateProbe) -> int | None:
    """Where the turn that starts at `start` ends in `text` (after its end-of-turn marker and the
    text the template puts after it), if its first marker is its end."""
    eot, post = probe.eot_text.strip(), probe.post_eot
    at = text.find(eot, start) if eot else -1
    if at < 0:
        return None
    end = at + len(eot)
    if post and not text.startswith(post, end):
        return None
    return end + len(post)


def _upto_from_next_prompt(
    probe: TemplateProbe,
    prep: _Prepared,
    i: int,
    next_at: int,
    prompt: str,
    kwargs: dict[str, Any],
) -> str | None:
    """render(history <= i), read off the next target turn's prompt render (made first, with the
    same kwargs): on a prefix-stable template it starts with this turn's prompt, then holds this
    reply up to its end-of-turn marker. None (render it) unless the probe found this shortcut
    exact on its sample, the template ends turns with its own marker and the message's own text
    holds no such marker (the first one after the prompt is then the turn's end)."""
    if not probe.fast_paths.get(FAST_TURN_END) or probe.eot_source != "template":
        return None
    following = prep.renders.get(_render_key(next_at, True, kwargs))
    eot = probe.eot_text.strip()
    if following is None or not eot or not following.startswith(prompt):
        return None
    if _holds_marker(probe, prep.messages[i]):
        return None
    end = _turn_end(following, len(prompt), probe)
    return following[:end] if end is not None else None


def _classify_render_error(
    tokenizer: Any, prep: _Prepared, kw: dict[str, Any], template: str | None, err: RenderError
) -> MaskRefused:
    """A render error is a role-order rejection if the bare role skeleton fails too."""
    skeleton = [
        {"role": m["role"], "content": f"skeleton text {k}"} for k, m in enumerate(prep.messages)
    ]
    try:
        render(tokenizer, skeleton, chat_template=template, kwargs=kw)
    except RenderLimitExceeded as exc2:
        return MaskRefused(exc2.code, str(exc2))
    except RenderError as exc2:
        return MaskRefused(R_ROLE_ORDER, str(exc2))
    return MaskRefused(R_RENDER_ERROR, str(err))


def _tagged_turns(
    tokenizer: Any,
    probe: TemplateProbe,
    prep: _Prepared,
    template: str | None,
    targets: list[int],
) -> tuple[str, list[tuple[int, str, str]]] | None:
    """One render whose {% generation %} blocks mark the replies, and per target message its
    (index, prompt, render up to the turn's end) read off it. None unless there is a block per
    assistant turn, each prompt ends with the generation prompt and each turn's first
    end-of-turn marker is its end."""
    made = render_generation_spans(tokenizer, prep.messages, chat_template=template,
                                   tools=prep.tools, kwargs=dict(probe.render_kwargs))
    if made is None:
        return None
    prep.renders_made += 1
    full, blocks = made
    if len(blocks) != len(prep.assistant_idx):
        return None
    block_of = dict(zip(prep.assistant_idx, blocks, strict=True))
    found = []
    for i in targets:
        start, _ = block_of[i]
        prompt = full[:start]
        end = _turn_end(full, start, probe)
        if end is None or not prompt.endswith(probe.generation_prompt):
            return None
        if _holds_marker(probe, prep.messages[i]):
            return None
        found.append((i, prompt, full[:end]))
    return full, found


def _hf_assistant_mask(
    tokenizer: Any, prep: _Prepared, kw: dict[str, Any], template: str | None
) -> tuple[list[int], list[int]]:
    """The conversation's ids and HF's {% generation %} assistant mask over them, made by
    transformers; a failure is a refusal."""
    prep.renders_made += 1
    try:
        out = guarded_call(
            prep.messages, prep.tools, tokenizer.apply_chat_template,
            prep.messages,
            tools=prep.tools,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kw,
        )
    except RenderLimitExceeded as exc:
        raise MaskRefused(exc.code, str(exc)) from exc
    except Exception as exc:
        raise MaskRefused(R_GENERATION_TAGS_UNUSABLE, f"HF assistant mask failed: {exc}") from exc
    return list(out["input_ids"]), list(out["assistant_masks"])
