"""A packed run's samples per step as the user reads them: the `resume:` line of a changed global batch, and
loss spikes sample by sample."""

from __future__ import annotations

import json

import pytest

from h3train.data.trained_samples import trained_samples

from helpers.launch import read_metrics, run_forked, tiny_args, train

pytestmark = pytest.mark.slow

PACKED = ["data.pack=400", "data.balance=true", "train.grad_accum=2", "checkpoint.every=2", "checkpoint.keep_last=0"]


def test_resuming_a_packed_dp2_run_at_dp4_names_the_global_batch_change(tmp_path) -> None:
    run_forked(tiny_args(tmp_path, *PACKED, "train.steps=2"), nproc=2)
    before = read_metrics(tmp_path)
    resumed = run_forked(tiny_args(tmp_path, *PACKED, "train.steps=3"), nproc=4).stdout
    lines = [ln for ln in resumed.splitlines() if ln.startswith("resume: the global batch")]
    assert lines == [
        "resume: the global batch changes: dp 2 x train.grad_accum 2 packs of up to 400 rows per step -> "
        "dp 4 x train.grad_accum 2 packs of up to 400 rows per step; train.grad_accum=1 keeps it "
        "(since step_00000002)"
    ], resumed
    rows = read_metrics(tmp_path)
    # The packs are twice as many: the step after the resume trains more samples than each before it.
    assert rows[-1]["step"] == 3 and rows[-1]["samples"] > max(r["samples"] for r in before)


def test_loss_spikes_are_looked_for_sample_by_sample_in_a_pack(tmp_path) -> None:
    """A pack's mean would hide one sample's spike: each record names one sample and its own loss."""
    # A factor far below 1 makes every sample a spike once five steps give a median.
    train(tiny_args(tmp_path, "data.pack=400", "train.steps=6", "train.spike_factor=0.001", "logging.sample_ids=true"))
    records = [json.loads(line) for line in (tmp_path / "loss_spikes.jsonl").read_text().splitlines()]
    trained = trained_samples(tmp_path)
    assert {r["step"] for r in records} == {6}
    assert sorted(r["sample_id"] for r in records) == sorted(trained[6])
    assert all("+" not in r["sample_id"] for r in records) and len(records) > 2
    # Each sample's own loss: they differ, and their mean is the step's loss.
    losses = [r["loss"] for r in records]
    assert len(set(losses)) == len(losses)
    assert sum(losses) / len(losses) == pytest.approx(read_metrics(tmp_path)[-1]["loss"], rel=1e-5)
