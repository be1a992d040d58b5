"""Nothing a user wrote is destroyed or silently shadowed: re-runs, resumes from older steps, corrupt
checkpoints, unwritable folders, Ctrl-C, changed schedules, file permissions.

Single-process cases call the CLI in this process (`h3train.cli.main`); the torchrun cases (sp=2)
share one run folder with checkpoints, copied by each test, because every launch costs seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import pytest
import torch

from h3train.checkpoint import committed_checkpoints, complete_checkpoints
from h3train.cli import main
from h3train.config import load_config
from h3train.infra.atomic import atomic_save_file, file_mode
from h3train.optim.kinds import lr_factor

from helpers.launch import (
    checkpoint_dir,
    h3train_command,
    read_metrics,
    run_cli,
    run_env,
    run_forked,
    run_h3train,
    signal_after_steps,
    start_in_session,
    tiny_args,
    torchrun_error_line,
)
from helpers.paths import ROOT, TINY_FL2VA

COMMON = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0"]
SP2 = ["parallel.sp=2"]


def _train_args(log_dir: Path, *extra: str) -> list[str]:
    return tiny_args(log_dir, *COMMON, *extra)


def _one_error_line(err: str, torchrun: bool = False) -> str:
    """The single `h3train: error:` line of a run that must fail cleanly (no rank's traceback).

    torchrun adds its own report of a failed worker (a traceback of the launcher and a table), after
    which the line is printed again, last.
    """
    assert ("[rank" if torchrun else "Traceback") not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("h3train: error:")]
    if torchrun:
        return torchrun_error_line(err)
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sp1_run(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 and a debug dump of step 4."""
    run = tmp_path_factory.mktemp("sp1") / "run"
    assert main(_train_args(run, "debug.dump_step=4")) == 0
    return run


@pytest.fixture
def run_copy(sp1_run, tmp_path) -> Path:
    return Path(shutil.copytree(sp1_run, tmp_path / "run"))


CKPTS = "checkpoints"
EVENT_LOGS = ("data_errors.jsonl", "loss_spikes.jsonl")


# -- re-running in a used folder ---------------------------------------------------------------


def test_fresh_run_over_an_earlier_run_is_refused_and_changes_nothing(run_copy, capsys) -> None:
    before = _snapshot(run_copy)
    rc, _, err = run_cli(capsys, _train_args(run_copy, "checkpoint.resume=none"))
    assert rc == 2
    line = _one_error_line(err)
    assert f"'{run_copy}'" in line and "--overwrite" in line and "checkpoint.resume=auto" in line
    assert _snapshot(run_copy) == before


def test_run_without_checkpoints_is_not_cut_by_a_second_run(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train_args(run, "checkpoint.every=0", "train.steps=2")) == 0
    before = _snapshot(run)
    rc, _, err = run_cli(capsys, _train_args(run, "checkpoint.every=0", "train.steps=2"))
    assert rc == 2
    line = _one_error_line(err)
    assert "metrics.jsonl" in line and "--overwrite" in line and "checkpoint.resume=auto" not in line
    assert _snapshot(run) == before


def test_overwrite_moves_the_earlier_run_aside(run_copy, capsys) -> None:
    before = _snapshot(run_copy)
    rc, out, _ = run_cli(capsys, [*_train_args(run_copy, "checkpoint.resume=none", "train.steps=2"), "--overwrite"])
    assert rc == 0
    assert f"moved the earlier run to {run_copy / 'previous-1'}" in out
    assert _snapshot(run_copy / "previous-1") == before
    assert [m["step"] for m in read_metrics(run_copy)] == [1, 2]
    assert [p.name for p in committed_checkpoints(run_copy / CKPTS)] == ["step_00000002"]


def test_resume_from_an_older_step_keeps_the_abandoned_history(run_copy, capsys) -> None:
    old_lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    old_step4 = _snapshot(checkpoint_dir(run_copy, 4))
    old_config = (run_copy / "config.yaml").read_text()
    events = {name: [{"step": 1, "sample_id": "a"}, {"step": 3, "sample_id": "b"}] for name in EVENT_LOGS}
    for name, records in events.items():
        (run_copy / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    resume = checkpoint_dir(run_copy, 2)
    # keep_last=1 would prune everything but the newest if abandoned checkpoints were candidates.
    rc, out, _ = run_cli(capsys, _train_args(run_copy, f"checkpoint.resume={resume}", "checkpoint.keep_last=1"))
    assert rc == 0 and "resumed from" in out
    assert (run_copy / "metrics.jsonl.abandoned-2").read_text().splitlines() == old_lines[2:]
    assert [m["step"] for m in read_metrics(run_copy)] == [1, 2, 3, 4]
    assert _snapshot(run_copy / CKPTS / "step_00000004.abandoned-2") == old_step4
    assert [p.name for p in committed_checkpoints(run_copy / CKPTS)] == ["step_00000004"]
    # The earlier attempt's configuration is kept beside this one's.
    assert (run_copy / "config.yaml.previous-1").read_text() == old_config
    assert f"resume: {resume}" in (run_copy / "config.yaml").read_text()
    # So are the data-error and loss-spike records of the steps being redone.
    for name, (before, after) in events.items():
        assert [json.loads(line) for line in (run_copy / name).read_text().splitlines()] == [before]
        assert json.loads((run_copy / f"{name}.abandoned-2").read_text()) == after


# -- corrupt or partial checkpoints --------------------------------------------------------------


def _truncate(ckpt: Path) -> str:
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return f"{shard.name} is truncated"


def _delete_shard(ckpt: Path) -> str:
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    return f"{shard.name} is missing"


def _bad_state(ckpt: Path) -> str:
    (ckpt / "trainer_state.json").write_text('{"step": 4, ')
    return "trainer_state.json is not valid JSON"


def _delete_metadata(ckpt: Path) -> str:
    (ckpt / ".metadata").unlink()
    return ".metadata is missing"


def _flip_bytes(ckpt: Path) -> str:
    # Same size, so the structure checks pass: the digest recorded at commit tells.
    shard = next(ckpt.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[-2000:] = bytes(b ^ 0xFF for b in raw[-2000:])
    shard.write_bytes(bytes(raw))
    return f"{shard.name} does not match the digest"


DAMAGE = {
    "truncated_shard": _truncate,
    "missing_shard": _delete_shard,
    "corrupt_state": _bad_state,
    "deleted_metadata": _delete_metadata,
    "flipped_bytes": _flip_bytes,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_corrupt_newest_checkpoint_is_set_aside_and_the_older_one_resumed(run_copy, capsys, damage) -> None:
    newest = checkpoint_dir(run_copy, 4)
    what = DAMAGE[damage](newest)
    rc, out, err = run_cli(capsys, _train_args(run_copy, "train.steps=5"))
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if "skipped checkpoint" in line]
    assert len(warnings) == 1 and what in warnings[0] and "step 4" in warnings[0], err[-2000:]
    assert f"resumed from {run_copy / CKPTS / 'step_00000002'} at step 2" in out
    assert (run_copy / CKPTS / "step_00000004.corrupt").is_dir()
    assert [m["step"] for m in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("damage", ["missing_shard", "flipped_bytes"])
def test_explicit_corrupt_checkpoint_is_one_line_and_exit_2(run_copy, capsys, damage) -> None:
    newest = checkpoint_dir(run_copy, 4)
    what = DAMAGE[damage](newest)
    rc, _, err = run_cli(capsys, _train_args(run_copy, f"checkpoint.resume={newest}", "train.steps=5"))
    assert rc == 2
    line = _one_error_line(err)
    assert str(newest) in line and what in line
    assert newest.is_dir()  # an explicit choice is never renamed


# -- unwritable folders --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["checkpoint.dir", "logging.dir"])
def test_unwritable_folder_is_found_before_training(tmp_path, capsys, key) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad in ("/proc/h3c", str(a_file), str(a_file / "sub")):
        rc, _, err = run_cli(capsys, _train_args(tmp_path / "run", f"{key}={bad}"))
        assert rc == 2
        line = _one_error_line(err)
        assert f"'{key}'" in line and bad in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- the LR schedule on resume and across skipped steps -----------------------------------------


def test_changed_schedule_on_resume_runs_what_config_yaml_records(run_copy, capsys) -> None:
    overrides = ["optim.lr=1e-2", "train.steps=8", "optim.warmup_steps=3"]
    rc, out, _ = run_cli(capsys, _train_args(run_copy, *overrides))
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("resume:")]
    assert len(lines) == 1
    assert all(change in lines[0] for change in ("optim.lr 0.001 -> 0.01", "train.steps 4 -> 8"))
    cfg = load_config(run_copy / "config.yaml")
    assert cfg.optim.lr == 1e-2 and cfg.train.steps == 8
    logged = {m["step"]: m["lr"] for m in read_metrics(run_copy)}
    # The update of step k uses schedule position k - 1 (no step was skipped).
    for step in range(5, 9):
        assert logged[step] == cfg.optim.lr * lr_factor(step - 1, cfg.optim, cfg.train.steps)


def test_skipped_non_finite_steps_do_not_advance_the_schedule(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = _train_args(run, "train.steps=5", "optim.warmup_steps=4", "debug.fault=[nan_loss@2]")
    assert main(args) == 0
    metrics = read_metrics(run)
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 1, 1]
    cfg = load_config(TINY_FL2VA, args[2:])
    positions = [0, 1, 1, 2, 3]  # step 2 was skipped: step 3 uses the position step 2 would have
    assert [m["lr"] for m in metrics] == [cfg.optim.lr * lr_factor(p, cfg.optim, 5) for p in positions]
    # The position survives a resume: the resumed run continues at the same learning rate.
    assert main(_train_args(run, "train.steps=6", "optim.warmup_steps=4")) == 0
    assert read_metrics(run)[-1]["lr"] == cfg.optim.lr * lr_factor(4, cfg.optim, 6)


# -- files readable on shared storage --------------------------------------------------------------


def test_checkpoints_and_safetensors_get_the_umask_mode(tmp_path, sp1_run) -> None:
    expected = file_mode()
    files = [p for folder in (CKPTS, "dump") for p in (sp1_run / folder).rglob("*") if p.is_file()]
    assert any(p.name == "grads.safetensors" for p in files)
    assert files and not [p for p in files if p.name.startswith("rng_rank")]  # the dead RNG files are gone
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == dict.fromkeys((p.name for p in files), expected)
    old = os.umask(0o002)
    try:
        atomic_save_file({"x": torch.zeros(2)}, tmp_path / "x.safetensors", metadata={})
        assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_checkpoint_state_is_one_dict_of_named_components(sp1_run) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(checkpoint_dir(sp1_run, 4))).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in keys} == {"model", "optim", "schedule", "sampler", "progress"}
    state = json.loads((checkpoint_dir(sp1_run, 4) / "trainer_state.json").read_text())
    assert {"step", "commit", "model_config", "config_yaml"} <= set(state)
    assert state["step"] == 4 and state["commit"] == 2


# -- Ctrl-C ------------------------------------------------------------------------------------------


def _stop_with(signum: int, log_dir: Path, nproc: int = 1, extra: tuple[str, ...] = (), group: bool = False):
    """Start a long run (no periodic saves), wait for two logged steps, send `signum` to the launcher (with
    `group`, to the launcher and its workers, as a terminal's Ctrl-C does)."""
    cmd = h3train_command(tiny_args(log_dir, "train.steps=100000", "checkpoint.every=0", *extra), nproc=nproc)
    proc = start_in_session(cmd, run_env())
    out, err = signal_after_steps(proc, log_dir, signum, steps=2, group=group)
    saved = committed_checkpoints(log_dir / "checkpoints")
    assert len(saved) == 1 and int(saved[0].name[5:]) == read_metrics(log_dir)[-1]["step"]
    return proc.returncode, out, err


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_without_traceback(tmp_path) -> None:
    rc, out, err = _stop_with(signal.SIGINT, tmp_path / "run")
    assert rc == 130, err[-2000:]
    assert "Traceback" not in err
    assert out.count("interrupted by SIGINT") == 1 and "checkpoint saved" in out


@pytest.mark.slow
@pytest.mark.parametrize("write", ["sync", "async"])
def test_a_second_ctrl_c_during_the_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, write) -> None:
    # Ctrl-C before step 3 asks for a save after it; a second Ctrl-C comes while that save writes its
    # shards: inside DCP's save, or during the wait for a background one.
    run = tmp_path / "run"
    args = _train_args(run, "checkpoint.every=1", f"checkpoint.async_save={write == 'async'}")
    proc = run_forked([*args, "debug.fault=[sigint@3,sigint_in_save@3]"], check=False)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("h3train:")]
    assert said == [
        f"h3train: interrupted during the save of step 3; the checkpoint of step 2 is kept "
        f"({checkpoint_dir(run, 2)}): resume with checkpoint.resume=auto"
    ], proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == said[0]
    # The cut-short save never got a checkpoint's name; the one before it is whole.
    partial = run / CKPTS / ".tmp-step_00000003"
    assert partial.is_dir()
    assert [p.name for p in committed_checkpoints(run / CKPTS)] == ["step_00000001", "step_00000002"]
    assert [p.name for p in complete_checkpoints(run / CKPTS)] == ["step_00000001", "step_00000002"]

    rc, out, _ = run_cli(capsys, args)
    assert rc == 0 and f"resumed from {checkpoint_dir(run, 2)}" in out
    assert not partial.exists()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    assert [p.name for p in complete_checkpoints(run / CKPTS)] == [f"step_0000000{i}" for i in (1, 2, 3, 4)]


