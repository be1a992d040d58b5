"""Every rank of a group issues the same collectives, whatever its sample.

A run at `dp = N` with accumulation `A` is one process accumulating `N x A` micro-batches over the same
samples: loss and grad norm agree at every step. The DP ranks here get different samples at every step
(lengths, sound or none, t2va / fl2va / ref2va, dropped and kept prompts under CFG, a skipped
unreadable sample, a non-finite step on one rank), with EMA, held-out loss and guidance retention. The
process groups check each collective across their ranks (`TORCH_DISTRIBUTED_DEBUG=DETAIL`, which
`conftest.py` and `launch.run_env` set where torch can: `ranks.collective_checks`), so a rank that
issues a collective its peers do not fails the run where it diverges, and the fault test shows that
check catching such a branch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.data.dataset import CachedDataset
from h3train.data.sampler import DistributedSampler
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.objective import text_dropped

from helpers.launch import read_metrics, run_forked, tiny_args
from helpers.paths import TINY_FL2VA
from helpers.ranks import collective_checks

STEPS = 6
SEED = 4
DROPOUT = 0.5
# Step 3 is non-finite on one rank only (`nan_loss@3:RANK`): every rank skips it.
NAN_STEP = 3
# A sample whose file fails validation: the dataset reads the next one in its place.
CORRUPT = "synth-000005"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[Path, Path]:
    """A mixed training set of 14 samples and a held-out set of 3 (one DP rank pads at dp = 2 and 4)."""
    root = tmp_path_factory.mktemp("mixed")
    train = write_synthetic_dataset(root / "train", task="mixed", num_samples=14, seed=5, text_dim=16)
    heldout = write_synthetic_dataset(root / "heldout", task="mixed", num_samples=3, seed=9, text_dim=16)
    return train, heldout


def _overrides(train: Path, heldout: Path, *extra: str) -> list[str]:
    return [
        "task.name=mixed",
        "data.source=cached",
        f"data.path={train}",
        "data.on_error=skip",
        f"train.steps={STEPS}",
        f"train.seed={SEED}",
        "train.ema.decay=0.9",
        "train.spike_factor=1.2",
        "train.spike_window=2",
        "cfg.scale=3",
        f"cfg.text_dropout={DROPOUT}",
        "checkpoint.every=0",
        f"validation.dataset={heldout}",
        "validation.every=2",
        "validation.at_start=true",
        "validation.use_ema=true",
        "validation.sigmas=[0.3,0.7]",
        *extra,
    ]


def _finite(value: float | None) -> bool:
    """A logged number (a non-finite one is written as null)."""
    return value is not None and math.isfinite(value)


def _rows(log_dir: Path, kind: str | None) -> list[dict]:
    return [m for m in read_metrics(log_dir) if m.get("kind") == kind]


def _kinds(train: Path) -> list[list[tuple]]:
    """Per step, the kind of each of its 4 micro-batches in global order (slot `micro * dp + dp_rank`):
    (sample task, sound, prompt dropped, packed rows); the unreadable sample's place holds its substitute."""
    cfg = load_config(TINY_FL2VA, _overrides(train, train))
    dataset = CachedDataset(train, "mixed", on_error="skip", injected_corrupt={CORRUPT})
    sampler = DistributedSampler(len(dataset), 0, 1, cfg.train.seed)
    steps = []
    for step in range(1, STEPS + 1):
        kinds = []
        for _ in range(4):
            sample = dataset[sampler.next_index()]
            dropped = text_dropped(SEED, step, sample.sample_id, DROPOUT)
            kinds.append((sample.task, sample.has_audio, dropped, sample.layout.seq_len))
        steps.append(kinds)
    return steps


def test_the_steps_give_each_rank_a_different_kind_of_sample(datasets) -> None:
    steps = _kinds(datasets[0])
    for step, kinds in enumerate(steps, start=1):
        # The four micro-batches of a step differ from one another (the DP ranks of dp = 4, and the two
        # ranks of each micro-batch at dp = 2), and the run holds every kind of difference.
        assert len(set(kinds)) == 4, (step, kinds)
        assert len({k[0] for k in kinds}) > 1 and len({k[3] for k in kinds}) > 1, (step, kinds)
    flat = [k for kinds in steps for k in kinds]
    assert {k[0] for k in flat} == {"t2va", "fl2va", "ref2va"}
    assert {k[1] for k in flat} == {True, False}
    assert {k[2] for k in flat} == {True, False}
    # Within single steps too: sound and silence, dropped and kept prompts side by side.
    assert any(len({k[1] for k in kinds}) == 2 and len({k[2] for k in kinds}) == 2 for kinds in steps)


