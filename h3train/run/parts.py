"""What a `Trainer` is handed: every part of a run, built, and the one list of what a checkpoint holds.

`assemble.py` builds the parts from a config; a rehearsal builds them on a fake process group
(`run/rehearse/`). `checkpoint_components` names the checkpoint's components for both, so what a
run saves and what a rehearsal plans to save are the same list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..checkpoint import AttributeState, Checkpointer, ModelState, OptimizerState, ScheduleState
from ..config import Config
from ..data.source import SampleSource
from ..data.step_composition import StepStats
from ..debug.faults import FaultInjector
from ..infra.runlock import RunLock
from ..model.adapter import ModelAdapter
from ..model.sp_forward import SequenceParallelH3
from ..objective import MicroBatch
from ..packing import Pack
from ..parallel.dims import ParallelContext
from ..tasks.sample import TrainingSample
from ..train.adapter_files import AdapterFiles
from ..train.events import EventLog, Progress, SpikeDetector
from ..train.guard import ValidationWatch
from ..train.hooks import TrainerHook
from ..train.metrics import MetricsLogger
from ..train.preemption import Preemption
from ..train.reduction import StepReduction, all_reduce_to_host
from .blueprint import Blueprint
from .resume import Resume


class MicroBatches(Protocol):
    """The step's micro-batches (`data.source.MicroBatchStream`): `next(step, slot)` is micro-batch `slot`
    of optimizer step `step` as (packed sample or pack, its inputs on the host); its position is checkpointed."""

    def next(self, step: int, slot: int) -> tuple[TrainingSample | Pack, MicroBatch]: ...

    def step_stats(self) -> StepStats:
        """The current step's plan: its samples over all DP ranks (the loss is their mean), its packs' fill
        and its ranks' imbalance."""
        ...

    def close(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingParts:
    """Everything a `Trainer` runs, built and placed on the device.

    `model` is sharded (FSDP2) and holds its start values (pretrained, seeded, or to be restored by
    `resume`); `adapter` is the transform that owns what checkpoints of an adapted model record
    (None in full fine-tuning); `batches` yields the micro-batches of `source` (None where no dataset
    is read: a rehearsal); `data_errors` and `spike_log` are this rank's event logs (written by SP
    rank 0 of each group only), `progress` the step counters they and the trainer share; `spikes`
    flags the losses `spike_log` records; `watch` judges the validation rows (`checkpoint.keep_best`,
    `validation.guard`); `preemption` turns the stop signals into the flag the step agrees on;
    `checkpointer` writes `checkpoint_state` (`checkpoint_components`), rank 0 keeping the best
    checkpoint and writing `adapter_files` into each (`checkpoint.export`); `metrics` the logger
    `Trainer.fit` opens at the step it starts from; `reduction` the step's one all-reduce;
    `resume` the resume decision, whose `restore` `build_trainer` runs once the hooks are attached
    (None: a fresh start with nothing to restore); `lock` the run folders' lock (rank 0; `close`
    releases it).
    """

    blueprint: Blueprint
    ctx: ParallelContext
    log_dir: Path
    model: SequenceParallelH3
    model_config: dict[str, Any]
    adapter: ModelAdapter | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    source: SampleSource | None
    batches: MicroBatches
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None
    hooks: list[TrainerHook]
    checkpointer: Checkpointer
    faults: FaultInjector
    data_errors: EventLog
    spike_log: EventLog
    progress: Progress
    spikes: SpikeDetector
    watch: ValidationWatch
    preemption: Preemption
    metrics: MetricsLogger | None
    adapter_files: AdapterFiles | None = None
    resume: Resume | None = None
    reduction: StepReduction = all_reduce_to_host
    lock: RunLock | None = None
    checkpoint_state: dict[str, Stateful] = field(init=False)

    def __post_init__(self) -> None:
        self.checkpoint_state = checkpoint_components(self)

    @property
    def cfg(self) -> Config:
        """The run's config, as the start decided it (`Blueprint.cfg`)."""
        return self.blueprint.cfg

    @property
    def configured_tables(self) -> str | bool:
        """`parallel.adaln_tables` as the config gave it (`auto`), which `config.yaml` and checkpoints record."""
        return self.blueprint.configured_tables

    @property
    def event_logs(self) -> list[Path | None]:
        """The event logs' files (None: this rank writes none), whose later lines a resume sets aside."""
        return [self.data_errors.path, self.spike_log.path]

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint the run resumed from (None: a fresh start)."""
        return self.resume.path if self.resume is not None else None


def checkpoint_components(parts: TrainingParts) -> dict[str, Stateful]:
    """Everything a checkpoint of `parts` holds, by name, in the order a resume loads them.

    The optimizer after the model, the schedule after the optimizer (it sets the learning rate of
    each group); then the sampler's position, the step counters, the best validation value
    (`checkpoint.keep_best`) and each hook with state under its `name` (the EMA's `ema`).
    """
    trainable_only = parts.adapter is not None and parts.adapter.trainable_only
    state: dict[str, Stateful] = {
        "model": ModelState(parts.model, trainable_only=trainable_only),
        "optim": OptimizerState(parts.model, parts.optimizer),
        "schedule": ScheduleState(parts.scheduler),
        "sampler": parts.batches,
        "progress": AttributeState(parts.progress, ("step", "skipped_steps")),
    }
    if parts.watch.metric is not None:
        state["best"] = parts.watch
    for hook in parts.hooks:
        if callable(getattr(hook, "state_dict", None)) and callable(getattr(hook, "load_state_dict", None)):
            if not hook.name or hook.name in state:
                raise ValueError(f"a stateful hook needs a unique name for the checkpoint, got {hook.name!r}")
            state[hook.name] = hook
    return state
