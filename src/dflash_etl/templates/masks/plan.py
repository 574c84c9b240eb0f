"""Which rows a conversation becomes: the policy's strategy, tried in order, with per-turn rows
to fall back on."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_etl.templates.limits import RenderError
from dflash_etl.templates.masks.encoding import _Encoded
from dflash_etl.templates.masks.generation import _generation_row
from dflash_etl.templates.masks.one_render import _turns_from_one_render
from dflash_etl.templates.masks.per_turn import _Turn, _TurnAttempt
from dflash_etl.templates.masks.policy import (
    FILTER_CODES,
    LIMIT_CODES,
    R_GENERATION_PROMPT_MISMATCH,
    R_GENERATION_TAGS_UNUSABLE,
    R_NOT_PREFIX_STABLE,
    MaskPolicy,
    MaskRefused,
    TokenizedRow,
)
from dflash_etl.templates.masks.prepare import _Masking, _Prepared
from dflash_etl.templates.masks.render_diff import _single_row
from dflash_etl.templates.masks.renders import (
    FAST_GENERATION,
    FAST_ONE_RENDER,
    RENDER_PATH_EVERY,
    RENDER_PATH_TAGS,
)
from dflash_etl.templates.masks.rows import _build_row, _RowPlan
from dflash_etl.templates.probe_record import (
    STRATEGY_GENERATION,
    STRATEGY_PER_TURN,
    STRATEGY_RENDER_DIFF,
    TemplateProbe,
)


@dataclass
class _Planned:
    """A conversation's first-choice rows, and the per-turn rows to fall back on (made only when
    needed: they may need renders of their own) if a single row fails to tokenize exactly."""

    prep: _Prepared
    rows: list[_RowPlan]
    fallback: Callable[[str], list[_RowPlan]] | None = None


def _build_planned(
    item: _Planned,
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    encoded: list[_Encoded],
) -> list[TokenizedRow]:
    try:
        return [_build_row(tokenizer, plan, probe, policy, enc)
                for plan, enc in zip(item.rows, encoded, strict=True)]
    except MaskRefused as exc:
        if item.fallback is None or exc.is_filter or exc.code in LIMIT_CODES:
            raise
        # e.g. a BPE merge across the end-of-turn and the next header: rows that end at the
        # reply have no such boundary, so per-turn rows can still be exact
        return [_build_row(tokenizer, plan, probe, policy)
                for plan in item.fallback(f"{exc.code}: {exc.message}")]


def _plan(
    prep: _Prepared,
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    template: str | None,
    fast: bool = True,
) -> _Planned:
    """Render what the strategy needs and plan the conversation's rows (see module doc).
    `fast`: take the shortcuts the probe found exact (`fast_paths_for`); off, every turn is
    rendered as in the render diff's definition (what the cross-check compares with)."""
    strategy = _strategy(probe, policy)
    planner = _Planner(prep, tokenizer, probe, policy, template, fast)
    # "auto" (also where it took the probe's tags): a conversation one row cannot hold exactly,
    # e.g. a BPE token across a tag's end, gets per-turn rows, verified as every row is
    auto = policy.strategy == "auto"
    if strategy == STRATEGY_GENERATION and fast and probe.fast_paths.get(FAST_GENERATION):
        row = _generation_row(planner, planner.targets, planner.ordinals)
        if row is not None:
            prep.render_path = RENDER_PATH_TAGS
            return _Planned(prep, [row], planner.per_turn if auto else lambda _why: _plan(
                prep, tokenizer, probe, policy, template, fast=False).rows)
    single, single_failure = planner.single_row(strategy)
    if single is not None:
        return _Planned(prep, [single], planner.per_turn if auto else None)
    if (strategy in (STRATEGY_RENDER_DIFF, STRATEGY_GENERATION) and len(planner.targets) > 1
            and not auto):
        raise MaskRefused(R_NOT_PREFIX_STABLE, single_failure)
    if strategy == STRATEGY_GENERATION and len(planner.targets) == 1:  # cross-check HF's mask
        try:
            row_or_why = _single_row(planner, planner.turns_for({}), {}, strategy)
        except MaskRefused as exc:
            if not auto or exc.code in FILTER_CODES or exc.code in LIMIT_CODES:
                raise
            return _Planned(prep, planner.per_turn(f"{exc.code}: {exc.message}"))
        if isinstance(row_or_why, str):
            raise MaskRefused(R_GENERATION_PROMPT_MISMATCH, row_or_why)
        return _Planned(prep, [row_or_why])
    return _Planned(prep, planner.per_turn(single_failure))


