"""One source for the drafter's architecture: the drafter train builds is made of the classes of
dflash_remote.py (the remote code every drafter directory carries as dflash.py), that file stands
alone (torch and transformers only), and the copy in a drafter directory is it byte for byte.
That both compute the same is test_drafter_handoff's (through transformers' remote-code route)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from dflash_etl.models import dflash_remote  # noqa: E402
from dflash_etl.models import drafter as drafter_module  # noqa: E402


def _tiny() -> drafter_module.DrafterConfig:
    return drafter_module.DrafterConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, vocab_size=100, target_layer_ids=[0, 1],
        mask_token_id=99, block_size=4)


def test_the_trained_drafter_is_built_from_the_remote_codes_classes():
    model = drafter_module.DFlashDrafter(_tiny())
    for layer in model.layers:
        assert isinstance(layer.self_attn, dflash_remote.DFlashAttention)
        assert type(layer.mlp) is dflash_remote.DFlashMLP
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                 layer.self_attn.k_norm]
        assert all(type(n) is dflash_remote.DFlashRMSNorm for n in norms)
    assert type(model.hidden_norm) is type(model.norm) is dflash_remote.DFlashRMSNorm


def test_the_remote_code_stands_alone_and_is_copied_byte_for_byte(tmp_path):
    source = Path(dflash_remote.__file__).resolve()
    assert drafter_module.REMOTE_SOURCE.resolve() == source
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "typing", "inspect", "torch", "transformers"}, imported
    drafter_module.DFlashDrafter(_tiny()).save(tmp_path / "drafter")
    assert (tmp_path / "drafter" / drafter_module.REMOTE_CODE).read_bytes() == source.read_bytes()
