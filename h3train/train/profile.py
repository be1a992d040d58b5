"""`debug.profile_steps`: a torch.profiler trace of chosen steps, as a step hook.

Kept apart from the hook interface (`hooks.py`) so that defining a hook does not pull in the
profiler, and the trace reader used by the tests lives next to the writer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .hooks import TrainerHook, TrainerView


class ProfilerHook(TrainerHook):
    """`debug.profile_steps: [first, last]`: a torch.profiler trace of those steps, one file per rank.

    The trace is Chrome/Perfetto JSON at `<logging.dir>/profile/steps_<first>-<last>_rank<r>.json`,
    with each step in a `h3train step N` range, CPU activity always and CUDA kernels on GPUs.
    """

    def __init__(self, first: int, last: int, out_dir: Path, rank: int) -> None:
        self.first, self.last = first, last
        self.path = out_dir / f"steps_{first}-{last}_rank{rank}.json"
        self._profiler: torch.profiler.profile | None = None
        self._range: torch.profiler.record_function | None = None

    def before_step(self, trainer: TrainerView, step: int) -> None:
        if step == self.first or (self._profiler is None and self.first < step <= self.last):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self._profiler.__enter__()
        if self._profiler is not None:
            self._range = torch.profiler.record_function(f"h3train step {step}")
            self._range.__enter__()

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._profiler is not None and step >= self.last:
            self._finish()

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._profiler is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._profiler is not None
        if self.path.exists():
            # A resumed run that profiles the same steps again keeps the first trace.
            self.path = self.path.with_name(f"{self.path.stem}.{_next_free(self.path)}.json")
        self._profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.path))
        self._profiler = None


def _next_free(path: Path) -> int:
    """The first `n` for which `<stem>.<n>.json` does not exist yet, so no trace is overwritten."""
    n = 1
    while path.with_name(f"{path.stem}.{n}.json").exists():
        n += 1
    return n


def trace_step_ranges(path: Path) -> list[str]:
    """Names of the `h3train step N` ranges in a trace written by `ProfilerHook`."""
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("h3train step ")})
