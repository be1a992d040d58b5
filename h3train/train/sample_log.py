"""`logging.sample_ids`: the hook that records which samples every step trained.

SP rank 0 of each DP group writes its group's records, rank 0 the attempts; the files, the
supersession of the steps a resume redoes and the reader are `data/trained_samples.py`'s.

The attempt number is agreed by one broadcast from rank 0 at the start of training (`on_fit_start`,
which every rank calls at the same point): nothing the ranks share without talking (the config, the
resumed step, the launcher's environment) tells two starts from the same checkpoint apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from ..data.step_composition import batch_layout
from ..data.trained_samples import ATTEMPTS_FILE, FOLDER, begin_attempt, end_torn_line
from ..errors import TrainingError
from ..packing import members
from .hooks import MicroBatchEvent, TrainerHook, TrainerView


class TrainedSamples(TrainerHook):
    """Records each step's sample ids in this DP group's file under this start's attempt (module docstring)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.folder = Path(log_dir) / FOLDER
        self.attempt: int | None = None
        self._file: IO[str] | None = None
        self._pending: list[str] = []

    def on_fit_start(self, trainer: TrainerView) -> None:
        ctx = trainer.ctx
        # Rank 0 writes the attempt's line before anyone writes a record of it, then tells the others.
        outcome: list[Any] = [None]
        if ctx.is_main:
            try:
                outcome[0] = (begin_attempt(self.folder, trainer.step, run_layout(trainer)), None)
            except OSError as exc:
                outcome[0] = (None, f"cannot write '{self.folder / ATTEMPTS_FILE}' ({exc.strerror or exc})")
        if dist.is_initialized() and dist.get_world_size() > 1:
            trainer.phase = "agreeing on the trained-samples attempt"
            dist.broadcast_object_list(outcome, src=0)
        attempt, problem = outcome[0]
        if problem is not None:
            error = TrainingError(f"config key 'logging.sample_ids': {problem}")
            error.agreed = True
            raise error
        self.attempt = attempt
        if ctx.sp_rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"dp{ctx.dp_rank}.jsonl"
            end_torn_line(path)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        if self._file is not None:
            ids = [s.sample_id for s in members(batch.sample)]
            record = {
                "attempt": self.attempt,
                "step": batch.step,
                "micro": batch.index,
                "dp_rank": trainer.ctx.dp_rank,
                "samples": ids,
            }
            self._pending.append(json.dumps(record) + "\n")

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        if self._file is not None:
            # One write per step: a crash mid-step leaves none of the step's lines.
            self._file.write("".join(self._pending))
            self._file.flush()
            self._pending.clear()

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def run_layout(trainer: TrainerView) -> dict[str, Any]:
    """What decides how a step's samples are split over ranks and micro-batches (`attempts.jsonl`'s `layout`)."""
    cfg, dims = trainer.cfg, trainer.ctx.dims
    batch = batch_layout(dims.dp, cfg.train.grad_accum, cfg.data.pack, cfg.train.global_batch)
    return {**batch, "sp": dims.sp, "dp_replicate": dims.dp_replicate, "balance": cfg.data.balance}
