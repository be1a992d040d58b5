"""A training step waits for the device once and adds one small all-reduce to the gradient norm's.

The update decision, the logged sums, the spike check, the data-error count and the stop request
all travel in the step's one all-reduce and come to the host in one copy. On this CPU machine a
device->host sync cannot be observed, so the test counts the calls that would be one on a GPU
(`h3train.tools.host_syncs.SyncCounter`). The GPU check runs the whole step under
`torch.cuda.set_sync_debug_mode("error")` instead.
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from h3train.config import load_config
from h3train.run.assemble import build_trainer
from h3train.tools.host_syncs import SyncCounter

from helpers.launch import tiny_overrides
from helpers.paths import TINY_FL2VA


def _counting_all_reduces(monkeypatch, counts: Counter, active: list[bool]) -> None:
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
    _counting_all_reduces(monkeypatch, counts, active)
    counter = SyncCounter()
    # The whole loop is counted: the steps and whatever runs between them (the stop check too).
    active[0] = counter.active = True
    try:
        trainer.fit()
    finally:
        active[0] = counter.active = False
        counter.restore()
        trainer.close()
    syncs = dict(counter.calls)
    assert sum(syncs.values()) == steps, syncs
    assert counts["all_reduce"] == steps, counts
