"""`logging.sample_ids`: which samples every micro-batch trained, for auditing a run's data order.

SP rank 0 of each DP group appends one JSON line per micro-batch to
`<logging.dir>/trained_samples/dp<R>.jsonl`: `{"step", "micro", "samples": [ids]}` (a pack's members
in pack order). A resumed run appends to the same files, so steps trained after the last checkpoint
of an earlier run appear again, as trained again. Each DP group writes its own file: no two
processes append to one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from ..packing import members
from .hooks import MicroBatchEvent, TrainerHook, TrainerView


class TrainedSamples(TrainerHook):
    """Appends each micro-batch's sample ids to this DP group's file (module docstring)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.folder = Path(log_dir) / "trained_samples"
        self._file: IO[str] | None = None

    def on_attach(self, trainer: TrainerView) -> None:
        ctx = trainer.ctx
        if ctx.sp_rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._file = open(self.folder / f"dp{ctx.dp_rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        if self._file is not None:
            ids = [s.sample_id for s in members(batch.sample)]
            self._file.write(json.dumps({"step": batch.step, "micro": batch.index, "samples": ids}) + "\n")

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        if self._file is not None:
            self._file.flush()

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
