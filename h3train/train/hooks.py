"""The trainer's extension points: model transforms, step hooks and what a hook sees of the trainer.

A feature that changes what is trained (adapters, frozen modules) is a **model transform**: a
callable run on the bare `MiniMaxH3Transformer3DModel` after it is built (randomly, from the meta
device, or before pretrained shards are loaded) and before the sequence-parallel wrapper and FSDP2
see it. A transform edits the module in place (adds submodules, sets `requires_grad`); it runs on
every rank and must do the same thing on each (seed any initialisation), because FSDP2 shards what
the transform leaves. Only parameters with `requires_grad` reach the optimizer, the clip and the
logged `grad_norm`. A transform that adds parameters to a model built on the meta device cannot give
them values there; it may also have `after_load(model)`, which the trainer calls on a fresh start
once the sharded model is materialised and holds its pretrained or random base values, before the
optimizer exists (a resume takes every value from the checkpoint instead).

A feature that watches or follows training (evaluation, EMA, profiling) is a **step hook**: a
`TrainerHook` whose methods the loop calls on every rank, in registration order. Hooks may run
collectives, since every rank calls them at the same points. A hook with state to keep across a
resume also implements `state_dict()` / `load_state_dict()` (DCP's `Stateful`) and joins the
checkpoint under its `name` (`run.parts.checkpoint_components`).

A hook may also follow each micro-batch: `on_micro_batch` sees its inputs and loss after the forward
and may replace the loss before the backward (a debug fault), and `after_backward` runs once the
step's gradients have accumulated, before the update reads them (a debug dump, a fault on them).

A hook sees the trainer only as a `TrainerView`: the few attributes and services it may use. The
trainer satisfies the protocol structurally, so no hook imports the trainer's module and a hook can
be driven by any object with the same surface. A hook that offers something back to the trainer
does so by interface too: the EMA hook is an `EvaluationWeights`, which the trainer finds among its
hooks for `TrainerView.evaluation_weights` without knowing the EMA by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ..config import Config

if TYPE_CHECKING:
    from ..model.sp_forward import SequenceParallelH3
    from ..objective import MicroBatch
    from ..packing import Pack
    from ..parallel.dims import ParallelContext
    from ..tasks.sample import TrainingSample


class TrainerView(Protocol):
    """What a step hook may see and do of the trainer; everything else of it is the trainer's own business.

    Kept small so the hooks and the loop can change independently: a hook that needs more asks for a
    new member here rather than reaching into the trainer.
    """

    #: What this rank is doing now; a hook sets it before a collective so a hang or failure names it.
    phase: str

    @property
    def cfg(self) -> Config:
        """The run's resolved config."""

    @property
    def ctx(self) -> ParallelContext:
        """This process's place in the layout: `rank`, `dp_rank`, `sp_rank`, `dims`, `is_main`."""

    @property
    def device(self) -> torch.device:
        """The accelerator (or CPU) this rank computes on."""

    @property
    def model(self) -> SequenceParallelH3:
        """The live sharded model (the sequence-parallel wrapper; `.transformer` is the diffusers model)."""

    @property
    def step(self) -> int:
        """The last optimizer step done (0 before training)."""

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for a non-finite loss or gradient so far."""

    def log_validation(self, step: int, values: Mapping[str, float]) -> None:
        """Log evaluation `values` after step `step` (0: before training) as a validation row."""

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        """Log rendered clips `{id: (mp4 path, caption)}` after step `step`; rank 0 sends them to wandb."""

    def evaluation_weights(self, use_ema: bool) -> AbstractContextManager[None]:
        """The weights to evaluate with for the block: the EMA's when `use_ema`, else the live ones."""

    def wait_staged(self) -> None:
        """Wait until a background checkpoint save has copied the state; call before first writing to it."""


@runtime_checkable
class EvaluationWeights(Protocol):
    """A hook that can put other weights (the EMA's) in the trainable parameters for evaluation.

    `TrainerView.evaluation_weights(use_ema=True)` uses the first hook that has this interface.
    """

    def swapped_in(self) -> AbstractContextManager[None]:
        """The parameters hold the evaluation weights inside the block and their own values after it."""


@dataclass
class MicroBatchEvent:
    """One micro-batch of optimizer step `step` after its forward: what `on_micro_batch` sees.

    `index` counts the step's micro-batches from 0; `sample` is its sample, or a `Pack` of its
    samples (`data.pack`); `inputs` are as the stream gave them, before the forward moved them to the
    device. `loss` is what the backward runs on (the micro-batch's loss, the sum of its samples',
    before the division by the step's samples per rank) and what the step sums; a hook may replace it.
    """

    step: int
    index: int
    sample: TrainingSample | Pack
    inputs: MicroBatch
    loss: torch.Tensor


class TrainerHook:
    """Called by `Trainer.fit` (the micro-batch methods by `Trainer.forward_backward`) on every rank;
    each method does nothing unless overridden."""

    #: Key of this hook's state in the checkpoint, when it has `state_dict` / `load_state_dict`.
    name: str = ""

    def on_attach(self, trainer: TrainerView) -> None:
        """When added to the trainer, before any resume: the model is built, sharded and filled."""

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Before the first step of this process (after any resume: `trainer.step` is the last done)."""

    def before_step(self, trainer: TrainerView, step: int) -> None:
        """Before optimizer step `step` (1-based) starts loading its micro-batches."""

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        """After the forward of each micro-batch, before its backward; may set `batch.loss`."""

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        """After the backward of step `step`'s last micro-batch, before the update reads the gradients."""

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> Mapping[str, float] | None:
        """After step `step` updated (or skipped); returned values join the step's logged metrics."""
        return None

    def on_fit_end(self, trainer: TrainerView) -> None:
        """After the last step of this process, also after a preemption; not after an error, when a
        peer may be gone and a collective would hang."""

    def summary_lines(self) -> list[str]:
        """Lines of the run's closing summary (rank 0, after `on_fit_end`); none by default."""
        return []
