"""A step's samples: each at most once, within one epoch, `train.global_batch` of a packed one; what check says."""

from __future__ import annotations

import random
import re

import pytest

from h3train.cli import main
from h3train.data.sampler import DistributedSampler
from h3train.data.step_composition import StepComposer, batch_layout, global_batch_change, outlook

from helpers.paths import TINY_FL2VA

pytestmark = pytest.mark.one_lane


def _order(num: int, seed: int = 3, lengths: list[int] | None = None, parts=None) -> tuple:
    sampler = DistributedSampler(num, 0, 1, seed=seed, parts=parts)
    lengths = lengths or [100] * num
    return sampler, (lambda p: lengths[sampler.global_index(p)]), sampler.global_index


def _trained(composer: StepComposer, sampler, rows_at, sample_at, steps: int) -> list[list[int]]:
    """The source indices each of `steps` steps trains, planned as the run's stream plans them."""
    out, start = [], 0
    for _ in range(steps):
        plan = composer.compose(start, rows_at, sample_at, sampler.epoch_length)
        assert plan.origin == start
        slots = [s for rank in plan.micro_batches for micro in rank for s in micro]
        assert sorted(slots) == list(range(plan.count))
        out.append([sample_at(plan.start + s) for s in slots])
        start = plan.end
    return out


def test_a_pack_budget_larger_than_the_data_trains_each_sample_once_a_step() -> None:
    sampler, rows_at, sample_at = _order(34)
    steps = _trained(StepComposer(1, 2, budget=100_000), sampler, rows_at, sample_at, 5)
    for samples in steps:
        assert len(samples) == 34 and len(set(samples)) == 34


@pytest.mark.parametrize("balance", [False, True])
def test_packed_steps_never_straddle_an_epoch_nor_repeat_a_sample(balance: bool) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(50, 400) for _ in range(50)]
    sampler, rows_at, sample_at = _order(50, lengths=lengths)
    composer = StepComposer(2, 2, budget=900, balance=balance)
    start, epochs = 0, set()
    for _ in range(40):
        plan = composer.compose(start, rows_at, sample_at, sampler.epoch_length)
        first, last = plan.start // 50, (plan.end - 1) // 50
        assert first == last, "a step reached into the next epoch"
        samples = [sample_at(plan.start + s) for r in plan.micro_batches for m in r for s in m]
        assert len(samples) == len(set(samples))
        # A skipped tail is shorter than the step's micro-batches.
        assert plan.skipped < composer.micro_batches
        epochs.add(first)
        start = plan.end
    assert len(epochs) > 3


@pytest.mark.parametrize("balance", [False, True])
def test_unpacked_steps_never_straddle_an_epoch_nor_repeat_a_sample(balance: bool) -> None:
    # 10 samples, 4 micro-batches a step: the third step of each epoch would take its last 2 samples and
    # 2 of the next epoch's order, which may be the same samples. That tail is passed over instead.
    sampler, rows_at, sample_at = _order(10)
    composer = StepComposer(2, 2, balance=balance)
    steps = _trained(composer, sampler, rows_at, sample_at, 12)
    assert all(len(samples) == 4 == len(set(samples)) for samples in steps)
    start = 0
    for _ in range(12):
        plan = composer.compose(start, rows_at, sample_at, sampler.epoch_length)
        assert plan.start // 10 == (plan.end - 1) // 10, "a step reached into the next epoch"
        assert plan.skipped in (0, 2)
        start = plan.end
    # Two steps an epoch: positions 8 and 9 of every epoch are passed over.
    assert outlook(composer, rows_at, sample_at, sampler.epoch_length).steps_per_epoch == 2


def test_a_dataset_drawn_twice_an_epoch_still_trains_each_sample_once_a_step() -> None:
    # One dataset of 10 samples repeated twice: every epoch holds each sample twice.
    sampler, rows_at, sample_at = _order(10, parts=[(10, 20)])
    for samples in _trained(StepComposer(1, 1, budget=10_000), sampler, rows_at, sample_at, 12):
        assert len(samples) == len(set(samples)) and len(samples) <= 10


