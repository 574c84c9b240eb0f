"""Probe a chat template by rendering valid sentinel conversations, and choose a mask strategy.

Libraries often probe a template with an assistant-only conversation, which strict templates
(Qwen3.6: "No user query found in messages.") reject, killing the run. Here every probe renders a
*valid* conversation first, catches every exception, and records what the template does, so the
tokenize stage can explain each choice (and each refusal) instead of guessing.

This module runs the probes (probes.py, one question each) with what they need from the
tokenizer and the model's files, and turns what they found into the record and its strategy.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash_etl.templates.limits import render_clock
from dflash_etl.templates.masks.shortcuts import fast_paths_for
from dflash_etl.templates.probe_record import (
    STRATEGY_GENERATION,
    STRATEGY_PER_TURN,
    STRATEGY_RENDER_DIFF,
    TemplateProbe,
)
from dflash_etl.templates.probes import (
    _A1,
    _U1,
    TemplateUnusable,
    _GenerationTags,
    _msg,
    _open_reasoning_prefill,
    _PrefixStability,
    _probe_bos,
    _probe_end_of_turn,
    _probe_generation_prompt,
    _probe_generation_tags,
    _probe_prefix_stability,
    _probe_reasoning,
    _probe_role_orders,
    _probe_system,
    _probe_tools,
    _Reasoning,
    _Render,
)
from dflash_etl.templates.render import EMPTY_THINK_RE, try_render


def _load_generation_config(tokenizer: Any, model_dir: str | Path | None) -> dict[str, Any]:
    base = model_dir or getattr(tokenizer, "name_or_path", None)
    if not base:
        return {}
    path = Path(base) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if isinstance(value, int) else None


def _supply_special_tokens(
    tokenizer: Any, source: str, gen_cfg: dict[str, Any], render_kwargs: dict[str, Any]
) -> list[str]:
    """Pass bos/eos the template reads when the tokenizer lacks them, from generation_config."""
    notes: list[str] = []
    for name in ("bos_token", "eos_token"):
        if name in render_kwargs or name not in source:
            continue
        if getattr(tokenizer, name, None):
            continue
        tok_id = _first_id(gen_cfg.get(f"{name}_id"))
        if tok_id is not None:
            tok = tokenizer.convert_ids_to_tokens(tok_id)
            if isinstance(tok, str):
                render_kwargs[name] = tok
                notes.append(f"{name}={tok!r} from generation_config.json {name}_id={tok_id}")
                continue
        notes.append(f"{name} is read by the template but the tokenizer has none; left undefined")
    return notes


def _eos_fallback(tokenizer: Any, gen_cfg: dict[str, Any]) -> tuple[str | None, int | None, str]:
    """The token a model emits to stop when the template renders no end-of-turn marker."""
    if getattr(tokenizer, "eos_token", None):
        return tokenizer.eos_token, tokenizer.eos_token_id, "tokenizer_eos"
    tok_id = _first_id(gen_cfg.get("eos_token_id"))
    if tok_id is not None:
        return tokenizer.convert_ids_to_tokens(tok_id), tok_id, "generation_config_eos"
    return None, None, "none"


def probe_template(
    tokenizer: Any,
    chat_template: str | None = None,
    *,
    render_kwargs: dict[str, Any] | None = None,
    model_dir: str | Path | None = None,
) -> TemplateProbe:
    """Render valid sentinel conversations through the template and record its behaviour.

    Raises TemplateUnusable when not even `[system?, user, assistant]` renders, and
    RenderLimitExceeded when a probe render runs over the render limits (`render_limits`).
    """
    source = _template_text(tokenizer, chat_template)
    gen_cfg = _load_generation_config(tokenizer, model_dir)
    kwargs: dict[str, Any] = dict(render_kwargs or {})
    supplied = _supply_special_tokens(tokenizer, source, gen_cfg, kwargs)
    notes: list[str] = _clock_notes(source)
    tools_required = _needs_tools_list(tokenizer, source, kwargs, notes)
    r = _renderer(tokenizer, source, kwargs, tools_required)
    roles = _probe_role_orders(r)
    ua = roles.renders["user,assistant"]
    system_mode = _probe_system(r, roles, notes)
    base_u, _ = r([_msg("user", _U1)])
    tail = ua[ua.rfind(_A1) + len(_A1) :]
    eos_tok, eos_id, eos_src = _eos_fallback(tokenizer, gen_cfg)
    eot = _probe_end_of_turn(tail, roles.renders, eos_tok, eos_src, notes)
    gen = _probe_generation_prompt(ua, roles.renders, base_u, tail, eot.post_eot, eot.eot_source)
    reasoning = _probe_reasoning(r, source, ua, base_u)
    prefix = _probe_prefix_stability(r, source, reasoning, system_mode)
    tools = _probe_tools(r)
    tags = _probe_generation_tags(tokenizer, source, kwargs)
    bos = _probe_bos(tokenizer, source, kwargs, ua, notes)
    strategy, reason = _choose_strategy(tags, prefix, gen.generation_prefill, eot.eot_source)
    opener, opener_kwargs = _open_reasoning_prefill(r, base_u, ua, reasoning.thinking_kwargs)
    reason += _prefill_reasoning_reason(opener, opener_kwargs, reasoning)
    probe = TemplateProbe(
        template_sha256=hashlib.sha256(source.encode("utf-8")).hexdigest(),
        template_source="argument" if chat_template is not None else "tokenizer",
        render_kwargs=kwargs, supplied=supplied, tools_required=tools_required,
        accepted_role_orders=roles.accepted, rejected_role_orders=roles.rejected,
        system_mode=system_mode, **eot._asdict(), **gen._asdict(), **reasoning._asdict(),
        **prefix._asdict(), **tools._asdict(), **tags._asdict(), **bos._asdict(),
        eos_fallback_token=eos_tok, eos_fallback_id=eos_id, strategy=strategy, reason=reason,
        notes=notes, prefill_reasoning=opener, prefill_reasoning_kwargs=opener_kwargs,
        eos_appended=None if eot.eot_source == "template" else _eos_appended(
            eos_tok, eos_id, eos_src, tail),
    )
    probe.fast_paths = fast_paths_for(tokenizer, probe, chat_template)
    return probe


def _clock_notes(source: str) -> list[str]:
    """A template that prints the current time (strftime_now), and the time its renders read."""
    if "strftime_now" not in source:
        return []
    clock = render_clock()
    return ["the template prints the current time (strftime_now): every render reads "
            + ("this process's start time, so each run gives other rows" if clock == "now"
               else f"the fixed time {clock}, so reruns give the same rows")
            + " ([tokenize] template_clock)"]




def default_template(tokenizer: Any) -> str | None:
    """A tokenizer's chat template (its default one where it names several)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default") or next(iter(source.values()), None)
    return source if isinstance(source, str) and source else None


