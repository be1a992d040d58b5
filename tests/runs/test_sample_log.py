"""The trained-samples log (`logging.sample_ids`) across crashes and resumes, on the same and other layouts.

Real runs (module-scoped, each launched once): one trained straight through, one killed before a step
past its last checkpoint and resumed, and one on two DP ranks killed alike and resumed on one. The
reader must give each step exactly the samples the straight run trained, the repeated steps' earlier
records superseded. The supersession rules themselves are also checked on written files, where the
superseded records name other samples than the ones that replace them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from h3train.data.trained_samples import attempts, begin_attempt, trained_samples
from h3train.train.hooks import MicroBatchEvent
from h3train.train.sample_log import TrainedSamples

from helpers.launch import read_metrics, run_forked, tiny_args

STEPS = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0", "logging.sample_ids=true"]
# The global batch of two DP ranks of one micro-batch, on one rank: two micro-batches.
DP2 = ("parallel.dp_shard=2", "train.grad_accum=1")
DP1 = ("train.grad_accum=2",)
# Dies before step 4: step 3 is recorded and past the last checkpoint (step 2), so the resume redoes it.
KILL = "debug.fault=[kill@4]"


def _launch(log_dir: Path, *overrides: str, nproc: int = 1, killed: bool = False) -> None:
    proc = run_forked(tiny_args(log_dir, *STEPS, *overrides), nproc=nproc, check=not killed)
    if killed:
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert [m["step"] for m in read_metrics(log_dir)] == [1, 2, 3]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("sample_log")
    straight, resumed, relaid = root / "straight", root / "resumed", root / "relaid"
    _launch(straight, *DP1)
    _launch(resumed, *DP1, KILL, killed=True)
    _launch(resumed, *DP1)
    _launch(relaid, *DP2, KILL, nproc=2, killed=True)
    _launch(relaid, *DP1)
    return SimpleNamespace(straight=straight, resumed=resumed, relaid=relaid)


def test_a_straight_run_is_one_attempt(runs) -> None:
    steps = trained_samples(runs.straight)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(len(ids) == 2 for ids in steps.values())
    # Eight distinct samples of the 32: within an epoch none repeats.
    assert len({i for ids in steps.values() for i in ids}) == 8
    (only,) = attempts(runs.straight)
    assert only["attempt"] == 1 and only["started_at_step"] == 0 and only["supersedes"] == []
    assert only["layout"]["dp"] == 1 and only["layout"]["grad_accum"] == 2


def test_a_resumed_run_reads_as_the_straight_run(runs) -> None:
    assert trained_samples(runs.resumed) == trained_samples(runs.straight)
    first, second = attempts(runs.resumed)
    assert first["attempt"] == 1 and first["started_at_step"] == 0
    assert second == {**second, "attempt": 2, "started_at_step": 2, "previous_last_step": 3, "supersedes": [1]}
    # The file holds step 3 twice, once per attempt; only the second counts.
    records = _records(runs.resumed / "trained_samples" / "dp0.jsonl")
    assert sorted((r["attempt"], r["micro"]) for r in records if r["step"] == 3) == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_a_resume_on_fewer_dp_ranks_drops_the_dead_ranks_repeated_steps(runs) -> None:
    folder = runs.relaid / "trained_samples"
    dead = _records(folder / "dp1.jsonl")
    # Rank 1 of the first attempt recorded step 3, which the resume on one rank trained again.
    assert [(r["attempt"], r["step"], r["dp_rank"]) for r in dead] == [(1, 1, 1), (1, 2, 1), (1, 3, 1)]
    assert trained_samples(runs.relaid) == trained_samples(runs.straight)
    first, second = attempts(runs.relaid)
    assert (first["layout"]["dp"], first["layout"]["grad_accum"]) == (2, 1)
    assert (second["layout"]["dp"], second["layout"]["grad_accum"]) == (1, 2)
    assert second["started_at_step"] == 2 and second["supersedes"] == [1]


# -- the rules, on written files -------------------------------------------------------------------


def _write(path: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def _trainer(step: int, dp_rank: int = 0) -> SimpleNamespace:
    """What the hook reads of a trainer: one process (no process group), at `step`."""
    dims = SimpleNamespace(dp=1, sp=1, dp_replicate=1)
    ctx = SimpleNamespace(is_main=dp_rank == 0, sp_rank=0, dp_rank=dp_rank, dims=dims)
    cfg = SimpleNamespace(
        train=SimpleNamespace(grad_accum=1, global_batch=0), data=SimpleNamespace(pack=0, balance=False)
    )
    return SimpleNamespace(ctx=ctx, cfg=cfg, step=step, phase="")


def _train_steps(log_dir: Path, started_at: int, last: int, tag: str) -> None:
    """A start of the run at step `started_at` through the hook, training steps up to `last`."""
    hook, trainer = TrainedSamples(log_dir), _trainer(started_at)
    hook.on_fit_start(trainer)
    for step in range(started_at + 1, last + 1):
        sample = SimpleNamespace(sample_id=f"{tag}-{step}")
        hook.on_micro_batch(trainer, MicroBatchEvent(step, 0, sample, None, None))  # type: ignore[arg-type]
        hook.after_step(trainer, step, {})
    hook.on_fit_end(trainer)


def test_later_attempts_replace_the_steps_they_redo(tmp_path) -> None:
    folder = tmp_path / "trained_samples"
    # Records from before attempts were recorded: attempt 0, with steps 1..3, killed mid-write of step 4.
    legacy = [{"step": s, "micro": 0, "samples": [f"old-{s}"]} for s in (1, 2, 3)]
    _write(folder / "dp0.jsonl", legacy, tail='{"step": 4, "mic')
    _train_steps(tmp_path, started_at=2, last=5, tag="a")
    _train_steps(tmp_path, started_at=4, last=6, tag="b")
    assert trained_samples(tmp_path) == {
        1: ["old-1"],
        2: ["old-2"],
        3: ["a-3"],
        4: ["a-4"],
        5: ["b-5"],
        6: ["b-6"],
    }
    first, second = attempts(tmp_path)
    assert (first["attempt"], first["started_at_step"], first["previous_last_step"]) == (1, 2, 3)
    assert first["supersedes"] == [0]
    # Attempt 0's records in force end at step 2, where attempt 1 started: only attempt 1's step 5 is redone.
    assert (second["attempt"], second["previous_last_step"], second["supersedes"]) == (2, 5, [1])
    # The torn line was ended, so attempt 1's first record has a line of its own.
    lines = (folder / "dp0.jsonl").read_text().splitlines()
    assert lines[3] == '{"step": 4, "mic' and json.loads(lines[4])["attempt"] == 1


def test_a_dead_ranks_records_are_superseded_by_any_later_start(tmp_path) -> None:
    folder = tmp_path / "trained_samples"
    layout = {"dp": 2}
    assert begin_attempt(folder, 0, layout) == 1
    _write(
        folder / "dp0.jsonl",
        [{"attempt": 1, "step": s, "micro": 0, "dp_rank": 0, "samples": [f"r0-{s}"]} for s in (1, 2, 3)],
    )
    _write(
        folder / "dp1.jsonl",
        [{"attempt": 1, "step": s, "micro": 0, "dp_rank": 1, "samples": [f"r1-{s}"]} for s in (1, 2, 3)],
    )
    assert trained_samples(tmp_path) == {s: [f"r0-{s}", f"r1-{s}"] for s in (1, 2, 3)}
    # A start on one rank from step 1, which never reached its first record: steps 2 and 3 are gone from both files.
    assert begin_attempt(folder, 1, {"dp": 1}) == 2
    assert trained_samples(tmp_path) == {1: ["r0-1", "r1-1"]}
    assert attempts(tmp_path)[-1]["supersedes"] == [1]
    # Attempt 2 wrote nothing, so a start from step 0 supersedes only what is left of attempt 1: its step 1.
    assert begin_attempt(folder, 0, {"dp": 1}) == 3
    assert attempts(tmp_path)[-1]["previous_last_step"] is None
    assert attempts(tmp_path)[-1]["supersedes"] == [1]
    assert trained_samples(tmp_path) == {}


def test_the_reader_orders_a_step_by_rank_then_micro_batch(tmp_path) -> None:
    folder = tmp_path / "trained_samples"
    begin_attempt(folder, 0, {"dp": 2})
    rows = [(1, 1, ["d"]), (1, 0, ["c"]), (0, 1, ["b1", "b2"]), (0, 0, ["a"])]
    for rank, micro, ids in rows:
        record = {"attempt": 1, "step": 1, "micro": micro, "dp_rank": rank, "samples": ids}
        _write(folder / f"dp{rank}.jsonl", [record])
    assert trained_samples(tmp_path) == {1: ["a", "b1", "b2", "c", "d"]}
