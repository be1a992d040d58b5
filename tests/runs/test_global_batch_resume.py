"""A resume on another DP size says, in one `resume:` line, how the global batch changes and what keeps it."""

from __future__ import annotations

import pytest

from helpers.launch import read_metrics, run_forked, tiny_args

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
