"""SIGTERM / SIGUSR1 (Slurm's warning before a time limit) -> finish the step, save, exit 0.

The handler only sets a flag; at the end of each step the ranks agree on it with one all-reduce of
a single integer, so every rank saves the same step even if the signal reached only some of them.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self) -> None:
        self.flag = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.flag = True

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self, device: torch.device) -> bool:
        """True on every rank once any rank has received a preemption signal."""
        flag = torch.tensor([int(self.flag)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