def _template_text(tokenizer: Any, chat_template: str | None) -> str:
    """The template to probe: the one given, else the tokenizer's (its default when named)."""
    source = chat_template if chat_template is not None else default_template(tokenizer)
    if not source or not isinstance(source, str):
        raise TemplateUnusable("no chat template: the tokenizer has none and none was given")
    return source


def _needs_tools_list(
    tokenizer: Any, source: str, kwargs: dict[str, Any], notes: list[str]
) -> bool:
    """Some templates render only when given a tools list, even an empty one."""
    conv = [_msg("user", _U1), _msg("assistant", _A1)]
    plain, plain_err = try_render(tokenizer, conv, chat_template=source, kwargs=kwargs)
    if plain is not None:
        return False
    with_empty, _ = try_render(tokenizer, conv, chat_template=source, tools=[], kwargs=kwargs)
    if with_empty is None:
        return False
    notes.append(
        f"renders only with a tools list ({plain_err}); an empty list is passed "
        "for conversations without tools"
    )
    return True


def _renderer(
    tokenizer: Any, source: str, kwargs: dict[str, Any], tools_required: bool
) -> _Render:
    """The render every probe makes: this template, these kwargs, and the empty tools list a
    template that needs one gets when a probe passes no tools."""

    def r(msgs: list[dict[str, Any]], gen: bool = False, tools: Any = None, **extra: Any):
        return try_render(
            tokenizer,
            msgs,
            chat_template=source,
            tools=tools if tools is not None or not tools_required else [],
            add_generation_prompt=gen,
            kwargs={**kwargs, **extra},
        )

    return r


