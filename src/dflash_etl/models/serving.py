"""What a trained drafter tells the tools that train on our data or serve it: the layer-id
conventions and the `vllm serve` line. No torch here, so the stages' and the CLI's import stays
light.

Layer ids. Ours: decoder layer i's output is layer i (the first decoder layer is 0), as z-lab's
DFlash, SpecForge and vLLM's `dflash_config.target_layer_ids` count them. speculators (its
`--target-layer-ids`, `aux_hidden_state_layer_ids`) and vLLM's hidden-state capture
(`eagle_aux_hidden_state_layer_ids`; its DFlash loader adds 1 to dflash_config.target_layer_ids
when that is absent) count the embedding output as layer 0, so the same layer is one higher
there: our [2] is their [3]."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import DrafterOutput, TokenizedOutput
from dflash_etl.core.rundir import RunDir


def aux_hidden_state_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """Our layer ids in the convention that counts the embedding output as layer 0."""
    return [int(i) + 1 for i in target_layer_ids]


def vllm_serve_command(target: str | Path, drafter_dir: str | Path, block_size: int,
                       template_kwargs: dict[str, Any] | None = None) -> str:
    """The `vllm serve` line for this drafter: vLLM's DFlash proposer drafts
    num_speculative_tokens tokens per step in one block (the anchor + that many mask tokens),
    so a drafter trained on blocks of `block_size` drafts block_size - 1 (z-lab's b16 drafters
    are served with 15). `template_kwargs`: what the rows were rendered with (thinking off...),
    the server's default for every request, so it serves what the drafter learned."""
    spec = {"method": "dflash", "model": str(Path(drafter_dir).resolve()),
            "num_speculative_tokens": block_size - 1}
    where = Path(target)
    target = where.resolve() if where.exists() else target  # a local directory, or a hub id
    line = (f"vllm serve {shlex.quote(str(target))} "
            f"--speculative-config {shlex.quote(json.dumps(spec))}")
    if template_kwargs:
        line += f" --default-chat-template-kwargs {shlex.quote(json.dumps(template_kwargs))}"
    return line


def vllm_command(run_root: str | Path) -> str:
    """The copy-pasteable `vllm serve TARGET --speculative-config ...` line for a run's trained
    drafter (the target it was trained against, num_speculative_tokens = block_size - 1, and
    the chat-template kwargs tokenize rendered the rows with)."""
    run = RunDir(Path(run_root))
    found, tokenized = run.published(DrafterOutput), run.published(TokenizedOutput)
    if found is None or tokenized is None:
        raise StageError(f"no trained drafter in {run.root}: run `dflash-etl train --run "
                         f"{run.root}` first")
    trained, record = found
    return vllm_serve_command(record.settings["target"], trained.drafter_dir,
                              trained.block_size, tokenized[0].template_kwargs)


def last_layer_caveat(run_root: str | Path) -> str:
    """A warning for a run's drafter that reads the target's last layer: it trained on the state
    after the final norm (what z-lab's `dflash_generate` and SpecForge give it), which vLLM's
    hidden-state capture does not give (it takes that layer before the norm); "" otherwise."""
    found = RunDir(Path(run_root)).published(DrafterOutput)
    if found is None:
        return ""
    config = json.loads((found[0].drafter_dir / "config.json").read_text())
    last = int(config.get("num_target_layers") or 0) - 1
    if last < 0 or last not in config.get("dflash_config", {}).get("target_layer_ids", []):
        return ""
    return (f"note: the drafter reads the target's last layer ({last}) after its final norm, as "
            "z-lab's dflash_generate and SpecForge feed it; vLLM captures that layer before "
            "the norm, so under vLLM it sees another state than it trained on (a lower served "
            f"tau): train on layers below {last} (`auto` does) for a vLLM deployment")
