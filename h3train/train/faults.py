"""Fault injection (`debug.fault`), so that every failure path has a test that really takes it.

Each entry is `KIND@STEP[:RANK]` (or `corrupt_sample@ID`). Without a rank, every rank is hit.
`FaultHook` takes the step faults in the loop; the checkpointer's commit and the data source ask
the `FaultInjector` for theirs.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..errors import ConfigError, did_you_mean
from ..parallel.fsdp import local_tensor
from .hooks import MicroBatchEvent, TrainerHook, TrainerView

STEP_KINDS = ("nan_loss", "nan_grad", "kill", "sigterm", "kill_in_save")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None = None
    rank: int | None = None
    sample_id: str | None = None

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)


def parse_faults(entries: list[str]) -> list[Fault]:
    faults = []
    for entry in entries:
        kind, sep, where = entry.partition("@")
        if not sep or not where:
            raise ConfigError(f"config key 'debug.fault' entry '{entry}' is not KIND@STEP[:RANK] or corrupt_sample@ID")
        if kind == "corrupt_sample":
            faults.append(Fault(kind, sample_id=where))
            continue
        if kind not in STEP_KINDS:
            kinds = (*STEP_KINDS, "corrupt_sample")
            raise ConfigError(
                f"config key 'debug.fault' entry '{entry}': unknown kind '{kind}'; use one of "
                f"{', '.join(kinds)}{did_you_mean(kind, kinds)}"
            )
        step, _, rank = where.partition(":")
        try:
            faults.append(Fault(kind, int(step), int(rank) if rank else None))
        except ValueError:
            raise ConfigError(f"config key 'debug.fault' entry '{entry}': STEP and RANK must be integers") from None
    return faults


class FaultInjector:
    def __init__(self, entries: list[str], rank: int) -> None:
        self.faults = parse_faults(entries)
        self.rank = rank

    def active(self, kind: str, step: int) -> bool:
        return any(f.hits(kind, step, self.rank) for f in self.faults)

    def corrupt_samples(self) -> set[str]:
        return {f.sample_id for f in self.faults if f.kind == "corrupt_sample"}

    def maybe_die(self, kind: str, step: int) -> None:
        """`kill` / `kill_in_save`: die at once as a crashed node would; `sigterm`: ask for preemption.

        Only in a job's first attempt: a job that `torchrun --max-restarts` restarted must get past it.
        """
        if self.active(kind, step) and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)


class FaultHook(TrainerHook):
    """The step faults, at the points a real one strikes: `kill` / `sigterm` before the step,
    `nan_loss` on every micro-batch's loss before its backward, `nan_grad` on a gradient after it.

    Runs first among the hooks, so a fault before the step comes before any other hook's work.
    """

    def __init__(self, faults: FaultInjector) -> None:
        self.faults = faults

    def before_step(self, trainer: TrainerView, step: int) -> None:
        self.faults.maybe_die("kill", step)
        self.faults.maybe_die("sigterm", step)

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        if self.faults.active("nan_loss", batch.step):
            batch.loss = batch.loss * float("nan")

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        if self.faults.active("nan_grad", step):
            grad = next(p for p in trainer.model.parameters() if p.grad is not None).grad
            local_tensor(grad).fill_(float("nan"))
