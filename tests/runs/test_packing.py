"""A packed micro-batch trains exactly what its samples train unpacked, through the trainer's own step.

One step of the same window of the global order, on a cached dataset of every sample task (fl2va with
keyframes, ref2va with references, t2va; some silent) with a dropped prompt, trained by `build_trainer` +
`Trainer.forward_backward` in float64 on gloo ranks: once one sample per micro-batch (grad_accum > 1),
once packed (`data.pack`, `train.global_batch`). Every parameter's gradient, each sample's loss and the
step's grad norm agree to float64 rounding at sp 1, 2 and 4, with CFG on and with full recompute. The
same comparison with a fault planted in packing (attention over the whole pack, the prompt refiner over
all the pack's prompts, AdaLN timestep rows not moved past the samples before) misses the bound by many
orders, so the bound can fail. Each layout forks its ranks once for all of that (`helpers.pack_ranks`).

A packed, balanced run checkpointed at dp 2 and resumed at dp 1 trains, step by step, the same samples
as the run that was not interrupted (`<logging.dir>/trained_samples/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from h3train.config import Config, load_config
from h3train.data.source import build_sampler, build_source
from h3train.data.trained_samples import attempts, trained_samples
from h3train.objective import text_dropped

from helpers.launch import run_env, run_forked, tiny_args
from helpers.pack_ranks import MUTATIONS, StepRuns, mixed_overrides, run_on_ranks, step_gradients
from helpers.paths import ROOT
from helpers.reference import relative_l2

CONFIG = ROOT / "configs" / "tiny_ref2va.yaml"
# Float64 rounding, summed in another order over a pack's rows than over each sample's.
TOL = 1e-12
# What a planted fault must at least miss by: far above any rounding.
FAULT = 1e-6
# Samples of the step over every DP rank: the unpacked run's dp x grad_accum, the packed run's global batch.
WINDOW = 6
# Rows per pack: the window's samples (at most 100 rows each, data.max_rows) fit two packs.
BUDGET = 200
TEXT_DROPOUT = 0.25
CFG = ("cfg.scale=3", "cfg.curvature_power=0.5")


@dataclass(frozen=True)
class Layout:
    """Ranks, DP size, the overrides of both runs and the packed run's grad_accum (the unpacked run's
    is `WINDOW / dp`)."""

    nproc: int
    dp: int
    overrides: tuple[str, ...]
    packed_accum: int


LAYOUTS = {
    "dp2_sp1_cfg": Layout(2, 2, CFG, 1),
    "dp2_sp2_full_recompute": Layout(4, 2, ("parallel.sp=2", "model.activation_checkpointing=full"), 2),
    "dp1_sp4_cfg": Layout(4, 1, ("parallel.sp=4", *CFG), 2),
}


def common_overrides(data: Path, log_dir: Path) -> list[str]:
    """Both runs' overrides: the mixed dataset's samples up to 100 rows, prompt dropout, no checkpoint."""
    return [*mixed_overrides(data, log_dir), f"cfg.text_dropout={TEXT_DROPOUT}"]


def run_overrides(layout: Layout, data: Path, root: Path) -> tuple[list[str], list[str]]:
    """(unpacked, packed) overrides of `layout`, each run in its own folder under `root`."""
    unpacked = [
        *common_overrides(data, root / "unpacked"),
        *layout.overrides,
        f"train.grad_accum={WINDOW // layout.dp}",
    ]
    packed = [
        *common_overrides(data, root / "packed"),
        *layout.overrides,
        f"train.grad_accum={layout.packed_accum}",
        f"data.pack={BUDGET}",
        f"train.global_batch={WINDOW}",
    ]
    return unpacked, packed


class StepCache:
    """Each layout's `StepRuns`, its ranks forked once whichever test asks first."""

    def __init__(self, data: Path, root: Path) -> None:
        self.data, self.root, self.runs = data, root, {}

    def get(self, name: str) -> StepRuns:
        if name not in self.runs:
            layout = LAYOUTS[name]
            unpacked, packed = run_overrides(layout, self.data, self.root / name)
            self.runs[name] = run_on_ranks(
                step_gradients, layout.nproc, str(CONFIG), unpacked, packed, list(MUTATIONS), env=run_env()
            )
        return self.runs[name]


@pytest.fixture(scope="module")
def steps(mixed_data, tmp_path_factory) -> StepCache:
    return StepCache(mixed_data, tmp_path_factory.mktemp("packing_runs"))


