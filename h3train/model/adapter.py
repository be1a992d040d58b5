"""The interface of a model adapter: a transform that adds parameters of its own (LoRA and kin).

An adapter is one class (`lora.adapters.LoraTransform`, for every peft kind h3train trains) that is both a model
transform (`ModelTransform`: it edits the bare transformer before sharding) and a
`ModelAdapter`: it owns what checkpoints of the adapted model are and what it adds to the memory
plan. The build, the trainer, resume and the planner ask it; none of them branches on the kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from diffusers import MiniMaxH3Transformer3DModel
from torch import nn

from ..config import Config

ModelTransform = Callable[[MiniMaxH3Transformer3DModel, Config], None]
"""`transform(transformer, cfg)`: edit the unsharded transformer in place before sharding."""


@dataclass(frozen=True)
class AdapterCounts:
    """What an adapter adds, as the memory plan (`h3train/plan/`) counts it: what trains, what stays float32.

    `rank`: the adapters' configured rank (`lora.rank`). For a plain LoRA it is also the values each
    adapted layer keeps per row for its backward (its rank-r lora_A output); `block_row_values` counts
    those for any kind.
    """

    rank: int
    adapted_layers: int
    # The adapter's parameters (LoRA: lora_A + lora_B; DoRA adds a magnitude per output; LoKr, LoHa their
    # factors) and fully trained `lora.train_modules` ones, whole model.
    adapters: int
    train_modules: int
    # Frozen parameters in the float32 islands (`_keep_in_fp32_modules`).
    frozen_fp32: int
    # Within one transformer block (the FSDP unit): adapter parameters, trainable parameters, adapted Linears.
    block_adapters: int
    block_trainable: int
    block_adapted_layers: int
    # Within one block, what its adapted layers keep for the backward beyond the base's activations, in
    # compute-dtype values: per row of the sequence (LoRA: rank per layer; DoRA: rank + 2 x out per layer),
    # and per forward whatever the rows (LoKr, LoHa: each layer's materialised out x in delta weight).
    block_row_values: int
    block_delta_values: int
    # Every trainable parameter sits in the output projections (`proj_out`, `audio_proj_out`), which read
    # the stack's normalised output: no gradient reaches the blocks, the refiner or `norm_out`, so none
    # of them keeps anything for the backward. What the projections' adapters keep beyond their input, per
    # row and per forward, as `block_row_values` / `block_delta_values` count it (float32 islands), and
    # the widest trained projection's output (what the loss keeps per predicted row).
    heads_only: bool = False
    head_row_values: int = 0
    head_delta_values: int = 0
    head_output_values: int = 0
    # What the printout calls the adapters: `LoRA`, `DoRA`, `LoKr` or `LoHa`.
    kind: str = "LoRA"

    @property
    def trainable(self) -> int:
        return self.adapters + self.train_modules


@runtime_checkable
class ModelAdapter(Protocol):
    """A model transform that adds its own parameters (LoRA: `lora.adapters.LoraTransform`).

    It owns what checkpoints of the adapted model are: whether they hold the trainable state only
    (the frozen base is then rebuilt as on a fresh start), what `trainer_state.json` records about
    the adapter, which checkpoints a resume may continue, and what it adds to the memory plan. The
    trainer, resume, the build and the planner ask it, so a new adapter kind is a new class, not a branch.
    """

    trainable_only: bool

    def checkpoint_info(self, model: nn.Module) -> dict[str, Any]:
        """The adapter's entries of `trainer_state.json` (its config, its base)."""
        ...

    def check_checkpoint(self, saved: dict[str, Any], path: Path) -> None:
        """Raise `CheckpointError` when the trainer state `saved` of `path` does not fit this adapter."""
        ...

    def plan_counts(self, dims: dict[str, Any]) -> AdapterCounts:
        """What the adapter adds to the architecture `dims`, as the memory plan counts it."""
        ...
