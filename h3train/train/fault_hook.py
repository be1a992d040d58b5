"""The step faults of `debug.fault` in the loop (`debug/faults.py` parses them and holds the rest)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..debug.faults import FaultInjector
from ..parallel.shards import local_tensor
from .hooks import MicroBatchEvent, TrainerHook, TrainerView


class FaultHook(TrainerHook):
    """The step faults, at the points a real one strikes: `kill` / `sigterm` / `sigint` before the step,
    `nan_loss` on every micro-batch's loss before its backward, `nan_grad` on a gradient after it.
    `sigterm_after_step` asks for preemption after the step's all-reduce, while the step validates,
    renders and saves. `rank_branch` is the bug class a distributed step must never have: the rank it
    names runs one more forward (no gradient) than its peers, whose all-gathers its peers skip; the
    process groups' collective checks must catch it.

    Runs first among the hooks, so a fault before the step comes before any other hook's work.
    """

    def __init__(self, faults: FaultInjector) -> None:
        self.faults = faults

    def before_step(self, trainer: TrainerView, step: int) -> None:
        self.faults.maybe_die("kill", step)
        self.faults.maybe_die("sigterm", step)
        self.faults.maybe_die("sigint", step)

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        if self.faults.active("nan_loss", batch.step):
            batch.loss = batch.loss * float("nan")
        if self.faults.active("rank_branch", batch.step):
            with torch.no_grad():
                trainer.model(**batch.inputs.to(trainer.device).forward_kwargs())

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        self.faults.maybe_die("sigterm_after_step", step)

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        if self.faults.active("nan_grad", step):
            grad = next(p for p in trainer.model.parameters() if p.grad is not None).grad
            local_tensor(grad).fill_(float("nan"))