def test_global_batch_fixes_the_samples_of_a_packed_step() -> None:
    sampler, rows_at, sample_at = _order(200)
    steps = _trained(StepComposer(2, 2, budget=1_000, global_batch=12), sampler, rows_at, sample_at, 10)
    assert [len(s) for s in steps] == [12] * 10
    # Rows that do not fit the packs cut the step short: 4 packs of 300 rows hold 12 samples of 100.
    steps = _trained(StepComposer(2, 2, budget=300, global_batch=16), sampler, rows_at, sample_at, 3)
    assert [len(s) for s in steps] == [12] * 3


def test_outlook_counts_the_steps_of_an_epoch() -> None:
    sampler, rows_at, sample_at = _order(34)
    seen = outlook(StepComposer(1, 2, budget=100_000), rows_at, sample_at, sampler.epoch_length)
    assert seen.exact and seen.steps_per_epoch == 1 and seen.samples_min == seen.samples_max == 34
    seen = outlook(StepComposer(2, 1, budget=350, balance=True), rows_at, sample_at, sampler.epoch_length)
    assert seen.exact and seen.samples_max <= 6 and seen.steps_per_epoch == seen.steps


def test_a_resume_names_the_setting_that_keeps_the_global_batch() -> None:
    assert global_batch_change(batch_layout(2, 2, 0, 0), batch_layout(2, 2, 0, 0)) is None
    line = global_batch_change(batch_layout(2, 2, 0, 0), batch_layout(4, 2, 0, 0))
    assert line == (
        "the global batch changes: 4 samples per step (dp 2 x train.grad_accum 2) -> 8 samples per step "
        "(dp 4 x train.grad_accum 2); train.grad_accum=1 keeps it"
    )
    packed = global_batch_change(batch_layout(2, 2, 4096, 0), batch_layout(4, 2, 4096, 0))
    assert packed is not None and packed.endswith("train.grad_accum=1 keeps it")
    assert "no train.grad_accum keeps it at dp 3" in global_batch_change(
        batch_layout(2, 1, 0, 0), batch_layout(3, 1, 0, 0)
    )
    assert global_batch_change(batch_layout(2, 2, 4096, 16), batch_layout(4, 2, 4096, 16)) is None
    changed = global_batch_change(batch_layout(2, 2, 4096, 16), batch_layout(2, 2, 4096, 32))
    assert changed is not None and changed.endswith("train.global_batch=16 keeps it")
    pack = global_batch_change(batch_layout(2, 2, 4096, 0), batch_layout(2, 2, 8192, 0))
    assert pack is not None and pack.endswith("train.grad_accum=2 keeps it with data.pack=4096")


def test_check_prints_samples_per_step_and_steps_per_epoch(capsys) -> None:
    args = ["check", str(TINY_FL2VA), "data.synthetic.num_samples=34", "data.pack=100000"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("samples "))
    assert re.search(r"samples\s+34 per step \(train.global_batch unset\), 1 step per epoch of 34 samples", line)
    assert main(["check", str(TINY_FL2VA), "--world-size", "2", "data.balance=false"]) == 0
    out = capsys.readouterr().out
    balance = next(ln for ln in out.splitlines() if ln.startswith("balance "))
    assert "as configured (data.pack=0, data.balance=false" in balance and "would give" in balance
    assert "4 per step (dp 2 x train.grad_accum 2), 8 steps per epoch of 32 samples" in out


def test_check_counts_the_steps_of_an_epoch_longer_than_the_planned_steps_in_whole_steps(capsys) -> None:
    # 1,000 samples at 2 a step: the first 100 steps do not reach the epoch's end, so the count is estimated.
    assert main(["check", str(TINY_FL2VA), "data.synthetic.num_samples=1000"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("samples "))
    assert line.endswith("2 per step (dp 1 x train.grad_accum 2), about 500 steps per epoch of 1,000 samples"), line


def test_global_batch_is_refused_without_packs_or_below_the_micro_batches(capsys) -> None:
    assert main(["check", str(TINY_FL2VA), "train.global_batch=8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.global_batch' is 8: it sets the samples of a packed step" in err[0]
    assert main(["check", str(TINY_FL2VA), "--world-size", "2", "data.pack=1000", "train.global_batch=3"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.global_batch' is 3, but a step gives each of its 4 micro-batches" in err[0]
