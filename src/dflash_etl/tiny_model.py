"""A tiny random-weight Qwen2 with the project's own tokenizer (data/tokenizer), built from a
config: a real model to run regenerate and extract on where there is no model hub (tests,
benchmarks, trying the stages). Its text is meaningless; its computation is real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PROJECT_TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizer"


def build_tiny_qwen2(out: Path, *, hidden_size: int = 64, layers: int = 4, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0,
                     tokenizer_dir: Path = PROJECT_TOKENIZER) -> Path:
    """Write the model (seeded weights, MLP width 2 x hidden) and the tokenizer files to `out`;
    a directory that already holds a config.json is reused as it is."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(vocab["model"]["vocab"]) + len(vocab["added_tokens"]),
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True)).save_pretrained(out)
    # save_pretrained writes its own generation config; keep the tokenizer's end-of-turn id
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2,
                                                            "pad_token_id": 0}))
    return out