def _prefill_reasoning_reason(
    opener: str | None, kwargs: dict[str, Any] | None, reasoning: _Reasoning
) -> str:
    """What the strategy's reason adds when the generation prompt leaves a reasoning opener
    that decides how reasoning turns are masked ("" when there is none, or when it is merely a
    thinking switch whose prompt the template's own reasoning render continues)."""
    if opener is None or (reasoning.reasoning_placement != "never" and kwargs):
        return ""
    thinking_kwargs = reasoning.thinking_kwargs
    when = f" with {kwargs}" if kwargs else ""
    without = (
        "takes the generation prompt with " + ", ".join(f"{k}=False" for k in thinking_kwargs)
        if thinking_kwargs
        else "is refused (prefill_needs_reasoning)"
    )
    return (
        f"; the generation prompt{when} opens {opener!r}, which rendered turns lack: a turn with "
        "reasoning is a row of the prompt with that opener, then the supervised rest of the "
        f"reasoning, the closing tag, the content and the end of turn; a turn without reasoning "
        f"{without}"
    )


def _eos_appended(
    token: str | None, token_id: int | None, source: str, tail: str
) -> dict[str, Any]:
    """What probe.json says about the eos appended to replies when the template has no
    end-of-turn marker (a reviewer would otherwise read it as a token after the turn)."""
    where = {
        "tokenizer_eos": "the tokenizer's eos_token",
        "generation_config_eos": "generation_config.json's eos_token_id",
        "none": "no eos token: the tokenizer and generation_config.json have none",
    }[source]
    if token is None:
        why = (f"the template renders no end-of-turn marker after the assistant content (it "
               f"renders {tail!r}) and there is {where}; with include_eot every turn is refused "
               "(no_eos_token)")
    else:
        why = (f"the template renders no end-of-turn marker after the assistant content (it "
               f"renders {tail!r}), so the model stops by emitting {where}: it is appended to "
               "each reply and supervised (include_eot), one row per turn so that no eos enters "
               "a history the target would not see")
    return {"token": token, "id": token_id, "source": source, "why": why}


def _choose_strategy(
    tags: _GenerationTags, prefix: _PrefixStability, prefill: str, eot_source: str
) -> tuple[str, str]:
    """Pick the default strategy and say why, in words a reviewer can check."""
    has_tags, mask_usable = tags
    prefix_stable, stable_kwargs, prefix_detail = prefix
    eot = (
        "the template ends assistant turns with its own marker"
        if eot_source == "template"
        else f"the template has no end-of-turn marker, so the {eot_source} token is appended"
    )
    pre = (
        f"; its generation prompt pre-fills {prefill!r}, which rendered turns lack, "
        "so each row is prompt-with-generation-prompt + the reply"
        if prefill
        else ""
    )
    if has_tags and mask_usable:
        return STRATEGY_GENERATION, (
            "{% generation %} tags give a usable assistant mask (cross-checked by render diff); "
            + eot
        )
    tag_note = "{% generation %} tags present but the HF mask is unusable; " if has_tags else ""
    if prefix_stable and not prefill and eot_source == "template":
        return STRATEGY_RENDER_DIFF, (
            tag_note + "prefix-stable: each assistant span is the render diff between the "
            "generation prompt and the turn, one row per conversation; " + eot
        )
    if stable_kwargs and not prefill and eot_source == "template":
        return STRATEGY_RENDER_DIFF, (
            tag_note + f"not prefix-stable by default ({prefix_detail}) but stable with "
            f"{stable_kwargs}; one row per conversation rendered that way; " + eot
        )
    why = prefix_detail if not prefix_stable else "prefix-stable"
    return STRATEGY_PER_TURN, (
        tag_note + f"one row per assistant turn with its exact history ({why}){pre}; " + eot
    )


__all__ = [
    "EMPTY_THINK_RE",
    "STRATEGY_GENERATION",
    "STRATEGY_PER_TURN",
    "STRATEGY_RENDER_DIFF",
    "TemplateProbe",
    "TemplateUnusable",
    "probe_template",
]