def _strategy(probe: TemplateProbe, policy: MaskPolicy) -> str:
    """The policy's strategy; "auto" takes the tags when the probe chose them."""
    strategy = policy.strategy
    if strategy == "auto":
        strategy = STRATEGY_GENERATION if probe.strategy == STRATEGY_GENERATION else "auto"
    if strategy == STRATEGY_GENERATION and not (
        probe.has_generation_tags and probe.generation_mask_usable
    ):
        raise MaskRefused(
            R_GENERATION_TAGS_UNUSABLE, "template has no usable {% generation %} tags"
        )
    return strategy


@dataclass
class _Planner(_Masking):
    """What a conversation's plans share: its target turns and, per base kwargs, those turns
    rendered (once: the single-row attempt and the per-turn rows use the same)."""

    fast: bool
    rendered: dict[str, list[_Turn]] = field(default_factory=dict)

    @property
    def targets(self) -> list[int]:
        idx = self.prep.assistant_idx
        return idx if self.policy.turns == "all" else idx[-1:]

    @property
    def ordinals(self) -> dict[int, int]:
        return {i: k for k, i in enumerate(self.prep.assistant_idx)}

    def turns_for(self, base: dict[str, Any]) -> list[_Turn]:
        """The target turns under `base` kwargs: read off one render where the probe allowed
        it and the marks hold (`one_render`), on a template prefix-stable under them or for
        the last turn alone (its prompt is then the only text read off the full render); else
        rendered turn by turn."""
        key = json.dumps(base, sort_keys=True)
        if key not in self.rendered:
            probe = self.probe
            stable = probe.prefix_stable if not base else base == probe.stable_kwargs
            made = None
            if (self.fast and (stable or len(self.targets) == 1)
                    and probe.fast_paths.get(FAST_ONE_RENDER)):
                made = _turns_from_one_render(self, base, self.targets, self.ordinals)
            if made is None:
                self.prep.render_path = RENDER_PATH_EVERY
                made = self._render_every_turn(base, self.fast and stable)
            self.rendered[key] = made
        return self.rendered[key]

    def _render_every_turn(self, base: dict[str, Any], shortcut: bool) -> list[_Turn]:
        """The target turns rendered under `base` kwargs, the last first (with `shortcut`, its
        prompt gives the one before's end); the first turn's refusal, as when rendered in
        order."""
        ordinals = self.ordinals
        made: list[_Turn | Exception] = []
        following: int | None = None
        for i in reversed(self.targets):
            try:
                made.append(_TurnAttempt(self, i, ordinals[i]).render(
                    base, following if shortcut else None))
            except (MaskRefused, RenderError) as exc:
                made.append(exc)
            following = i
        made.reverse()
        for turn in made:
            if isinstance(turn, Exception):
                raise turn
        return made  # type: ignore[return-value]

    def per_turn(self, why: str) -> list[_RowPlan]:
        """One row per target turn: its prompt, then its reply (encoded apart)."""
        several = len(self.targets) > 1
        label = (STRATEGY_PER_TURN if several or self.probe.strategy == STRATEGY_PER_TURN
                 else self.probe.strategy)
        plans = []
        for t in self.turns_for({}):
            text = t.prompt + t.reply
            norms = self.prep.normalizations + t.notes
            if several:
                norms = [*norms, "per_turn_rows:" + why[:120]]
            plans.append(_RowPlan(text, [(len(t.prompt), len(text))], [t.reply], t.append_eos,
                                  t.ordinal, norms, label, split_at=len(t.prompt),
                                  prefill=t.prefill))
        return plans

    def single_row(self, strategy: str) -> tuple[_RowPlan | None, str]:
        """The conversation as one row, under the default kwargs when the probe found the
        template prefix-stable, else its stable kwarg; or (None, why not). One-turn rows need
        no attempt (the same row either way)."""
        probe = self.probe
        one_turn_auto = strategy == "auto" and len(self.targets) == 1
        bases: list[dict[str, Any]] = []
        if strategy != STRATEGY_PER_TURN and not one_turn_auto:
            if probe.prefix_stable:
                bases = [{}]
            elif probe.stable_kwargs:
                bases = [dict(probe.stable_kwargs)]
        why = "" if bases else "the template is not prefix-stable (probe)"
        for base in bases:
            try:
                row_or_why = _single_row(self, self.turns_for(base), base, strategy)
            except MaskRefused as exc:
                if (exc.code in FILTER_CODES or exc.code in LIMIT_CODES
                        or self.policy.strategy != "auto"):
                    raise
                row_or_why = f"{exc.code}: {exc.message}"
            if isinstance(row_or_why, _RowPlan):
                return row_or_why, ""
            why = row_or_why
        return None, why