def worst_gradient(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-parameter relative L2 of `got` against `expected`, and its parameter."""
    assert got.keys() == expected.keys()
    return max((relative_l2(got[name], g), name) for name, g in expected.items() if g.abs().sum() > 0)


def window_of(data: Path, root: Path) -> tuple[list, Config]:
    """The index entries of step 1's window (positions 0 to WINDOW - 1 of the global order) and the config."""
    cfg = load_config(CONFIG, common_overrides(data, root))
    source = build_source(cfg)
    sampler = build_sampler(source, cfg, 0, 1)
    return [source.entries[sampler.global_index(p)] for p in range(WINDOW)], cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_step_trains_the_unpacked_gradients(name: str, steps: StepCache, tmp_path) -> None:
    runs, layout = steps.get(name), LAYOUTS[name]
    unpacked, packed = runs.unpacked, runs.packed

    # The same window of the global order, every sample task, a silent sample and a dropped prompt in it.
    entries, cfg = window_of(steps.data, tmp_path)
    window = {e.sample_id for e in entries}
    assert set(unpacked.losses) == set(packed.losses) == window
    assert {e.task for e in entries} == {"fl2va", "ref2va", "t2va"}
    assert any(not e.has_audio for e in entries) and any(e.has_audio for e in entries)
    dropped = [e.sample_id for e in entries if text_dropped(cfg.train.seed, 1, e.sample_id, TEXT_DROPOUT)]
    assert 0 < len(dropped) < WINDOW, dropped
    # One sample per micro-batch unpacked, several in a pack; each DP rank its own samples.
    assert all(len(m) == 1 for rank in unpacked.micro_batches for m in rank)
    assert [len(rank) for rank in unpacked.micro_batches] == [WINDOW // layout.dp] * layout.dp
    assert [len(rank) for rank in packed.micro_batches] == [layout.packed_accum] * layout.dp
    assert max(len(m) for rank in packed.micro_batches for m in rank) > 1
    for record in (unpacked, packed):
        per_rank = [{s for m in rank for s in m} for rank in record.micro_batches]
        assert all(per_rank) and sum(len(r) for r in per_rank) == len(set().union(*per_rank)) == WINDOW

    worst, param = worst_gradient(packed.grads, unpacked.grads)
    print(f"{name}: packed vs unpacked, worst parameter relative L2 {worst:.2e} ({param})")
    assert worst <= TOL, f"{name}: gradient of {param} off by relative L2 {worst:.3e}"
    assert any(g.abs().sum() > 0 for g in unpacked.grads.values())
    for sample_id, loss in unpacked.losses.items():
        assert packed.losses[sample_id] == pytest.approx(loss, rel=TOL, abs=0), sample_id
    assert packed.stats["samples"] == unpacked.stats["samples"] == WINDOW
    assert packed.stats["grad_norm"] == pytest.approx(unpacked.stats["grad_norm"], rel=TOL)
    assert packed.stats["loss"] == pytest.approx(unpacked.stats["loss"], rel=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planted_packing_fault_misses_the_bound(name: str, mutation: str, steps: StepCache) -> None:
    runs = steps.get(name)
    mutated = runs.mutated[mutation]
    assert set(mutated.losses) == set(runs.unpacked.losses)
    worst, param = worst_gradient(mutated.grads, runs.unpacked.grads)
    print(f"{name} with {mutation}: worst parameter relative L2 {worst:.2e} ({param})")
    assert worst > FAULT, f"{name}: {mutation} left every gradient within {worst:.3e} (worst: {param})"


@pytest.mark.slow
def test_packed_balanced_run_resumed_at_dp1_continues_the_same_order(mixed_data, tmp_path) -> None:
    common = [
        "task.name=mixed",
        f"data.path={mixed_data}",
        "data.create_synthetic=false",
        "data.max_rows=100",
        f"data.pack={BUDGET}",
        "data.balance=true",
        "logging.sample_ids=true",
    ]
    dp2 = ["train.grad_accum=1"]
    # The same micro-batches a step on one rank: the same plan of each step.
    dp1 = ["train.grad_accum=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_forked(tiny_args(straight, *common, *dp2, "train.steps=4", "checkpoint.every=0", config=CONFIG), nproc=2)
    run_forked(tiny_args(resumed, *common, *dp2, "train.steps=2", "checkpoint.every=2", config=CONFIG), nproc=2)
    proc = run_forked(tiny_args(resumed, *common, *dp1, "train.steps=4", "checkpoint.every=2", config=CONFIG))
    assert "resumed from" in proc.stdout, proc.stdout[-2000:]

    expected, got = trained_samples(straight), trained_samples(resumed)
    assert list(expected) == list(got) == [1, 2, 3, 4]
    assert [(a["started_at_step"], a["layout"]["dp"]) for a in attempts(resumed)] == [(0, 2), (2, 1)]
    for step, samples in expected.items():
        assert len(set(samples)) == len(samples), f"step {step} trains a sample twice: {samples}"
        assert sorted(got[step]) == sorted(samples), f"step {step}"
    # A resume that restarted the order would train step 1's samples again.
    assert sorted(expected[3]) != sorted(expected[1])
