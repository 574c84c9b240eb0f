"""--device-map auto (accelerate's placement of a target larger than one GPU) for extract,
regenerate's transformers backend, online training and tau evaluation. On a CPU-only machine
'auto' places the tiny target on the CPU: it loads through accelerate (hf_device_map), and what
it computes equals the plain load exactly; bad placement settings are refused up front, naming
the setting. A split over several GPUs is checked only where one is lent (README)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.loading import parse_max_memory, placement
from dflash_etl.stages import extract, regenerate, train

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
REPO = Path(__file__).resolve().parents[1]


def test_max_memory_is_parsed_into_accelerates_mapping():
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB",
                                                             "cpu": "200GiB"}
    assert parse_max_memory("cpu=1.5GB,0=1000") == {"cpu": "1.5GB", 0: 1000}
    assert parse_max_memory("") is None
    assert placement("none", "") == {}
    assert placement("auto", "") == {"device_map": "auto"}
    assert placement("auto", "cpu=2GiB") == {"device_map": "auto", "max_memory": {"cpu": "2GiB"}}


@pytest.mark.parametrize("text, says", [
    ("0:70GiB", "entry '0:70GiB' is not DEVICE=SIZE"),
    ("gpu0=70GiB", "entry 'gpu0=70GiB'"),
    ("0=lots", "entry '0=lots'"),
    ("disk=100GiB", "disk offload is not supported"),
    ("0=1GiB,0=2GiB", "0 is given twice"),
])
def test_a_bad_max_memory_is_a_stage_error_naming_the_setting(untied_target, default_tokenized,
                                                              tmp_path, text, says):
    for run in (
        lambda: extract.run(None, tmp_path / "run", progress=False, model=str(untied_target),
                            device_map="auto", max_memory=text),
        lambda: train.run(None, tmp_path / "run", progress=False, target=str(untied_target),
                          device_map="auto", max_memory=text),
        lambda: regenerate.run(None, tmp_path / "run", progress=False, model=str(untied_target),
                               device_map="auto", max_memory=text),
    ):
        with pytest.raises(StageError, match="--max-memory") as caught:
            run()
        assert says in str(caught.value)


def test_max_memory_without_device_map_auto_is_refused(untied_target, tmp_path):
    with pytest.raises(StageError, match="applies only with --device-map auto"):
        extract.run(None, tmp_path / "run", progress=False, model=str(untied_target),
                    max_memory="cpu=2GiB")


@pytest.mark.slow
def test_device_map_auto_loads_through_accelerate_and_extracts_the_same_states(untied_target,
                                                                               default_tokenized,
                                                                               tmp_path):
    from safetensors.torch import load_file

    from dflash_etl.models.target import Target, TargetSpec

    mapped = Target(TargetSpec(model=str(untied_target), layers="0,2", device_map="auto",
                               max_memory="cpu=4GiB"))
    # transformers sets hf_device_map only for a map over several devices: here one, the CPU
    assert mapped.placement == {"": "cpu"} and str(mapped.device) == "cpu"
    plain = Target(TargetSpec(model=str(untied_target), layers="0,2"))
    rows = [[5, 9, 100, 7, 3], [11, 12]]
    # the calls online training and tau evaluation make: equal exactly
    for a, b in zip(mapped.forward(rows, logits=True), plain.forward(rows, logits=True),
                    strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    from transformers import DynamicCache

    ours = mapped.extend([5, 9, 100], DynamicCache(config=mapped.model.config))
    theirs = plain.extend([5, 9, 100], DynamicCache(config=plain.model.config))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])

    runs = {}
    for name, extra in (("plain", {}), ("auto", {"device_map": "auto",
                                                 "max_memory": "cpu=4GiB"})):
        run_dir = tmp_path / name
        shutil.copytree(default_tokenized, run_dir, ignore=shutil.ignore_patterns("*extract*"))
        extract.run(None, run_dir, progress=False, model=str(untied_target), layers="0,2",
                    batch_tokens=2048, **extra)
        runs[name] = sorted((run_dir / "extract" / "hidden_states").glob("*.safetensors"))
    # the placement is not part of the fingerprint: a complete run is not redone elsewhere
    again = extract.run(None, tmp_path / "plain", progress=False, model=str(untied_target),
                        layers="0,2", batch_tokens=2048, device_map="auto")
    assert again.get("skipped") is True
    assert [p.name for p in runs["plain"]] == [p.name for p in runs["auto"]]
    for a, b in zip(runs["plain"], runs["auto"], strict=True):
        x, y = load_file(str(a)), load_file(str(b))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a.name


def test_regenerate_transformers_backend_with_device_map_auto(untied_target):
    backend = regenerate.TransformersBackend(regenerate.RegenerateSettings(
        model=str(untied_target), max_new_tokens=6, device_map="auto"))
    plain = regenerate.TransformersBackend(regenerate.RegenerateSettings(
        model=str(untied_target), max_new_tokens=6))
    prompts = ["Hello there", "What is two plus two?"]
    assert backend.generate_text(prompts) == plain.generate_text(prompts)


def _cpu_budget_for_one_layer(target: Path) -> str:
    """A CPU budget holding the embedding and one decoder layer: accelerate then offloads the
    other layers and the head to disk (read back for each forward pass through its hooks),
    a real multi-device placement on a CPU-only machine."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_slice(name)
            part = "embed" if "embed_tokens" in name else "layer0" if ".layers.0." in name \
                else "other"
            sizes[part] = sizes.get(part, 0) + int(np.prod(t.get_shape())) * 4
    # accelerate keeps room on the main device for the largest offloaded module (the head)
    return f"cpu={2 * sizes['embed'] + int(1.5 * sizes['layer0'])}"


