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

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import DrafterOutput, TokenizedOutput
from dflash_etl.core.rundir import RunDir


def aux_hidden_state_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """Our layer ids in the convention that counts the embedding output as layer 0."""
    return [int(i) + 1 for i in target_layer_ids]


def vllm_serve_command(target: str | Path, drafter_dir: str | Path, block_size: int,
                       template_kwargs: dict[str, Any] | None = None,
                       template_flags: str = "") -> str:
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
    return line + template_flags


def attention_mismatch(config: dict[str, Any], where: str | Path) -> str | None:
    """What is wrong where a drafter's config.json declares another attention than DFlash's
    (full attention over the context before each anchor, bidirectional within the block, as
    our trainer trains and z-lab's model computes): an engine that reads `layer_types` or
    `use_sliding_window` would serve a pattern the drafter never trained on."""
    types = config.get("layer_types") or []
    other = sorted({str(t) for t in types if t != "full_attention"})
    if not other and not config.get("use_sliding_window") and not config.get("is_causal"):
        return None
    said = [f"layer_types {other}"] if other else []
    said += [f"{key} = {config[key]!r}" for key in ("use_sliding_window", "is_causal")
             if config.get(key)]
    return (f"{where}: the drafter's config.json declares {', '.join(said)}, but a DFlash drafter "
            "attends to all of the context before its anchor and to its whole block (no "
            "sliding window, not causal), as it was trained: an engine reading these keys "
            "would serve another attention pattern and accept less. Set layer_types to "
            "\"full_attention\" for every layer and drop use_sliding_window / is_causal")


# what the field's issue trackers said as of 2026-12 (not checked here: vLLM needs a GPU)
DFLASH2_SERVING = (
    "note: the drafter is DFlash2 (config.json architectures = DFlash2DraftModel): vLLM loads it "
    "from 0.28.0 on (vllm-project/vllm#52816, the same \"method\": \"dflash\"); earlier vLLM "
    "and SGLang's DFlash load DFlash drafters only (vllm-ascend#14524 and others are open). "
    "z-lab's dflash_generate decodes it as is")


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
    if problem := attention_mismatch(trained.config, trained.drafter_dir / "config.json"):
        raise StageError(problem)
    target = record.settings["target"]
    return vllm_serve_command(target, trained.drafter_dir, trained.block_size,
                              tokenized[0].template_kwargs, rows_template(run, target).flags)


@dataclass(frozen=True)
class RowsTemplate:
    """The chat template tokenize rendered the rows with, where it is not the target's own:
    a server (and eval) rendering prompts with the target's would show the drafter contexts it
    never trained on. `text`: that template; `flags`: what makes vLLM render with it."""

    text: str | None = None
    flags: str = ""
    note: str = ""


def rows_template(run: RunDir, target: str | Path) -> RowsTemplate:
    """Compares the template sha256 tokenize recorded with the target directory's own."""
    from dflash_etl.models.tokenizer import load_tokenizer, read_template
    from dflash_etl.templates.probe import default_template

    tokenized = run.published(TokenizedOutput)
    if tokenized is None or not Path(target).is_dir():
        return RowsTemplate()
    output, record = tokenized
    probe = output.stage_dir / "probe.json"
    rendered = json.loads(probe.read_text()).get("template_sha256") if probe.is_file() else None
    try:
        served = template_sha256(load_tokenizer(str(target)))
    except StageError:  # no tokenizer beside the weights: the server is given one anyway
        return RowsTemplate()
    if rendered is None or served == rendered:
        return RowsTemplate()
    given, model = record.settings.get("chat_template"), record.settings.get("model")
    if given and _sha(read_template(given) or "") == rendered:
        path = str(Path(given).resolve())
        return RowsTemplate(read_template(given), f" --chat-template {shlex.quote(path)}",
                            f"the rows were rendered with the chat template in {path}, not "
                            f"the target's own")
    if model and Path(model).is_dir() and template_sha256(load_tokenizer(model)) == rendered:
        path = str(Path(model).resolve())
        return RowsTemplate(default_template(load_tokenizer(model)), f" --tokenizer "
                            f"{shlex.quote(path)}", f"the rows were rendered with the chat "
                            f"template of {path}, not the target's own")
    return RowsTemplate(note="the rows were rendered with another chat template than the "
                        f"target's own (sha256 {rendered[:12]}), which is no longer where "
                        "tokenize read it: serve and evaluate with that template")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def template_sha256(tokenizer: Any) -> str | None:
    """The sha256 of a tokenizer's default chat template, as tokenize's probe records it."""
    from dflash_etl.templates.probe import default_template

    source = default_template(tokenizer)
    return _sha(source) if source else None


def serve_notes(run_root: str | Path) -> list[str]:
    """What to know before serving a run's drafter: the last layer's caveat, and the chat
    template the rows were rendered with where it is not the target's own."""
    notes = [caveat] if (caveat := last_layer_caveat(run_root)) else []
    run = RunDir(Path(run_root))
    found = run.published(DrafterOutput)
    if found is not None and found[1].settings.get("arch") == "dflash2":
        notes.append(DFLASH2_SERVING)
    if found is not None and (template := rows_template(run, found[1].settings["target"])).note:
        notes.append(f"note: {template.note}" + (
            f" ({template.flags.strip()} in the line above makes vLLM render with it)"
            if template.flags else ""))
    return notes


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
