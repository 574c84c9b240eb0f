"""What each consumer builds from a run's hand-off, read by its own code: the consumers x
(layers, attention, block, mask token, head rows, dtype, thinking) table.

For each run (complete through train), beside our drafter's config.json:

* z-lab: `dflash.model.DFlashDraftModel.from_pretrained` on the drafter directory (what
  `dflash_generate` decodes with);
* SpecForge: `export --to specforge`, its run config parsed by its own `Config` and resolved by
  its own `resolve_draft_config`, its `create_dflash_sdpa_mask` for the attention;
* speculators: `export --to speculators`, the printed command resolved by its own
  `TrainConfig` and built by its CLI (`--dry-run`: built and saved, not trained), its
  `create_anchor_block_mask_mod` for the attention;
* vLLM: the printed `vllm serve` line and the drafter config.json vLLM reads.

"attention" is "= ours" when the consumer's mask equals ours on a small block (anchors 1 and 5,
9 context tokens) for every drafter layer; "thinking" is what the rows were rendered with
(the exports carry the tokens as rendered; vLLM's default chat-template kwargs).

    python benchmarks/bench_consumers.py --run runs/default [--run runs/other ...]
        [--out benchmarks/results/consumers]

Needs speculators and dflash (`make setup`) and SpecForge's package in ../shared/fixtures;
the exports go to benchmarks/work/consumers/. No timing: a record of what each one resolves.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "consumers"
SPECFORGE = REPO.parent / "shared" / "fixtures" / "specforge"
DEFAULT_OUT = HERE / "results" / "consumers"
FIELDS = ("layers", "attention", "block", "mask token", "head rows", "dtype", "thinking")


def _grid_mask(mask_mod: Any, q_len: int, kv_len: int) -> Any:
    """A flex-attention mask_mod evaluated on every (query, key) pair."""
    import torch

    q = torch.arange(q_len)[:, None].expand(q_len, kv_len)
    kv = torch.arange(kv_len)[None, :].expand(q_len, kv_len)
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, q, kv)


def ours(run: Path) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Our drafter's row, its config.json, and our block mask on the small block."""
    import torch

    from dflash_etl.core.outputs import TokenizedOutput
    from dflash_etl.models.drafter import block_attention_mask

    config = json.loads((run / "train" / "drafter" / "config.json").read_text())
    block = config["block_size"]
    mask = block_attention_mask(torch.tensor([[1, 5]]), torch.ones(1, 9, dtype=torch.bool),
                                block)[0]
    kwargs = TokenizedOutput.read(run / "tokenize").template_kwargs
    row = {"layers": config["dflash_config"]["target_layer_ids"], "attention": "block mask",
           "block": block, "mask token": config["dflash_config"]["mask_token_id"],
           "head rows": config["vocab_size"], "dtype": config["torch_dtype"],
           "thinking": json.dumps(kwargs or {})}
    return row, config, mask


def zlab(run: Path, config: dict[str, Any]) -> dict[str, Any]:
    import torch
    from dflash.model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(run / "train" / "drafter", dtype=torch.float32)
    causal = {getattr(layer.self_attn, "is_causal", None) for layer in model.layers}
    return {"layers": list(model.target_layer_ids), "block": model.block_size,
            "attention": "= ours (is_causal False: the block sees itself and the context)"
            if causal == {False} else f"is_causal {causal}",
            "mask token": model.mask_token_id,
            "head rows": f"{config['vocab_size']} (the target's head, passed in)",
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "thinking": "the prompt as given"}


def specforge(run: Path, mask: Any, block: int) -> dict[str, Any]:
    import torch

    if str(SPECFORGE) not in sys.path:
        sys.path.insert(0, str(SPECFORGE))
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.config.schema import Config
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.training.model_loading import resolve_draft_config

    from dflash_etl.handoff.export import export

    out = WORK / f"{run.name}-specforge"
    shutil.rmtree(out, ignore_errors=True)
    doc = export(run, "specforge", out, gpus=1, progress=False)
    parsed = Config.model_validate(json.loads((out / "specforge_run.json").read_text()))
    resolved = resolve_draft_config(parsed, provider=algorithm_providers().model.draft_config)
    model = DFlashDraftModel(resolved)
    theirs = create_dflash_sdpa_mask(torch.tensor([[1, 5]]), torch.ones(1, 2, dtype=torch.bool),
                                     9, block, "cpu", sliding_window=model.sliding_window)
    return {"layers": resolved.dflash_config["target_layer_ids"], "block": resolved.block_size,
            "attention": "= ours" if torch.equal(theirs[0, 0], mask) else "**differs**",
            "mask token": resolved.dflash_config["mask_token_id"],
            "head rows": resolved.vocab_size,
            "dtype": f"{getattr(resolved, 'torch_dtype', None) or getattr(resolved, 'dtype', '')}"
                     f" (states {doc.get('dtype', '?')})",
            "thinking": "the exported tokens"}


