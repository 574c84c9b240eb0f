"""What training reads of the train stage's settings.

A protocol, not the settings class itself: the stage owns its settings (TOML, CLI, help), and
the code here must not import the stage it serves."""

from __future__ import annotations

from typing import Protocol


class TrainingSettings(Protocol):
    """The train settings the trainer, its loop and its checkpoints read."""

    target: str
    layers: str
    draft_layers: int
    block_size: int
    steps: int
    lr: float
    batch_rows: int
    anchors_per_row: int
    gamma: float
    grad_clip: float
    weight_decay: float
    seed: int
    mask_token_id: int
    eval_every: int
    save_every: int
    keep_checkpoints: int
    dtype: str
    device: str
    device_map: str
    max_memory: str
    labels: str
    arch: str
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    selector_loss_alpha: float

    @property
    def warmup(self) -> int: ...
