"""SIGTERM / SIGUSR1 (Slurm's warning before a time limit) / SIGINT (Ctrl-C) -> finish the step, save, stop.

The handler only sets a flag; at the end of each step the ranks agree on it inside the step's one
all-reduce (`reduction.StepReduction`), so every rank saves the same step even if the signal reached
only some of them.
The agreed value says which kind of signal arrived: an interrupt (SIGINT) outranks a preemption,
and a run stopped by one exits 130 (as an interrupted program does), one stopped by a preemption
signal exits 0 (its job is to be requeued and resumed).

Under torchrun one Ctrl-C reaches a worker twice: from the terminal, which signals its whole
foreground process group, and from torchrun, which forwards the SIGINT it got to each worker. A
SIGINT within `SAME_KEYPRESS_S` of the first is that same keypress and is ignored; torchrun gives its
workers `--shutdown_timeout` seconds (30 by default) to finish the step and the save before it kills
them.

A second Ctrl-C while the first is being honoured restores the default handler's behaviour: it
raises `KeyboardInterrupt` at once, for a user who would rather lose the step than wait for it, and
is noted in the process's interrupt record (`events.INTERRUPTS`, which the CLI reads): DCP turns an
interrupt inside a save into a `CheckpointException`, which is the interrupt all the same.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from .events import INTERRUPTS, Interrupts

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Agreed across ranks with a MAX all-reduce, so the higher code wins.
NONE, PREEMPT, INTERRUPT = 0, 1, 2


def agreed_stop(preempting: float, interrupting: float) -> int:
    """The stop the ranks agree on from how many asked for each: `INTERRUPT` over `PREEMPT` over `NONE`."""
    return INTERRUPT if interrupting > 0 else PREEMPT if preempting > 0 else NONE


# A SIGINT this soon after the first is the same Ctrl-C delivered twice (terminal and launcher); a
# person's second press comes later.
SAME_KEYPRESS_S = 0.5


class Preemption:
    def __init__(self, interrupts: Interrupts = INTERRUPTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.flag = NONE
        self.signal: int | None = None
        self.clock = clock
        # When the first SIGINT was handled (None: none yet).
        self._first_interrupt: float | None = None
        # Told of a second Ctrl-C: whatever the run raises from then on is that interrupt.
        self.interrupts = interrupts
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if signum == signal.SIGINT:
            if self.flag == INTERRUPT:
                assert self._first_interrupt is not None
                if self.clock() - self._first_interrupt < SAME_KEYPRESS_S:
                    return
                self.interrupts.note()
                raise KeyboardInterrupt
            self._first_interrupt = self.clock()
            if os.environ.get("RANK", "0") == "0":
                print(
                    "interrupt: saving a checkpoint after this step (Ctrl-C again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )
            self.flag = INTERRUPT
        else:
            self.flag = max(self.flag, PREEMPT)
        self.signal = self.signal or signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