# -- the same under torchrun with sp=2 ------------------------------------------------------------


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sp2") / "run"
    run_forked(_train_args(run, *SP2), nproc=2)
    return run


def _torchrun(args: list[str]):
    """A failing sp=2 run under torchrun itself: what the launcher prints around the run's one line."""
    return run_h3train(args, nproc=2, check=False)


def _ranks(args: list[str]):
    """A run that must succeed, on two forked ranks (what it computes and writes, not the launcher)."""
    return run_forked(args, nproc=2)


@pytest.mark.slow
def test_sp2_rerun_policy(sp2_run, tmp_path) -> None:
    run = Path(shutil.copytree(sp2_run, tmp_path / "run"))
    before = _snapshot(run)
    proc = _torchrun(_train_args(run, *SP2, "checkpoint.resume=none"))
    assert proc.returncode != 0
    assert "--overwrite" in _one_error_line(proc.stderr, torchrun=True)
    assert _snapshot(run) == before

    # Resume from the older step with a changed LR: history kept aside, the new LR runs.
    resume = checkpoint_dir(run, 2)
    proc = _ranks(_train_args(run, *SP2, f"checkpoint.resume={resume}", "optim.lr=1e-2"))
    assert proc.stdout.count("resume: optim.lr 0.001 -> 0.01") == 1
    assert (run / "metrics.jsonl.abandoned-2").read_text().splitlines() == before["metrics.jsonl"].decode().split("\n")[
        2:4
    ]
    assert (run / CKPTS / "step_00000004.abandoned-2" / ".metadata").is_file()
    cfg = load_config(run / "config.yaml")
    assert read_metrics(run)[3]["lr"] == 1e-2 * lr_factor(3, cfg.optim, cfg.train.steps)

    proc = _ranks([*_train_args(run, *SP2, "checkpoint.resume=none", "train.steps=1"), "--overwrite"])
    assert (run / "previous-1" / "metrics.jsonl.abandoned-2").is_file()
    assert [m["step"] for m in read_metrics(run)] == [1]


