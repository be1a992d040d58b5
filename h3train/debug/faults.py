"""Fault injection (`debug.fault`), so that every failure path has a test that really takes it.

Each entry is `KIND@STEP[:RANK]` (or `corrupt_sample@ID`). Without a rank, every rank is hit. The
loop's `train/faults.FaultHook` takes the step faults; the checkpointer's commit and writes ask the
`FaultInjector` for theirs, and the data source `corrupt_samples` for its.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError, did_you_mean

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


def corrupt_samples(entries: list[str]) -> set[str]:
    """The sample ids `corrupt_sample@ID` entries name: the data source reads them as damaged."""
    return {f.sample_id for f in parse_faults(entries) if f.kind == "corrupt_sample"}


class FaultInjector:
    """The faults of one rank. `keypress_gap_s`: how far apart two presses of Ctrl-C must be for the
    run to see two (the loop's rule, `train/preemption.SAME_KEYPRESS_S`), so `sigint_in_save`'s
    second press is a person's."""

    def __init__(self, entries: list[str], rank: int, keypress_gap_s: float) -> None:
        self.faults = parse_faults(entries)
        self.rank = rank
        self.keypress_gap_s = keypress_gap_s

    def active(self, kind: str, step: int) -> bool:
        return any(f.hits(kind, step, self.rank) for f in self.faults)

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
            # A person's second press, not the first one delivered again.
            time.sleep(self.keypress_gap_s)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(SLOW_DISK_S)

        return press_ctrl_c
