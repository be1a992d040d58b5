"""Fault injection (`debug.fault`), so that every failure path has a test that really takes it.

Each entry is `KIND@STEP[:RANK]` (or `corrupt_sample@ID`). Without a rank, every rank is hit.
`FaultHook` takes the step faults in the loop; the checkpointer's commit and writes and the data
source ask the `FaultInjector` for theirs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError, did_you_mean
from ..parallel.fsdp import local_tensor
from .hooks import MicroBatchEvent, TrainerHook, TrainerView
from .preemption import SAME_KEYPRESS_S

STEP_KINDS = (
    "nan_loss",
    "nan_grad",
    "kill",
    "sigterm",
    "sigint",
    "kill_in_save",
    "sigint_in_save",
    "rank_branch",
    "sigterm_after_step",
)
# How long `sigint_in_save` then holds the write of the shards: far longer than a run takes to stop,
# so a checkpoint that gets committed all the same was not stopped; a run that does not stop still ends.
SLOW_DISK_S = 60.0


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

    def _strikes(self, kind: str, step: int) -> bool:
        """Only in a job's first attempt: a job that `torchrun --max-restarts` restarted must get past it."""
        return self.active(kind, step) and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def maybe_die(self, kind: str, step: int) -> None:
        """`kill` / `kill_in_save`: die at once as a crashed node would; `sigterm` / `sigterm_after_step`:
        ask for preemption; `sigint`: press Ctrl-C."""
        if self._strikes(kind, step):
            sent = {"sigterm": signal.SIGTERM, "sigterm_after_step": signal.SIGTERM, "sigint": signal.SIGINT}.get(
                kind, signal.SIGKILL
            )
            os.kill(os.getpid(), sent)

    def before_write(self, step: int) -> Callable[[], None] | None:
        """What runs inside DCP's save of `step`, on the thread that writes, before the shards are written.

        `sigint_in_save`: Ctrl-C pressed there (the signal goes to the main thread, where Python runs
        its handler), then a disk too slow to finish the write before the run has stopped.
        """
        if not self._strikes("sigint_in_save", step):
            return None

        def press_ctrl_c() -> None:
            # A person's second press, not the first one delivered again (`preemption.SAME_KEYPRESS_S`).
            time.sleep(SAME_KEYPRESS_S)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(SLOW_DISK_S)

        return press_ctrl_c


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
                trainer.model(**batch.inputs.to(trainer.device).model_inputs)

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        self.faults.maybe_die("sigterm_after_step", step)

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        if self.faults.active("nan_grad", step):
            grad = next(p for p in trainer.model.parameters() if p.grad is not None).grad
            local_tensor(grad).fill_(float("nan"))