@pytest.mark.slow
def test_sp2_checkpoints_reexport_only_with_overwrite(sp2_run, tmp_path, capsys) -> None:
    import torch.distributed.checkpoint as dcp
    from diffusers import MiniMaxH3Transformer3DModel
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "export"
    step2, step4 = checkpoint_dir(sp2_run, 2), checkpoint_dir(sp2_run, 4)
    assert run_cli(capsys, ["export", str(step4), "--out", str(out)])[0] == 0
    before = _snapshot(out)
    rc, _, err = run_cli(capsys, ["export", str(step2), "--out", str(out)])
    assert rc == 2 and "--overwrite" in _one_error_line(err) and _snapshot(out) == before
    assert run_cli(capsys, ["export", str(step2), "--out", str(out), "--overwrite"])[0] == 0
    # The folder holds step 2's weights, as the sp=2 ranks saved them, and nothing of step 4's export.
    reader = FileSystemReader(str(step2))
    meta = reader.read_metadata().state_dict_metadata
    saved = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    dcp.load(saved, storage_reader=reader, no_dist=True)
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32).state_dict()
    assert loaded.keys() == {k.removeprefix("model.transformer.") for k in saved}
    assert all(torch.equal(loaded[k.removeprefix("model.transformer.")], v) for k, v in saved.items())


