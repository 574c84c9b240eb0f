"""What generation reads of the regenerate stage's settings.

A protocol, not the settings class itself: the stage owns its settings (TOML, CLI, help), and
the code here must not import the stage it serves."""

from __future__ import annotations

from typing import Any, Protocol


def render_kwargs(settings: GenerationSettings) -> dict[str, Any]:
    """The template variables every render of a reply's prompt gets: the template kwargs, and
    enable_thinking where the thinking setting is on or off."""
    kwargs = dict(settings.template_kwargs)
    if settings.thinking != "keep":
        kwargs["enable_thinking"] = settings.thinking == "on"
    return kwargs


class GenerationSettings(Protocol):
    """The regenerate settings the backends, the reply checks and the transform read."""

    model: str
    mode: str
    max_new_tokens: int
    temperature: float
    seed: int
    batch_size: int
    thinking: str
    template_kwargs: dict[str, Any]  # every render's variables (enable_thinking is `thinking`)
    keep_truncated: bool
    dummy_min_repeats: int
    served_model: str | None
    concurrency: int
    timeout_s: float
    request_deadline_s: float
    retries: int
    stream: bool
    device_map: str
    max_memory: str
    cooldown_s: float
    repeat_tail_chars: int
    repeat_max_cycle: int
    ngram_repeat_max: float

    @property
    def servers(self) -> tuple[str, ...]: ...
