"""checkpoint.keep_best and validation.guard: the verdicts, and what a run does with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3train.checkpoint import complete_checkpoints, step_of
from h3train.cli import main
from h3train.config import GuardConfig, load_config
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import ConfigError
from h3train.train.guard import GUARD_EXIT, ValidationWatch

from helpers.launch import read_metrics
from helpers.paths import TINY_FL2VA


def test_keep_best_follows_the_metric_in_its_direction_and_ignores_step_0() -> None:
    low = ValidationWatch("val/loss", "min", GuardConfig())
    assert not low.judge(0, {"val/loss": 0.1}).save  # before training: nothing to keep
    assert [low.judge(step, {"val/loss": v}).save for step, v in ((1, 3.0), (2, 2.0), (3, 2.5), (4, 1.0))] == [
        True,
        True,
        False,
        True,
    ]
    assert low.best_checkpoint == 4 and low.describe() == "val/loss 1 after step 4"
    high = ValidationWatch("val/guidance_cos_video", "max", GuardConfig())
    assert [high.judge(s, {"val/guidance_cos_video": v}).save for s, v in ((1, 0.5), (2, 0.4), (3, 0.9))] == [
        True,
        False,
        True,
    ]
    assert not high.judge(4, {"val/guidance_cos_video": None}).save  # a metric absent from a row
    restored = ValidationWatch("val/guidance_cos_video", "max", GuardConfig())
    restored.load_state_dict(high.state_dict())
    assert restored.best_checkpoint == 3 and not restored.judge(5, {"val/guidance_cos_video": 0.8}).save
    # Another metric starts afresh.
    other = ValidationWatch("val/loss", "min", GuardConfig())
    other.load_state_dict(high.state_dict())
    assert other.best_checkpoint is None


def test_the_guard_names_every_crossed_threshold_per_modality() -> None:
    guard = GuardConfig(min_guidance_ratio=0.5, min_guidance_cos=0.9, max_drift=0.2, action="warn")
    watch = ValidationWatch(None, "min", guard)
    row = {
        "val/guidance_ratio_video": 0.41,
        "val/guidance_ratio_audio": None,  # no held-out sound
        "val/guidance_cos_video": 0.95,
        "val/guidance_cos_audio": 0.85,
        "val/drift_video": 0.3,
        "val/drift_audio": 0.1,
    }
    verdict = watch.judge(7, row)
    assert not verdict.save and verdict.stop is None
    assert verdict.lines == [
        "h3train: warning: validation.guard after step 7: val/guidance_ratio_video 0.41 < min_guidance_ratio 0.5; "
        "val/guidance_cos_audio 0.85 < min_guidance_cos 0.9; val/drift_video 0.3 > max_drift 0.2"
    ]
    stop = ValidationWatch(None, "min", GuardConfig(max_drift=0.2, action="stop")).judge(7, row)
    assert stop.save and stop.stop == "validation.guard after step 7: val/drift_video 0.3 > max_drift 0.2"
    assert not watch.judge(0, row).lines  # the step-0 row measures the base itself


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["checkpoint.keep_best=val/lost"], "'checkpoint.keep_best' is 'val/lost'; name a validation metric"),
        (["checkpoint.keep_best=val/drift_video@0.50"], "name a validation metric"),
        (["checkpoint.keep_best=val/loss", "validation.every=0"], "needs a held-out loss during training"),
        (["checkpoint.keep_best=val/guidance_cos_video", "validation.retention=false"], "validation.retention=true"),
        (["checkpoint.keep_best=val/loss_cfg"], "logged only with cfg.scale other than 1"),
        (["checkpoint.keep_best_mode=lowest"], "'checkpoint.keep_best_mode' is 'lowest'; choose one of min, max"),
        (["validation.guard.max_drift=-1"], "'validation.guard.max_drift' is -1.0; choose a value in [0.0, inf]"),
        (["validation.guard.min_guidance_cos=2"], "choose a value in [-1.0, 1.0]"),
        (["validation.guard.min_guidance_ratio=0.5", "validation.retention=false"], "needs retention measured"),
        (["validation.guard.action=halt"], "'validation.guard.action' is 'halt'; choose one of warn, stop"),
    ],
)
def test_bad_keep_best_or_guard_settings_are_one_line(overrides: list[str], needle: str) -> None:
    base = ["validation.dataset=held", "validation.every=2"]
    with pytest.raises(ConfigError, match=None) as err:
        load_config(TINY_FL2VA, [*base, *overrides])
    assert needle in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("heldout") / "data"
    write_synthetic_dataset(folder, task="fl2va", num_samples=2, seed=7, text_dim=16)
    return str(folder)


def _args(run: Path, heldout: str, *extra: str) -> list[str]:
    return [
        "train",
        str(TINY_FL2VA),
        f"logging.dir={run}",
        "logging.progress=false",
        f"validation.dataset={heldout}",
        "validation.sigmas=[0.3,0.7]",
        "validation.every=1",
        "optim.lr=3e-2",
        *extra,
    ]


def _validation(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r.get("kind") == "validation"]


def test_the_best_checkpoint_outlives_keep_last_across_a_resume_and_is_named_at_the_end(
    tmp_path: Path, heldout: str, capsys
) -> None:
    run = tmp_path / "run"
    # The guidance turns away from the base's as the model trains fast: the best cosine is an early step.
    common = ["checkpoint.every=3", "checkpoint.keep_last=1", "checkpoint.keep_best=val/guidance_cos_video"]
    common.append("checkpoint.keep_best_mode=max")
    assert main(_args(run, heldout, "train.steps=3", *common)) == 0
    rows = _validation(run)
    best = max(rows, key=lambda r: r["val/guidance_cos_video"])["step"]
    assert best < 3, rows
    assert [step_of(p) for p in complete_checkpoints(run / "checkpoints")] == [best, 3]
    out = capsys.readouterr().out
    assert f"best checkpoint: {run / 'checkpoints' / f'step_{best:08d}'} (val/guidance_cos_video" in out
    # Resumed: the best so far is checkpoint state, still protected, still the one to beat.
    assert main(_args(run, heldout, "train.steps=6", *common)) == 0
    rows = _validation(run)
    best = max(rows, key=lambda r: r["val/guidance_cos_video"])["step"]
    assert [step_of(p) for p in complete_checkpoints(run / "checkpoints")] == sorted({best, 6})
    assert f"step_{best:08d} (val/guidance_cos_video" in capsys.readouterr().out


def test_keep_best_turned_on_at_a_resume_starts_its_comparison_there(tmp_path: Path, heldout: str, capsys) -> None:
    run = tmp_path / "run"
    assert main(_args(run, heldout, "train.steps=1", "checkpoint.every=1")) == 0
    capsys.readouterr()
    assert main(_args(run, heldout, "train.steps=2", "checkpoint.every=0", "checkpoint.keep_best=val/loss")) == 0
    out = capsys.readouterr().out
    assert "resume: step_00000001 holds no best; no checkpoint is the best yet" in out
    assert f"best checkpoint: {run / 'checkpoints' / 'step_00000002'} (val/loss" in out


def test_the_guard_warns_or_stops_with_a_checkpoint_and_exit_3(tmp_path: Path, heldout: str, capsys) -> None:
    warn = tmp_path / "warn"
    limit = "validation.guard.min_guidance_cos=0.99999"
    assert main(_args(warn, heldout, "train.steps=2", "checkpoint.every=0", limit)) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "validation.guard" in line]
    assert [line.split(":")[2].strip() for line in lines] == [
        "validation.guard after step 1",
        "validation.guard after step 2",
    ]
    assert all(line.startswith("h3train: warning: ") and "val/guidance_cos_video" in line for line in lines)

    stop = tmp_path / "stop"
    assert main(_args(stop, heldout, "train.steps=5", "checkpoint.every=0", limit, "validation.guard.action=stop")) == (
        GUARD_EXIT
    )
    err = capsys.readouterr().err
    assert "h3train: stopped by validation.guard after step 1: val/guidance_cos_video" in err
    assert [step_of(p) for p in complete_checkpoints(stop / "checkpoints")] == [1]
    assert [r["step"] for r in read_metrics(stop) if "loss" in r] == [1]