@pytest.mark.slow
def test_sp2_corrupt_newest_checkpoint(sp2_run, tmp_path) -> None:
    run = Path(shutil.copytree(sp2_run, tmp_path / "run"))
    newest = checkpoint_dir(run, 4)
    # Rank 1's shard: only rank 0 checks the files, every rank must follow its decision.
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:500])
    proc = _torchrun(_train_args(run, *SP2, f"checkpoint.resume={newest}", "train.steps=5"))
    assert proc.returncode != 0
    assert "__1_0.distcp is truncated" in _one_error_line(proc.stderr, torchrun=True)

    proc = _ranks(_train_args(run, *SP2, "train.steps=5"))
    assert proc.stderr.count("skipped checkpoint") == 1 and "__1_0.distcp is truncated" in proc.stderr
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout
    assert (run / CKPTS / "step_00000004.corrupt").is_dir()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_sp2_a_checkpoint_that_does_not_fit_is_said_once(sp2_run, tmp_path) -> None:
    # Every rank finds the sampler state of another dataset size: one line, not one per rank.
    run = Path(shutil.copytree(sp2_run, tmp_path / "run"))
    proc = _torchrun(_train_args(run, *SP2, "data.synthetic.num_samples=5", "train.steps=5"))
    assert proc.returncode != 0
    line = _one_error_line(proc.stderr, torchrun=True)
    assert "its sampler state does not fit this run" in line and "5 samples" in line


