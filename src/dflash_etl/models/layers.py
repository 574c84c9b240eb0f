"""Which target layers a drafter reads: one rule for extract (what it stores) and train (what an
online run computes), here where both stages and the hand-off can import it."""

from __future__ import annotations

from dflash_etl.core.errors import StageError
from dflash_etl.models.target import LAST_LAYER_STATE, parse_layers, text_config


def target_shape(model: str) -> tuple[int, int]:
    """The target's (decoder layer count, hidden size), from its (text) config (no weights
    loaded)."""
    from dflash_etl.models.loading import load_config, refuse_remote_code

    refuse_remote_code(model)  # a path that is not a directory: its own message
    try:
        config = text_config(load_config(model))
        return int(config.num_hidden_layers), int(config.hidden_size)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise StageError(f"cannot read the target's config in {model}: {exc}") from exc


def target_layer_count(model: str) -> int:
    """The target's decoder layer count, from its (text) config (no weights loaded)."""
    return target_shape(model)[0]


def resolve_layers(layers: str, model: str, draft_layers: int) -> list[int]:
    """The target layers `layers` names ('auto': DFlash's rule for `draft_layers`) on the
    decoder of `model`."""
    return parse_layers(layers, target_layer_count(model), draft_layers)


def layer_state_identity(layers: list[int], n_layers: int) -> dict[str, str]:
    """What a fingerprint adds for layers that include the last one, whose state changed
    meaning (now after the final norm): outputs made before are redone; others keep theirs."""
    return {"last_layer_state": LAST_LAYER_STATE} if n_layers - 1 in layers else {}
