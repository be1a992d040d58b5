"""A training step waits for the device once and adds one small all-reduce to the gradient norm's.

The update decision, the logged sums, the spike check, the data-error count and the stop request
all travel in the step's one all-reduce and come to the host in one copy. On this CPU machine a
device->host sync cannot be observed, so the test counts the calls that would be one on a GPU
(`item`, `tolist`, `cpu`, `float()`, `bool()`, `int()` of a tensor) made by the step's own code: the
trainer, the objective's loss, the SP forward and the preemption flag. The GPU check runs the whole
step under `torch.cuda.set_sync_debug_mode("error")` instead.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from h3train.config import load_config
from h3train.train.assemble import build_trainer

from reference import TINY_FL2VA, tiny_overrides

SYNC_METHODS = ("item", "tolist", "cpu", "__float__", "__bool__", "__int__")
# Modules whose code runs inside a step (data preparation on host tensors is not a device sync).
STEP_CODE = ("train/trainer.py", "train/preemption.py", "model/sp_forward.py", "parallel/ulysses.py")
STEP_FUNCTIONS = ("compute_loss", "masked_mse", "guided_mse")


def _counting(monkeypatch, counts: Counter, active: list[bool]) -> None:
    main = threading.main_thread()

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            in_step = caller.co_filename.endswith(STEP_CODE) or caller.co_name in STEP_FUNCTIONS
            if active[0] and threading.current_thread() is main and in_step:
                counts[f"sync {name} in {Path(caller.co_filename).name}:{caller.co_name}"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    original_all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        if active[0]:
            counts["all_reduce"] += 1
        return original_all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def test_one_host_sync_and_one_all_reduce_per_step(tmp_path, monkeypatch) -> None:
    # Spike detection on, CFG on, two micro-batches: every per-micro-batch path is taken.
    steps = 3
    overrides = tiny_overrides(tmp_path, f"train.steps={steps}", "checkpoint.every=0", "train.spike_factor=2.0")
    cfg = load_config(TINY_FL2VA, [*overrides, "cfg.scale=2.0"])
    trainer = build_trainer(cfg, hooks=[])
    counts: Counter = Counter()
    active = [False]
    _counting(monkeypatch, counts, active)
    # The whole loop is counted: the steps and whatever runs between them (the stop check too).
    active[0] = True
    try:
        trainer.fit()
    finally:
        active[0] = False
        trainer.close()
    syncs = {k: v for k, v in counts.items() if k.startswith("sync")}
    assert sum(syncs.values()) == steps, syncs
    assert counts["all_reduce"] == steps, counts
