"""A tiny random-weight Qwen2 with the project's own tokenizer (data/tokenizer), built from a
config: a real model to run regenerate and extract on where there is no model hub (tests,
benchmarks, trying the stages). Its text is meaningless; its computation is real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dflash_etl.core.config import PipelineConfig, project_path, tiny_target_problems
from dflash_etl.core.errors import StageError

CREATED_MARKER = ".dflash_etl_target"  # in a target directory the project made (and may replace)
PROJECT_TOKENIZER = project_path("data/tokenizer")


def build_tiny_qwen2(out: Path, *, hidden_size: int = 64, layers: int = 4, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0, tie_word_embeddings: bool = True,
                     exponential_decay_length_penalty: tuple[int, float] | None = None,
                     tokenizer_dir: Path = PROJECT_TOKENIZER) -> Path:
    """Write the model (seeded weights, MLP width 2 x hidden) and the tokenizer files to `out`;
    a directory that already holds a config.json is reused as it is. A tied random model's
    greedy reply mostly repeats its input token (its output row is its input row); an untied one
    writes varied text, which is what a drafter should learn from.

    Random weights almost never pick the end-of-turn token, so every reply would run to
    max_new_tokens. `exponential_decay_length_penalty` ([start, factor], transformers' generation
    option, kept in the model's generation_config.json) raises that token's score by `factor`
    per token after `start` tokens of the reply: the replies then end, at lengths that vary with
    the prompt, as a real target's do."""
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
        # stated, as real checkpoints state it: speculators' drafter builder reads it
        head_dim=hidden_size // heads,
        tie_word_embeddings=tie_word_embeddings)).save_pretrained(out)
    # save_pretrained writes its own generation config; keep the tokenizer's end-of-turn id
    generation: dict[str, Any] = {"eos_token_id": 2, "pad_token_id": 0}
    if exponential_decay_length_penalty is not None:
        generation["exponential_decay_length_penalty"] = list(exponential_decay_length_penalty)
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def build_tiny_qwen3_5(out: Path, *, tokenizer_dir: Path, vl: bool = False, hidden_size: int = 32,
                       layers: int = 4, seed: int = 0) -> Path:
    """A tiny random-weight Qwen3.5/3.6 (transformers `qwen3_5`: Gated DeltaNet linear attention
    with a full-attention layer every 2nd layer) with the Qwen3.6 tokenizer: the text-only
    `Qwen3_5ForCausalLM`, or with `vl` the published layout, `Qwen3_5ForConditionalGeneration`
    (a composite config whose decoder is `model.language_model` beside a vision tower as deep as
    the decoder, so a search by length cannot tell them apart). The 248k vocabulary dominates
    the size: keep `hidden_size` small. A directory holding a config.json is reused."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    if (out / "config.json").exists():
        return out
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise StageError(f"no Qwen3.6 tokenizer at {tokenizer_dir}: pass tokenizer_dir")
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json":  # the fixture's config names only the architecture
            shutil.copy(f, out / f.name)
    eos = json.loads((tokenizer_dir / "generation_config.json").read_text())
    text = {"vocab_size": 248320, "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "layer_types": [("linear_attention", "full_attention")[i % 2] for i in range(layers)],
            "eos_token_id": eos["eos_token_id"], "pad_token_id": eos["pad_token_id"],
            "bos_token_id": eos["bos_token_id"]}
    torch.manual_seed(seed)
    if vl:
        model: Any = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=text, vision_config={
                "depth": layers, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                "out_hidden_size": hidden_size, "patch_size": 4, "num_position_embeddings": 16}))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(eos))
    return out


def configured_target(config: PipelineConfig | None, run_dir: str | Path) -> str | None:
    """The target model directory the config's [target] section names: `model = "DIR"`
    (relative to the config), or `tiny = {...}`, build_tiny_qwen2's arguments, built into
    `<run>/target/` on first use (the embedded default: there is no model hub to fetch from)."""
    if config is None:
        return None
    section = config.section("target")
    unknown = set(section) - {"model", "tiny"}
    if unknown:
        raise StageError(f"[target]: unknown keys {sorted(unknown)}; known: ['model', 'tiny']")
    if section.get("model"):
        return str((config.base_dir / section["model"]).resolve())
    if "tiny" in section:
        return str(_tiny_target(Path(run_dir).resolve() / "target", dict(section["tiny"])))
    return None


def _tiny_target(out: Path, spec: dict[str, Any]) -> Path:
    """The run's tiny target, rebuilt when the config's spec changed (the stages' fingerprints
    then change with its files)."""
    import inspect

    allowed = set(inspect.signature(build_tiny_qwen2).parameters) - {"out", "tokenizer_dir"}
    if set(spec) - allowed:
        raise StageError(f"[target] tiny: unknown keys {sorted(set(spec) - allowed)}; known: "
                         f"{sorted(allowed)}")
    if problems := tiny_target_problems(spec):
        raise StageError("; ".join(problems))
    marker = out / "tiny_spec.json"
    wanted = json.dumps(spec, sort_keys=True)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise StageError(f"[target] tiny builds the run's tiny target in {out}, which is "
                         f"{'a link' if out.is_symlink() else 'a file'}: remove it, or name "
                         "the model to use with [target] model = \"DIR\"")
    if out.exists() and (not marker.exists() or marker.read_text() != wanted):
        # only a directory the project made is replaced (an older version left the spec alone)
        if not (out / CREATED_MARKER).exists() and not marker.exists() and any(out.iterdir()):
            raise StageError(
                f"[target] tiny builds the run's tiny target in {out}, but that directory exists "
                f"and was not made by dflash-etl (no {CREATED_MARKER} in it), so it is not "
                "replaced: move it away, or use it as the target with [target] model = "
                f"\"{out}\" instead of tiny")
        shutil.rmtree(out)
    if not marker.exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / CREATED_MARKER).write_text("made by dflash-etl ([target] tiny); it replaces this "
                                          "directory when the spec changes\n")
        build_tiny_qwen2(out, **spec)
        marker.write_text(wanted)
    return out


def with_target(config: PipelineConfig | None, run_dir: str | Path, section: dict[str, Any],
                overrides: dict[str, Any], key: str) -> dict[str, Any]:
    """`overrides` with the stage's model (`key`) taken from [target] when neither the command
    line nor the stage's own section names one."""
    if overrides.get(key) is None and not section.get(key):
        found = configured_target(config, run_dir)
        if found:
            return {**overrides, key: found}
    return overrides
