"""Save, resume (same and other layouts), preemption and crash safety of checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from h3train.train.checkpoint import complete_checkpoints

from reference import ROOT, TINY_FL2VA, read_metrics, run_h3train

COMMON = ["train.steps=6", "logging.progress=false", "optim.schedule=cosine", "optim.warmup_steps=2"]


def _train(log_dir, extra=(), nproc=1, check=True):
    return run_h3train(["train", str(TINY_FL2VA), f"logging.dir={log_dir}", *COMMON, *extra], nproc=nproc,
                       check=check)


def _curve(log_dir) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(log_dir)]


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "layout"), [(1, []), (2, ["parallel.sp=2"])])
def test_interrupted_run_resumes_bitwise(tmp_path, nproc, layout) -> None:
    _train(tmp_path / "straight", layout, nproc)
    # Preempted at step 3 (a SIGTERM raised by the run itself), then a fresh process resumes.
    first = _train(tmp_path / "resumed", [*layout, "debug.fault=[sigterm@3]"], nproc)
    assert "preempted" in first.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == [1, 2, 3]
    second = _train(tmp_path / "resumed", layout, nproc)
    assert "resumed from" in second.stdout and "step_00000003" in second.stdout
    assert _curve(tmp_path / "resumed") == _curve(tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((2, ["parallel.sp=2", "train.grad_accum=2"]), (1, ["train.grad_accum=2"])),
        # The global batch stays 2 samples: 2 DP ranks x 1 micro-batch = 1 rank x 2 micro-batches.
        ((2, ["parallel.dp_shard=2", "train.grad_accum=1"]), (1, ["train.grad_accum=2"])),
        ((1, ["train.grad_accum=2"]), (2, ["parallel.sp=2", "train.grad_accum=2"])),
    ],
    ids=["sp2_to_sp1", "dp_shard2_to_1", "sp1_to_sp2"],
)
def test_resume_on_another_layout_continues_the_same_run(tmp_path, saved, resumed) -> None:
    _train(tmp_path / "straight", saved[1], saved[0])
    _train(tmp_path / "resumed", [*saved[1], "debug.fault=[sigterm@3]"], saved[0])
    _train(tmp_path / "resumed", resumed[1], resumed[0])
    straight, other = _curve(tmp_path / "straight"), _curve(tmp_path / "resumed")
    assert [s for s, _, _ in other] == [1, 2, 3, 4, 5, 6]
    for (_, loss_a, norm_a), (_, loss_b, norm_b) in zip(straight, other):
        assert loss_b == pytest.approx(loss_a, rel=1e-6)
        assert norm_b == pytest.approx(norm_a, rel=1e-6)


@pytest.mark.slow
def test_kill_during_save_keeps_previous_checkpoint(tmp_path) -> None:
    _train(tmp_path / "straight")
    run = tmp_path / "crashed"
    proc = _train(run, ["checkpoint.every=1", "debug.fault=[kill_in_save@2]"], check=False)
    assert proc.returncode == -signal.SIGKILL
    ckpt = run / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000001"]
    assert (ckpt / ".tmp-step_00000002").is_dir()  # the half-written save, never loadable

    again = _train(run, ["checkpoint.every=1", "checkpoint.keep_last=3"])
    assert "step_00000001" in again.stdout
    assert not (ckpt / ".tmp-step_00000002").exists()
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000004", "step_00000005", "step_00000006"]
    # Step 2 was redone: the log has each step once and ends where the straight run ends.
    assert _curve(run) == _curve(tmp_path / "straight")


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path) -> None:
    log_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "h3train", "train", str(TINY_FL2VA), f"logging.dir={log_dir}",
           "train.steps=100000", "logging.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = log_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = complete_checkpoints(log_dir / "checkpoints")
    assert len(saved) == 1
    assert int(saved[0].name.split("_")[1]) == read_metrics(log_dir)[-1]["step"]


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    _train(tmp_path, ["train.steps=1", "checkpoint.every=1"])
    proc = _train(tmp_path, ["model.config.hidden_size=48"], check=False)
    assert proc.returncode == 2
    assert "'model.config.hidden_size'" in proc.stderr and proc.stderr.strip().count("\n") == 0