@pytest.mark.slow
def test_sp2_unwritable_checkpoint_dir_is_found_at_start(tmp_path) -> None:
    proc = _torchrun(_train_args(tmp_path / "run", *SP2, "checkpoint.dir=/proc/h3c"))
    assert proc.returncode != 0
    assert "'checkpoint.dir'" in _one_error_line(proc.stderr, torchrun=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sp2_ctrl_c_and_sigterm_to_the_launcher_checkpoint(tmp_path) -> None:
    # torchrun passes the signal on to the ranks; they save the same step and rank 0 says why.
    # What the README says bare torchrun prints: its own SignalException traceback, and exit 1.
    rc, out, err = _stop_with(signal.SIGINT, tmp_path / "int", nproc=2, extra=tuple(SP2))
    assert out.count("interrupted by SIGINT: stopped after step") == 1
    assert "[rank" not in err  # no rank raised: only torchrun's own report of the signal
    assert rc == 1 and "Received 2 death signal" in err and "SignalException" in err, err[-3000:]
    rc, out, err = _stop_with(signal.SIGTERM, tmp_path / "term", nproc=2, extra=tuple(SP2))
    assert out.count("preempted by SIGTERM: stopped after step") == 1 and "checkpoint saved" in out
    assert "[rank" not in err
    assert rc == 1 and "Received 15 death signal" in err and "SignalException" in err, err[-3000:]
    # A Ctrl-C in the terminal reaches each worker twice, the terminal's and torchrun's: one keypress,
    # so the ranks save (`_stop_with` checks the checkpoint) rather than stop at once. How torchrun
    # itself then ends varies with its version (torch 2.8's aborts), so only the ranks are held here.
    rc, out, err = _stop_with(signal.SIGINT, tmp_path / "tty", nproc=2, extra=tuple(SP2), group=True)
    assert out.count("interrupted by SIGINT: stopped after step") == 1 and "checkpoint saved" in out, err[-3000:]
    assert "[rank" not in err and "h3train: interrupted during" not in err, err[-3000:]


def test_tiny_configs_checkpoint_what_the_readme_exports() -> None:
    for name in ("tiny_demo", "tiny_fl2va", "tiny_ref2va", "tiny_ref2va_cfg"):
        assert load_config(ROOT / "configs" / f"{name}.yaml").checkpoint.every > 0, name
    # The README exports the run folder of the tiny config as it is: its logging.dir.
    example = re.search(r"h3train export (runs/tiny_fl2va\S*) --out", (ROOT / "README.md").read_text())
    assert example is not None and example.group(1) == load_config(TINY_FL2VA).logging.dir


def test_checkpoint_without_a_component_of_this_run_is_exit_2_and_kept(run_copy) -> None:
    import torch.distributed as dist

    from h3train.errors import CheckpointError
    from h3train.run.assemble import build_trainer
    from h3train.train.hooks import TrainerHook

    class Counter(TrainerHook):
        """A stateful hook the checkpoint was written without, and which cannot start afresh."""

        name = "counter"

        def state_dict(self):
            return {"count": 0}

        def load_state_dict(self, state) -> None:
            pass

    cfg = load_config(TINY_FL2VA, _train_args(run_copy, "train.steps=5")[2:])
    try:
        with pytest.raises(CheckpointError, match=r"step_00000004.* holds no state for counter"):
            build_trainer(cfg, hooks=[Counter()])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # It does not fit; it is not corrupt: nothing is set aside.
    assert sorted(p.name for p in (run_copy / CKPTS).iterdir()) == ["step_00000002", "step_00000004"]


def test_an_ema_switched_on_at_resume_starts_from_the_resumed_weights(run_copy, capsys) -> None:
    rc, out, _ = run_cli(capsys, _train_args(run_copy, "train.steps=5", "train.ema.decay=0.9"))
    assert rc == 0 and "step_00000004 holds no ema; it starts from the resumed weights" in out


def test_a_second_ctrl_c_is_noted_in_the_one_record_the_cli_reads() -> None:
    from h3train.commands import process
    from h3train.train.events import Interrupts
    from h3train.train.preemption import INTERRUPT, Preemption

    assert Preemption().interrupts is process.CTRL_C.record
    record, now = Interrupts(), [100.0]
    preempt = Preemption(record, clock=lambda: now[0])
    preempt._handle(signal.SIGINT, None)
    # The first asks for a save after the step: nothing is raised, so nothing to mistake for an error.
    assert not record.noted and not record.caused(ValueError("x"))
    # The same keypress again, forwarded by torchrun a moment later, is not a second Ctrl-C.
    now[0] += 0.05
    preempt._handle(signal.SIGINT, None)
    assert not record.noted and preempt.flag == INTERRUPT
    now[0] += 1.0
    with pytest.raises(KeyboardInterrupt):
        preempt._handle(signal.SIGINT, None)
    # What a save raises after it (DCP's CheckpointException is a BaseException) is the interrupt; an exit is not.
    assert record.caused(ValueError("x")) and record.caused(BaseException("checkpoint"))
    assert not record.caused(SystemExit(1))