@pytest.fixture(scope="module")
def one_process(datasets, tmp_path_factory) -> Path:
    """The reference: one process accumulating the 4 micro-batches of each step."""
    train, heldout = datasets
    log_dir = tmp_path_factory.mktemp("one")
    faults = f"debug.fault=[nan_loss@{NAN_STEP},corrupt_sample@{CORRUPT}]"
    run_forked(tiny_args(log_dir, *_overrides(train, heldout, "train.grad_accum=4", faults)))
    return log_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "nan_rank"),
    [(["parallel.sp=2", "train.grad_accum=2"], 1), (["parallel.sp=1", "train.grad_accum=1"], 2)],
    ids=["dp2_sp2", "dp4"],
)
def test_four_ranks_of_different_samples_equal_one_process(datasets, one_process, tmp_path, layout, nan_rank) -> None:
    train, heldout = datasets
    faults = f"debug.fault=[nan_loss@{NAN_STEP}:{nan_rank},corrupt_sample@{CORRUPT}]"
    run_forked(tiny_args(tmp_path, *_overrides(train, heldout, *layout, faults)), nproc=4, timeout=300)

    want, got = _rows(one_process, None), _rows(tmp_path, None)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        if a["step"] == NAN_STEP:
            # Skipped by every rank: no number to compare, the same count of skips.
            assert not _finite(a["grad_norm"]) and not _finite(b["grad_norm"])
            assert a["skipped_steps"] == b["skipped_steps"] == 1
            continue
        for key in ("loss", "grad_norm", "loss_video", "loss_video_fm", "cfg_scale_video"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        assert (a["loss_audio"] is None) == (b["loss_audio"] is None)

    want_val, got_val = _rows(one_process, "validation"), _rows(tmp_path, "validation")
    assert [r["step"] for r in got_val] == [r["step"] for r in want_val] == [0, 2, 4, 6]
    for a, b in zip(want_val, got_val):
        keys = [k for k in a if k.startswith("val/") and a[k] is not None]
        assert any(k.startswith("val/guidance_ratio") for k in keys), keys
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (a["step"], key)


@pytest.mark.slow
@pytest.mark.skipif(not collective_checks(), reason="this torch's groups cannot check FSDP2's collectives on gloo")
def test_a_rank_that_runs_one_more_forward_is_caught_where_it_diverges(tmp_path) -> None:
    args = tiny_args(tmp_path, "parallel.sp=1", "train.steps=3", "checkpoint.every=0", "debug.fault=[rank_branch@2:1]")
    proc = run_forked(args, nproc=2, check=False, timeout=120)
    assert proc.returncode != 0
    assert "Detected mismatch between collectives" in proc.stderr
    # Step 1 ran the same collectives on both ranks and trained.
    assert [r["step"] for r in _rows(tmp_path, None)] == [1]


@pytest.mark.slow
def test_cfg_with_text_dropout_at_two_dp_ranks_equals_one_process(tmp_path) -> None:
    """Dropped prompts run the negative forward too: dp = 2 (accumulating 2) equals one process of 4."""
    common = ["cfg.scale=3", f"cfg.text_dropout={DROPOUT}", "parallel.sp=1", "train.steps=8", "checkpoint.every=0"]
    run_forked(tiny_args(tmp_path / "dp2", *common), nproc=2)
    run_forked(tiny_args(tmp_path / "one", *common, "train.grad_accum=4"))
    want, got = _rows(tmp_path / "one", None), _rows(tmp_path / "dp2", None)
    assert len(got) == len(want) == 8
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "loss_video_fm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def test_no_gradient_is_alive_while_validation_runs(datasets, tmp_path, monkeypatch) -> None:
    from h3train.run.assemble import build_trainer
    from h3train.train.validation import HeldOutLoss

    seen: list[int] = []
    evaluate = HeldOutLoss.evaluate

    def counting(self, trainer):
        seen.append(sum(p.grad is not None for p in trainer.model.parameters()))
        return evaluate(self, trainer)

    monkeypatch.setattr(HeldOutLoss, "evaluate", counting)
    train, heldout = datasets
    overrides = [*_overrides(train, heldout, "train.steps=2", "debug.fault=[]"), f"logging.dir={tmp_path}"]
    trainer = build_trainer(load_config(TINY_FL2VA, [*overrides, "logging.progress=false"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    # Before training, and after step 2's update: the step's gradients were freed by then.
    assert seen == [0, 0]
    assert [r["step"] for r in _rows(tmp_path, None)] == [1, 2]
