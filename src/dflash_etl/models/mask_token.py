"""The mask token a DFlash drafter's blocks use: train chooses it, and the hand-off shapes a
drafter config with the same rule when the run trained none."""

from __future__ import annotations

from dflash_etl.core.errors import StageError


def resolve_mask_token(model_dir: str, embedding_rows: int, explicit: int) -> tuple[int, str]:
    """The mask token the blocks use, and why it was chosen (recorded in the stats)."""
    from dflash_etl.models.loading import load_auto_tokenizer

    if explicit >= 0:
        return explicit, "set in the settings"
    tok = load_auto_tokenizer(model_dir)
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id), "the tokenizer's mask token"
    vocab = tok.get_vocab()
    if "<|MASK|>" in vocab:
        return int(vocab["<|MASK|>"]), "the tokenizer's <|MASK|> token"
    if embedding_rows > len(tok) and len(tok) not in set(vocab.values()):
        return len(tok), "the first embedding row no token uses (as DFlash's Qwen3 drafters)"
    if tok.pad_token_id is not None:
        return int(tok.pad_token_id), ("the pad token: the tokenizer has no mask token and the "
                                       "embedding no spare row (speculators' fallback)")
    raise StageError(f"{model_dir}: no mask token, no spare embedding row and no pad token; "
                     "set [train] mask_token_id (or --mask-token-id) to a token id to use")
