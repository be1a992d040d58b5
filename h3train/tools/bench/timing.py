"""Timing a trainer step half by half on one clock, and where a step made a host-device sync."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..host_syncs import cuda_syncs, is_sync


@dataclass
class SyncError:
    """Where the step made a host-device sync: the phase and the innermost Python frames."""

    phase: str
    message: str
    frames: list[str]


class Clock:
    """Marks on the device's timeline, read once at the end: the one timer of every figure here.

    On CUDA a mark is an event recorded on the current stream: marking makes the host wait for
    nothing, so marks may sit inside the sync check, and the intervals are the device's time. On the
    CPU a mark is `time.perf_counter()`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (on CUDA after waiting for the device); the marks are cleared."""
        marks, self._marks = self._marks, []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


@dataclass
class TimedStep:
    """One step as `timed_step` ran it: the trainer's logged values (None when a sync stopped it),
    each half's seconds, the sync found, and how many syncs `update` made (None when unchecked)."""

    stats: dict[str, float] | None
    forward_backward_s: float
    update_s: float
    sync: SyncError | None = None
    read_back_syncs: int | None = None


def _sync_frames(exc: BaseException) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]


def timed_step(trainer: Any, step: int, clock: Clock, sync_check: bool) -> TimedStep:
    """`trainer.forward_backward(step)`, then `trainer.update(step, ...)`, each half timed on `clock`.

    With `sync_check` (CUDA) the step runs under `torch.cuda.set_sync_debug_mode("error")`: a sync
    in `forward_backward` raises and comes back as `sync` (phase and frames; no stats, no times).
    `update`, which holds the step's one designed device->host copy, runs under "warn" with its
    syncs counted: more than one comes back as `sync`, with the times (a warning stops nothing).
    """
    previous = torch.cuda.get_sync_debug_mode() if sync_check else None
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    sync = None
    try:
        clock.mark()
        grads = trainer.forward_backward(step)
        clock.mark()
        with cuda_syncs(sync_check) as syncs:
            stats = trainer.update(step, grads)
        clock.mark()
    except RuntimeError as exc:
        if not is_sync(exc):
            raise
        # Only strings leave this block: the traceback holds the step's frames and with them its
        # activations, which must be freed before the next step runs.
        sync = SyncError(str(trainer.phase), str(exc).strip().splitlines()[0], _sync_frames(exc))
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode(previous)
    if sync is not None:
        clock.intervals()
        return TimedStep(None, 0.0, 0.0, sync)
    forward_backward_s, update_s = clock.intervals()
    timed = TimedStep(stats, forward_backward_s, update_s, read_back_syncs=len(syncs) if sync_check else None)
    if len(syncs) > 1:
        timed.sync = SyncError(
            f"update of step {step}",
            f"{len(syncs)} host-device syncs where the step's one read-back is designed",
            syncs,
        )
    return timed
