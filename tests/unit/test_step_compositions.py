"""Step compositions (`data/step_composition.py`): which samples each DP rank trains in each micro-batch,
packed and balanced."""

from __future__ import annotations

import random
import re

import pytest

from h3train.data.sampler import DistributedSampler
from h3train.data.step_composition import StepComposer, attention_rows, imbalance, sample_cost

pytestmark = pytest.mark.one_lane

S0 = 26_880.0


def _lengths(n: int, seed: int = 0, low: int = 1_000, spread: float = 8.0) -> list[int]:
    rng = random.Random(seed)
    return [int(low * rng.uniform(1.0, spread)) for _ in range(n)]


def _steps(composer: StepComposer, rows_at, steps: int, start: int = 0):
    plans = []
    for _ in range(steps):
        plans.append(composer.compose(start, rows_at))
        start += plans[-1].count
    return plans


def test_the_cost_model_is_the_released_models_flops() -> None:
    dims = {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "ffn_dim": 14336}
    # 2 h + 1.5 h f / a: where 4 S a FLOP of attention per row equal the 8 h a + 6 h f of the linears.
    assert attention_rows(dims) == pytest.approx(26_880.0)
    assert sample_cost(26_880, S0) == pytest.approx(2 * 26_880)


def test_unpacked_unbalanced_plans_are_the_samplers_order() -> None:
    dp, accum = 3, 2
    sampler = DistributedSampler(40, 0, dp, seed=5)
    composer = StepComposer(dp, accum)
    plan = composer.compose(12, lambda p: 100)
    assert plan.count == dp * accum
    for rank in range(dp):
        for micro in range(accum):
            assert plan.slots(rank, micro) == (micro * dp + rank,)
    # The slot the plan gives rank r's micro-batch m is the sampler's entry for it.
    ranks = [DistributedSampler(40, r, dp, seed=5) for r in range(dp)]
    for r in ranks:
        r.position = 12
    for micro in range(accum):
        for rank, s in enumerate(ranks):
            assert s.next_index() == sampler.global_index(12 + plan.slots(rank, micro)[0])


@pytest.mark.parametrize(("budget", "balance"), [(0, True), (8_000, False), (8_000, True), (16_000, True)])
def test_every_sample_of_the_order_trains_once_within_budget(budget: int, balance: bool) -> None:
    lengths = _lengths(500)
    composer = StepComposer(4, 2, budget, balance, S0)
    plans = _steps(composer, lambda p: lengths[p % 500], 60)
    position = 0
    for plan in plans:
        assert plan.start == position
        slots = sorted(s for rank in plan.micro_batches for micro in rank for s in micro)
        assert slots == list(range(plan.count))  # the window, each slot once: none dropped, none repeated
        assert all(len(rank) == 2 and all(micro for micro in rank) for rank in plan.micro_batches)
        if budget:
            for rank in plan.micro_batches:
                for micro in rank:
                    assert sum(lengths[(plan.start + s) % 500] for s in micro) <= budget
        position += plan.count


def test_packing_and_balance_even_out_the_ranks() -> None:
    lengths = _lengths(2_000, seed=1)
    rows_at = lambda p: lengths[p % len(lengths)]  # noqa: E731

    def mean_imbalance(composer: StepComposer) -> float:
        plans = _steps(composer, rows_at, 200)
        return sum(imbalance(composer.rank_costs(plan, rows_at)) for plan in plans) / len(plans)

    unpacked = mean_imbalance(StepComposer(4, 1, s0=S0))
    balanced = mean_imbalance(StepComposer(4, 1, 16_000, True, S0))
    assert unpacked > 0.35
    assert balanced < 0.10
    assert mean_imbalance(StepComposer(4, 1, 16_000, False, S0)) > balanced


def test_a_sample_over_the_budget_trains_alone() -> None:
    lengths = [500, 3_000, 400, 600, 700, 800, 900, 100]
    composer = StepComposer(2, 1, 2_000, True, S0)
    plan = composer.compose(0, lambda p: lengths[p])
    alone = [micro for rank in plan.micro_batches for micro in rank if 1 in micro]
    assert alone == [(1,)]


def test_plans_do_not_depend_on_the_rank_that_computes_them() -> None:
    lengths = _lengths(300, seed=2)
    first = _steps(StepComposer(2, 3, 9_000, True, S0), lambda p: lengths[p % 300], 20)
    again = _steps(StepComposer(2, 3, 9_000, True, S0), lambda p: lengths[p % 300], 20)
    assert first == again


def test_check_plans_packs_names_the_imbalance_and_refuses_a_sample_over_the_budget(tmp_path, capsys) -> None:
    from h3train.cli import main
    from h3train.data.synthetic_dataset import write_synthetic_dataset

    from helpers.paths import ROOT

    data = write_synthetic_dataset(tmp_path / "data", task="mixed", num_samples=24, text_dim=16)
    config = str(ROOT / "configs" / "tiny_ref2va.yaml")
    args = ["check", config, "--world-size", "4", "parallel.dp_shard=4", f"data.path={data}", "task.name=mixed"]
    assert main([*args, "data.pack=2000"]) == 0
    out = capsys.readouterr().out
    assert "2,000 rows (data.pack=2000 rows per micro-batch" in out
    (line,) = [x for x in out.splitlines() if x.startswith("balance")]
    found = re.fullmatch(
        r"balance +imbalance ([\d.]+) % as configured \(data.pack=2000, data.balance=false; mean over \d+ steps; "
        r"docs/training.md\); data.pack=2000 \+ data.balance=true would give ([\d.]+) %",
        line,
    )
    assert found is not None, line
    as_set, balanced = float(found[1]), float(found[2])
    assert as_set > balanced >= 0.0
    assert main([*args, "data.pack=2000", "data.balance=true"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("balance")]
    assert f"imbalance {balanced:.1f} % as configured (data.pack=2000, data.balance=true" in line
    assert "would give" not in line

    assert main([*args, "data.pack=100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config key 'data.pack' is 100 rows" in err and "pack_oversize=alone" in err
    assert main([*args, "data.pack=100", "data.pack_oversize=alone"]) == 0


def test_check_rehearses_a_pack_at_the_budget(tmp_path) -> None:
    from h3train.config import load_config
    from h3train.data.synthetic_dataset import write_synthetic_dataset
    from h3train.run.rehearse import rehearse
    from h3train.run.rehearse.formatting import format_rehearsal

    from helpers.paths import ROOT

    data = write_synthetic_dataset(tmp_path / "data", task="mixed", num_samples=8, text_dim=16)
    config, data_keys = ROOT / "configs" / "tiny_ref2va.yaml", [f"data.path={data}", "task.name=mixed"]
    longest = rehearse(load_config(config, data_keys), 1).rows
    packed = rehearse(load_config(config, [*data_keys, f"data.pack={3 * longest + 1}"]), 1)
    assert packed.rows == 3 * longest
    report = format_rehearsal(packed)
    assert f"data.pack={3 * longest + 1}: 3 of the longest sample" in report and "within" in report
