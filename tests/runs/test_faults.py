"""Failures end in a clear message and a run that carries on correctly or stops without losing work.

Every path is exercised for real through `debug.fault` (or a really corrupted file / a really killed rank).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest
import torch

from h3train.cli import main
from h3train.config import load_config
from h3train.data.dataset_index import read_index

from helpers.launch import (
    checkpoint_dir,
    checkpoint_tensors,
    h3train_command,
    read_metrics,
    run_env,
    run_forked,
    run_h3train,
    tiny_args,
)
from helpers.paths import ROOT, TINY_FL2VA

TINY_REF2VA = ROOT / "configs" / "tiny_ref2va.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["nan_loss@2:1", "nan_grad@2:0"])
def test_non_finite_step_is_skipped_by_every_rank(tmp_path, fault) -> None:
    run_forked(
        tiny_args(
            tmp_path,
            "train.steps=3",
            "parallel.dp_shard=2",
            "checkpoint.every=1",
            "checkpoint.keep_last=0",
            f"debug.fault=[{fault}]",
        ),
        nproc=2,
    )
    metrics = read_metrics(tmp_path)
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in (metrics[0], metrics[2]))
    before, after, later = (checkpoint_tensors(checkpoint_dir(tmp_path, i)) for i in (1, 2, 3))
    assert before.keys() == after.keys() and any(k.startswith("optim.") for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed weights or AdamW state"
    assert any(not torch.equal(after[k], later[k]) for k in after), "training did not continue after the skip"


@pytest.mark.slow
def test_consecutive_non_finite_steps_stop_the_run_naming_the_step(tmp_path) -> None:
    # Two data-parallel ranks meet the error at the same step: one line names both ranks' samples.
    proc = run_forked(
        tiny_args(tmp_path, "train.steps=5", "train.max_consecutive_skips=1", "debug.fault=[nan_loss@2,nan_loss@3]"),
        nproc=2,
        check=False,
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("h3train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "step 3: 2 consecutive steps" in errors[0]
    per_rank = load_config(TINY_FL2VA, []).train.grad_accum  # one sample per micro-batch
    named = re.findall(r"synthetic-\d+", errors[0].split("the step's samples: ")[1])
    assert len(set(named)) == len(named) == 2 * per_rank, errors[0]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


def _corrupt_one_sample(data_dir) -> str:
    entry = read_index(data_dir)[0]
    path = data_dir / entry.file
    raw = bytearray(path.read_bytes())
    raw[-64:] = b"\xff" * 64  # tensor payload garbage: non-finite values
    path.write_bytes(bytes(raw))
    return entry.sample_id


@pytest.mark.slow
def test_on_error_skip_records_a_corrupt_sample_and_finishes(tmp_path) -> None:
    data = tmp_path / "data"
    common = [f"data.path={data}", "data.synthetic.num_samples=6", "train.grad_accum=1"]
    assert main(["synth", "--out", str(data), "--task", "ref2va", "--num-samples", "6", "--text-dim", "16"]) == 0
    bad = _corrupt_one_sample(data)

    run = tmp_path / "skip"
    assert main(tiny_args(run, "train.steps=6", "data.on_error=skip", *common, config=TINY_REF2VA)) == 0
    records = (run / "data_errors.jsonl").read_text().splitlines()
    assert len(records) == 1 and bad in records[0]
    assert read_metrics(run)[-1]["data_errors"] == 1 and len(read_metrics(run)) == 6

    proc = run_forked(
        tiny_args(tmp_path / "raise", "train.steps=6", "data.on_error=raise", *common, config=TINY_REF2VA), check=False
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("h3train: error: sample") and bad in last and "field" in last


@pytest.mark.slow
def test_injected_corrupt_sample_is_skipped_on_every_sp_rank(tmp_path) -> None:
    data = tmp_path / "data"
    assert main(["synth", "--out", str(data), "--task", "ref2va", "--num-samples", "4", "--text-dim", "16"]) == 0
    bad = read_index(data)[1].sample_id
    run_forked(
        tiny_args(
            tmp_path / "run",
            f"data.path={data}",
            "train.steps=2",
            "train.grad_accum=2",
            "parallel.sp=2",
            "data.on_error=skip",
            f"debug.fault=[corrupt_sample@{bad}]",
            config=TINY_REF2VA,
        ),
        nproc=2,
    )
    records = (tmp_path / "run" / "data_errors.jsonl").read_text().splitlines()
    assert len(records) == 1 and bad in records[0]  # one SP rank writes, none hangs


@pytest.mark.parametrize(
    ("overrides", "env", "needle"),
    [
        (["model.pretrained=/nonexistent/H3", "model.config={}"], {}, "'model.pretrained'"),
        (["data.source=cached", "data.path=/nonexistent/data"], {}, "'data.path'"),
        (["model.attention_backend=flash"], {}, "'model.attention_backend'"),
        (["parallel.backend=nccl"], {}, "'parallel.backend'"),
        (["parallel.sp=2"], {"WORLD_SIZE": "3"}, "'parallel"),
        (["debug.fault=[explode@1]"], {}, "'debug.fault'"),
    ],
    ids=["missing_pretrained", "missing_dataset", "flash_on_cpu", "nccl_on_cpu", "world_size", "bad_fault"],
)
def test_bad_setup_exits_2_with_one_line(tmp_path, overrides, env, needle, monkeypatch, capsys) -> None:
    # In-process: each of these must fail before a process group or a model exists.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["train", str(TINY_FL2VA), f"logging.dir={tmp_path}", *overrides]) == 2
    assert not torch.distributed.is_initialized()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_yaml_cannot_run_code(tmp_path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"train:\n  steps: !!python/object/apply:os.system ['touch {marker}']\n")
    proc = run_forked(["check", str(bad)], check=False)
    assert proc.returncode == 2 and not marker.exists()


@pytest.mark.slow
def test_dead_rank_makes_the_survivor_exit_naming_what_it_waited_for(tmp_path) -> None:
    # Two ranks launched by hand: under torchrun the agent would stop the survivor itself.
    env = run_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    cmd = h3train_command(
        tiny_args(tmp_path, "train.steps=5", "parallel.dp_shard=2", "parallel.timeout_s=30", "debug.fault=[kill@3:1]")
    )
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1
    last = outs[0][1].strip().splitlines()[-1]
    assert "rank 0: collective failed during" in last and "step 3" in last


@pytest.mark.slow
def test_torchrun_restart_resumes_and_matches_uninterrupted_run(tmp_path) -> None:
    common = ["train.steps=6", "checkpoint.every=2", "parallel.sp=2"]
    run_forked(tiny_args(tmp_path / "straight", *common), nproc=2)
    proc = run_h3train(
        tiny_args(tmp_path / "killed", *common, "debug.fault=[kill@5:1]"),
        nproc=2,
        launcher_args=("--max-restarts=1",),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000004" in proc.stdout
    straight, killed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "killed")
    assert [m["step"] for m in killed] == [1, 2, 3, 4, 5, 6]
    assert killed[-1]["loss"] == straight[-1]["loss"]
    assert killed[-1]["grad_norm"] == straight[-1]["grad_norm"]


def test_wandb_that_cannot_start_does_not_stop_training(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env = run_env(env, HOME=str(tmp_path), WANDB_SILENT="true", NETRC=str(tmp_path / "netrc"))
    args = tiny_args(tmp_path / "run", "train.steps=2", "logging.wandb.enabled=true", "logging.wandb.mode=online")
    proc = run_forked(args, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("wandb") >= 1 and "metrics.jsonl" in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


@pytest.mark.slow
def test_wandb_that_hangs_holds_no_rank_under_torchrun_sp2(tmp_path) -> None:
    """wandb's server takes the connection and never answers: no rank waits for it, one line says so."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # connections complete in the kernel and then hang: nothing accepts them
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
        env = run_env(
            env,
            HOME=str(tmp_path),
            NETRC=str(tmp_path / "netrc"),
            WANDB_MODE="online",
            WANDB_API_KEY="0" * 40,
            WANDB_BASE_URL=f"http://127.0.0.1:{server.getsockname()[1]}",
        )
        args = tiny_args(
            tmp_path / "run",
            "train.steps=4",
            "parallel.sp=2",
            # Far shorter than wandb's own timeout: a rank held by it would fail its collectives.
            "parallel.timeout_s=10",
            "logging.wandb.enabled=true",
            "logging.wandb.mode=online",
            "logging.wandb.init_timeout_s=20",
        )
        proc = run_h3train(args, nproc=2, env=env, check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    said = [line for line in proc.stderr.splitlines() if "wandb did not start" in line]
    assert len(said) == 1 and "metrics.jsonl" in said[0], proc.stderr[-3000:]
    # wandb's own console lines stay out of the run's output.
    assert not any(line.startswith("wandb:") for line in (proc.stdout + proc.stderr).splitlines())


@pytest.mark.slow
def test_a_stop_signal_while_a_step_validates_stops_on_that_steps_save(tmp_path) -> None:
    """SIGTERM to one rank after step 2's all-reduce, while it validates: both ranks save step 2 and stop,
    without training step 3 (and saving again)."""
    from h3train.data.synthetic_dataset import write_synthetic_dataset

    heldout = write_synthetic_dataset(tmp_path / "heldout", task="fl2va", num_samples=3, seed=7, text_dim=16)
    run = tmp_path / "run"
    args = tiny_args(
        run,
        "parallel.sp=1",
        "train.steps=6",
        "checkpoint.every=0",
        f"validation.dataset={heldout}",
        "validation.every=2",
        "validation.sigmas=[0.5]",
        "debug.fault=[sigterm_after_step@2:1]",
    )
    proc = run_forked(args, nproc=2)
    assert "preempted by a signal to another rank: stopped after step 2, checkpoint saved" in proc.stdout
    assert [m["step"] for m in read_metrics(run) if m.get("kind") is None] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [checkpoint_dir(run, 2).name]