def speculators(run: Path, mask: Any, block: int) -> dict[str, Any]:
    import torch
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    from dflash_etl.handoff.export import export

    out, saved = WORK / f"{run.name}-speculators", WORK / f"{run.name}-speculators-drafter"
    for path in (out, saved):
        shutil.rmtree(path, ignore_errors=True)
    doc = export(run, "speculators", out, progress=False)
    argv = [*shlex.split(doc["command"])[3:], "--save-path", str(saved), "--dry-run",
            "--draft-attn-impl", "sdpa"]  # CPU: no flex attention kernels
    cli.main(TrainConfig.resolve(argv))
    built = json.loads((saved / "config.json").read_text())
    decoder = built["transformer_layer_config"]
    same = True
    for layer_type in decoder["layer_types"]:
        window = None if layer_type == "full_attention" else decoder["sliding_window"]
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
            torch.zeros(9, dtype=torch.long), 9, torch.tensor([1, 5]), block,
            sliding_window=window,
            sliding_window_non_causal=built.get("sliding_window_non_causal", False))
        same &= bool(torch.equal(_grid_mask(mask_mod, q_len, kv_len), mask))
    return {"layers": [i - 1 for i in built["aux_hidden_state_layer_ids"]],
            "block": built["block_size"], "attention": "= ours" if same else "**differs**",
            "mask token": built["mask_token_id"],
            "head rows": built.get("draft_vocab_size"),
            "dtype": f"{decoder.get('dtype') or decoder.get('torch_dtype')} (saves bf16)",
            "thinking": "the exported tokens"}


def vllm(run: Path) -> dict[str, Any]:
    from dflash_etl.models.serving import vllm_command

    argv = shlex.split(vllm_command(run))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    served = json.loads((Path(spec["model"]) / "config.json").read_text())
    kwargs = (json.loads(argv[argv.index("--default-chat-template-kwargs") + 1])
              if "--default-chat-template-kwargs" in argv else {})
    return {"layers": [i - 1 for i in served["eagle_aux_hidden_state_layer_ids"]],
            "block": f"{spec['num_speculative_tokens'] + 1} (num_speculative_tokens "
                     f"{spec['num_speculative_tokens']})",
            "attention": "the config's (no mask of its own to compare on CPU)",
            "mask token": served["dflash_config"]["mask_token_id"],
            "head rows": f"{served['vocab_size']} (the target's head)",
            "dtype": served.get("torch_dtype"), "thinking": json.dumps(kwargs)}


def table(run: Path) -> dict[str, dict[str, Any]]:
    mine, config, mask = ours(run)
    block = config["block_size"]
    rows = {"ours (config.json)": mine}
    for name, read in (("z-lab DFlashDraftModel", lambda: zlab(run, config)),
                       ("SpecForge resolve_draft_config", lambda: specforge(run, mask, block)),
                       ("speculators CLI (--dry-run)", lambda: speculators(run, mask, block)),
                       ("vLLM serve line", lambda: vllm(run))):
        try:
            rows[name] = read()
        except Exception as exc:  # a consumer not installed, or one that refuses the run
            rows[name] = {f: "" for f in FIELDS} | {"layers": f"failed: {exc}"[:200]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    doc = {"date": date, "runs": {}}
    lines = [f"# consumers — {date}", "",
             "Command: `python benchmarks/bench_consumers.py "
             + " ".join(f"--run {r}" for r in args.run) + "`", ""]
    for run in args.run:
        rows = table(run.resolve())
        doc["runs"][str(run)] = rows
        mine = rows["ours (config.json)"]
        lines += [f"## {run}", "", "| consumer | " + " | ".join(FIELDS) + " |",
                  "|---" * (len(FIELDS) + 1) + "|"]
        for name, row in rows.items():
            cells = [str(row.get(f, "")) for f in FIELDS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        differ = [f"{name}: {f}" for name, row in rows.items() for f in ("layers", "mask token")
                  if row.get(f) != mine[f] and not str(row.get("layers")).startswith("failed")]
        lines += ["", f"Layers and mask token differ from ours: {', '.join(differ) or 'none'}.",
                  ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