@pytest.fixture(scope="module")
def split_memory(untied_target) -> str:
    return _cpu_budget_for_one_layer(untied_target)


@pytest.mark.slow
def test_a_target_split_over_devices_extracts_and_trains_as_the_plain_load(
        untied_target, default_tokenized, tmp_path, split_memory):
    """Embedding and layer 0 on the CPU, the rest offloaded to disk (accelerate's hooks load
    each layer for its call, the head is on "meta" between calls): the extracted states and a
    few online training steps (the hooks' states, the head's loss, tau) equal the plain run's."""
    from safetensors.torch import load_file

    from dflash_etl.models.target import Target, TargetSpec

    split = Target(TargetSpec(model=str(untied_target), layers="0,2", device_map="auto",
                              max_memory=split_memory))
    assert split.placement["model.embed_tokens"] == split.placement["model.layers.0"] == "cpu"
    assert split.placement["model.layers.2"] == split.placement["lm_head"] == "disk"
    assert split.model.get_output_embeddings().weight.device.type == "meta"
    assert str(split.device) == "cpu"
    runs = {}
    for name, extra in (("plain", {}), ("split", {"device_map": "auto",
                                                  "max_memory": split_memory})):
        run_dir = tmp_path / name
        shutil.copytree(default_tokenized, run_dir, ignore=shutil.ignore_patterns("*extract*"))
        extract.run(None, run_dir, progress=False, model=str(untied_target), layers="0,2",
                    batch_tokens=2048, **extra)
        runs[name] = run_dir
        doc = train.run(None, run_dir, progress=False, target=str(untied_target), online=True,
                        steps=3, draft_layers=1, block_size=8, batch_rows=4, anchors_per_row=8,
                        eval_prompts=2, eval_new_tokens=6, layers="0,2", **extra)
        runs[name + "_tau"] = doc["total"]["tau_final"]
    shards = sorted((runs["plain"] / "extract" / "hidden_states").glob("*.safetensors"))
    assert shards
    for a in shards:
        x = load_file(str(a))
        y = load_file(str(runs["split"] / "extract" / "hidden_states" / a.name))
        assert all(torch.equal(x[k], y[k]) for k in x), a.name
    x, y = (load_file(str(runs[n] / "train" / "drafter" / "model.safetensors"))
            for n in ("plain", "split"))
    assert all(torch.allclose(x[k], y[k], atol=1e-6) for k in x)
    assert runs["plain_tau"] == runs["split_tau"]
