"""What speculators (0.9) reads, and the command that trains on it.

Its `--data-path` is one directory: the tokenized dataset as `datasets.load_from_disk` reads it,
`token_freq.pt`, the size-keyed vocab maps `d2t-<N>.npy` / `t2d-<N>.npy` and `hidden_states/
hs_<i>.safetensors` (row i's chosen layers, then the last layer, which its loader splits off as
the verifier's). Its layer ids count the embedding output as layer 0: ours + 1 (see
models/serving.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from dflash_etl.models.serving import aux_hidden_state_layer_ids


@dataclass(frozen=True)
class SpeculatorsTraining:
    """What the printed command says; every value comes from the run."""

    target: str
    data_path: str
    save_path: str
    layers: list[int]  # ours (0-based decoder layers)
    draft_vocab_size: int
    draft_layers: int
    block_size: int
    seq_length: int
    mask_token_id: int | None
    rows_without_states: int
    states_dtype: str  # extract's: fp32 or bf16
    head_vocab: str = "full"  # ours (train's head_vocab): the whole LM head, or the draft rows
    # train's arch, and for "dflash2" its conv/selector settings (speculators' flag names)
    arch: str = "dflash"
    dflash2: tuple[tuple[str, float], ...] = ()

    def argv(self) -> list[str]:
        args = ["python", "-m", "speculators.train",
                "--speculator-type", self.arch,
                "--verifier-name-or-path", self.target,
                "--data-path", self.data_path,
                "--save-path", self.save_path,
                "--target-layer-ids", *map(str, aux_hidden_state_layer_ids(self.layers)),
                "--num-layers", str(self.draft_layers),
                # ours attend fully (bidirectional within a block) on every layer; speculators'
                # default is sliding-window attention, causal within the block
                "--full-attention-indices", *map(str, range(self.draft_layers)),
                "--block-size", str(self.block_size),
                "--total-seq-len", str(self.seq_length),
                # its loader casts the states to this; it defaults to bf16 whatever was stored
                "--hidden-states-dtype",
                "bfloat16" if self.states_dtype == "bf16" else "float32"]
        for name, value in self.dflash2:
            args += [f"--{name.replace('_', '-')}", str(value)]
        if self.head_vocab == "draft":
            # its head over t2d's rows, as ours; without the flag it predicts over the whole
            # verifier vocabulary, as our default head does (speculators' parse_vocab_mappings)
            args += ["--draft-vocab-size", str(self.draft_vocab_size)]
        if self.mask_token_id is not None:
            args += ["--mask-token-id", str(self.mask_token_id)]
        if self.rows_without_states:  # rows extract quarantined have no hs_<i> file
            args += ["--on-missing", "skip"]
        return args

    def command(self) -> str:
        return shlex.join(self.argv())
