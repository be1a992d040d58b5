"""Sharded runs against the unsharded diffusers reference, parameter by parameter.

Each case runs `h3train train` (real FSDP2 over gloo, Ulysses SP) with a debug dump at step 1,
then recomputes the step with plain `MiniMaxH3Transformer3DModel.forward` in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import read_metrics, run_env, tiny_args, train
from helpers.paths import ROOT, TINY_FL2VA
from helpers.ranks import SUMS_AVERAGE
from helpers.reference import Parity, parity_of, parity_overrides, parity_step
from helpers.runs import TrainedRuns

TOL = 1e-5
TINY_REF2VA = ROOT / "configs" / "tiny_ref2va.yaml"

CASES = {
    # name: (nproc, overrides, dp); names starting with "ref2va" train tiny_ref2va.yaml on a cached
    # dataset of images, videos with and without soundtrack, audio clips and mixed references.
    # tiny_fl2va packs 51 rows (odd); text_len=12 makes it 50 (even). It has 4 heads, so sp=4 is heads == sp.
    "sp2_odd_seq": (2, ["parallel.sp=2"], 1),
    "sp2_even_seq_ckpt_no_audio": (
        2,
        [
            "parallel.sp=2",
            "data.synthetic.text_len=12",
            "model.gradient_checkpointing=true",
            "data.synthetic.has_audio=false",
        ],
        1,
    ),
    "sp1_no_audio": (1, ["data.synthetic.has_audio=false"], 1),
    "sp4_heads_eq_sp_cfg_no_audio": (
        4,
        ["parallel.sp=4", "cfg.scale=3", "cfg.curvature_power=0.5", "data.synthetic.has_audio=false"],
        1,
    ),
    "dp_shard2": (2, ["parallel.dp_shard=2"], 2),
    "dp_replicate2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], 2),
    "hsdp2_sp2_cfg_sigma": (
        4,
        ["parallel.dp_replicate=2", "parallel.sp=2", "cfg.scale=4", "cfg.schedule=sigma", "cfg.negative_visual=drop"],
        2,
    ),
    "ref2va_sp1_cfg": (1, ["cfg.scale=2.5", "cfg.schedule=sigma"], 1),
    "ref2va_sp2_cfg": (2, ["parallel.sp=2", "cfg.scale=2.5", "cfg.schedule=sigma"], 1),
    "ref2va_sp4_accum3": (4, ["parallel.sp=4", "train.grad_accum=3"], 1),
}


class SharedRuns:
    """Runs that two tests read, each launched once (`trained_runs`)."""

    def __init__(self, trained_runs: TrainedRuns) -> None:
        self.trained_runs = trained_runs

    @property
    def fl2va_sp2(self) -> tuple[Path, Parity]:
        """tiny_fl2va at sp=2 for three steps, step 1 dumped: the `sp2_odd_seq` case and the sp=2 run of the
        tiny_fl2va CLI pair, one launch for both."""
        nproc, extra, dp = CASES["sp2_odd_seq"]
        overrides = parity_overrides(3, self.trained_runs.root / "fl2va_sp2-data", extra)
        run = self.trained_runs.get(*overrides, nproc=nproc)
        return run.dir, parity_of(TINY_FL2VA, overrides, run.dir, dp, run.stdout)


@pytest.fixture(scope="module")
def shared(trained_runs: TrainedRuns) -> SharedRuns:
    return SharedRuns(trained_runs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_unsharded_reference(case: str, tmp_path, shared) -> None:
    nproc, extra, dp = CASES[case]
    config = TINY_REF2VA if case.startswith("ref2va") else TINY_FL2VA
    if case == "sp2_odd_seq":
        result = shared.fl2va_sp2[1]
    else:
        result = parity_step(config, extra, tmp_path / "run", nproc, dp)
    assert set(result.grads) == set(result.ref_grads)
    worst, name = result.worst()
    assert worst <= TOL, f"{case}: gradient of {name} off by relative L2 {worst:.3e}"
    for name, g in result.ref_grads.items():
        if g.abs().sum() == 0:
            assert torch.count_nonzero(result.grads[name]) == 0, name
    assert result.loss == pytest.approx(result.ref_loss, rel=TOL)
    assert result.grad_norm == pytest.approx(result.ref_norm, rel=TOL)


@pytest.mark.slow
def test_backend_that_sums_when_asked_to_average_trains_the_reference_gradients(tmp_path) -> None:
    """Collectives that sum when asked to average (torch 2.8's gloo reduce-scatter does) on an HSDP x SP
    run: found at start-up on both groups, FSDP2 reduces by SUM and divides by 4 itself, and every
    gradient, the loss and grad_norm equal the unsharded reference's."""
    extra = ["parallel.dp_replicate=2", "parallel.sp=2"]
    env = run_env(**{SUMS_AVERAGE: "1"})
    result = parity_step(TINY_FL2VA, extra, tmp_path / "run", nproc=4, dp=2, env=env)
    assert "gloo's reduce-scatter over dp_shard_sp (2 ranks)" in result.output, result.output
    assert "gloo's all-reduce over dp_replicate (2 ranks)" in result.output
    assert "FSDP2 reduces by SUM and divides by 4 itself" in result.output
    worst, name = result.worst()
    assert worst <= TOL, f"gradient of {name} off by relative L2 {worst:.3e}"
    assert result.loss == pytest.approx(result.ref_loss, rel=TOL)
    assert result.grad_norm == pytest.approx(result.ref_norm, rel=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tiny_fl2va.yaml", "tiny_ref2va.yaml", "tiny_ref2va_cfg.yaml"])
def test_cli_runs_agree_across_sp(config: str, tmp_path, shared) -> None:
    """One process at sp=1 and two ranks at sp=2, three steps: the same loss and grad_norm per step."""
    path = ROOT / "configs" / config
    common = ["train.steps=3", f"data.path={tmp_path / 'data'}"]
    train(tiny_args(tmp_path / "A", *common, config=path))
    if path == TINY_FL2VA:  # the same run as the sp2_odd_seq case's, with its step-1 dump
        sp2 = shared.fl2va_sp2[0]
    else:
        sp2 = tmp_path / "B"
        train(tiny_args(sp2, "parallel.sp=2", *common, config=path), nproc=2)
    a, b = read_metrics(tmp_path / "A"), read_metrics(sp2)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for ma, mb in zip(a, b):
        assert mb["loss"] == pytest.approx(ma["loss"], rel=TOL)
        assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=TOL)
