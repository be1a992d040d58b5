"""Micro-batch hooks: a hook sees every micro-batch after its forward and the gradients after the
backward; the debug hooks (faults, the step dump) come first whatever hooks a caller gives."""

from __future__ import annotations

import json
import math

from h3train.config import load_config
from h3train.run.assemble import build_trainer
from h3train.train.dump import StepDump
from h3train.train.fault_hook import FaultHook
from h3train.train.hooks import MicroBatchEvent, TrainerHook, TrainerView

from helpers.paths import TINY_FL2VA


class MicroBatches(TrainerHook):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        self.calls.append(("micro", batch.step, batch.index, batch.sample.sample_id, math.isfinite(batch.loss.item())))

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        self.calls.append(("backward", step, bool(grads)))


def test_micro_batch_hooks_see_each_micro_batch_and_the_faults_before_them(tmp_path) -> None:
    overrides = [
        f"logging.dir={tmp_path}",
        "train.steps=2",
        "train.grad_accum=2",
        "logging.progress=false",
        "checkpoint.every=0",
        "debug.fault=[nan_loss@2]",
        "debug.dump_step=1",
    ]
    hook = MicroBatches()
    trainer = build_trainer(load_config(TINY_FL2VA, overrides), hooks=[hook])
    try:
        assert [type(h) for h in trainer.parts.hooks] == [FaultHook, StepDump, MicroBatches]
        trainer.fit()
    finally:
        trainer.close()
    assert [c[:3] for c in hook.calls] == [
        ("micro", 1, 0),
        ("micro", 1, 1),
        ("backward", 1, True),
        ("micro", 2, 0),
        ("micro", 2, 1),
        ("backward", 2, True),
    ]
    # The fault hook ran first: the later hook saw the poisoned loss of step 2 only.
    assert [c[4] for c in hook.calls if c[0] == "micro"] == [True, True, False, False]
    meta = json.loads((tmp_path / "dump" / "step_1" / "meta.json").read_text())
    assert meta["num_micro_batches"] == 2 and not (tmp_path / "dump" / "step_2").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 1]
