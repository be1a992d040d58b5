"""Append-only JSONL logs of events worth finding later (skipped data, loss spikes), and the record of a
Ctrl-C that interrupted the process at once."""

from __future__ import annotations

import json
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path


class Interrupts:
    """Whether a Ctrl-C interrupted this process at once, in one record for whichever handler holds SIGINT:
    the CLI's outside training, `Preemption`'s (a second Ctrl-C) inside it.

    A library may turn the interrupt into another error (DCP a `CheckpointException` inside a save;
    torch a `ValueError` while building a tensor from a buffer), so an error that follows one is the
    interrupt all the same (`caused`).
    """

    def __init__(self) -> None:
        self.noted = False

    def note(self) -> None:
        """A Ctrl-C is raising `KeyboardInterrupt` now."""
        self.noted = True

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc` is an interrupt, or an error raised after one (the interrupt, disguised; DCP's
        `CheckpointException` is a `BaseException`), though not an exit."""
        return isinstance(exc, KeyboardInterrupt) or (self.noted and not isinstance(exc, (SystemExit, GeneratorExit)))


# The process's one record: the CLI reads it, every SIGINT handler that raises writes it.
INTERRUPTS = Interrupts()


class EventLog:
    """Thread-safe JSONL appender (the prefetch thread reports skipped samples); inactive when `path` is None."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.count = 0
        self._lock = threading.Lock()

    def write(self, **record) -> None:
        with self._lock:
            self.count += 1
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:
                # A file object's error names no file; a full disk must say which one.
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc


class SpikeDetector:
    """Flags a loss above `factor` x the running median of the last `window` step losses."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.history: deque[float] = deque(maxlen=window)

    def median(self) -> float | None:
        # A handful of steps gives no stable median yet.
        return statistics.median(self.history) if len(self.history) >= 5 else None

    def is_spike(self, loss: float) -> bool:
        median = self.median()
        return self.factor > 0 and median is not None and loss > self.factor * median

    def update(self, step_loss: float) -> None:
        self.history.append(step_loss)


@dataclass
class Progress:
    """The run's position: optimizer steps done (`step`) and how many of them were skipped.

    Shared by the trainer, which advances it, and the data-error log, which records the step being
    trained when a sample was skipped; a checkpoint holds it.
    """

    step: int = 0
    skipped_steps: int = 0
