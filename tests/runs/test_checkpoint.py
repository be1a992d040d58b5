"""Save, resume (same and other layouts), preemption and crash safety of checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest

from h3train.checkpoint import complete_checkpoints, step_dir_name

from helpers.launch import (
    checkpoint_dir,
    checkpoint_tensors,
    h3train_command,
    read_metrics,
    run_env,
    run_forked,
    signal_after_steps,
    start_in_session,
    tiny_args,
    tiny_overrides,
    train,
)
from helpers.paths import TINY_FL2VA
from helpers.runs import TrainedRuns

COMMON = ["train.steps=6", "optim.schedule=cosine", "optim.warmup_steps=2"]
SP2 = (2, ("parallel.sp=2",))
SP1 = (1, ())
DP2 = (2, ("parallel.dp_shard=2", "train.grad_accum=2"))
# The global batch of DP2 (2 ranks x 2 micro-batches) in one rank and in four.
DP1 = (1, ("train.grad_accum=4",))
DP4 = (4, ("parallel.dp_shard=4", "train.grad_accum=1"))
EVERY_2 = ("checkpoint.every=2", "checkpoint.keep_last=0")


def _train(log_dir, extra=(), nproc=1, check=True):
    return run_forked(tiny_args(log_dir, *COMMON, *extra), nproc=nproc, check=check)


def _curve(log_dir) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(log_dir)]


class Runs:
    """Straight runs and runs preempted at step 3 (`trained_runs`, each launched once), copied on use."""

    def __init__(self, trained_runs: TrainedRuns) -> None:
        self.trained_runs = trained_runs

    def straight(self, layout: tuple):
        # The sp=1 one saves every second step too: the async save is compared with it.
        nproc, overrides = layout
        extra = [*overrides, *(EVERY_2 if layout == SP1 else ())]
        return self.trained_runs.get(*COMMON, *extra, nproc=nproc, forked=True).dir

    def preempted_copy(self, layout: tuple, dest):
        nproc, overrides = layout
        run = self.trained_runs.get(*COMMON, *overrides, "debug.fault=[sigterm@3]", nproc=nproc, forked=True)
        assert "preempted" in run.stdout
        assert [m["step"] for m in read_metrics(run.dir)] == [1, 2, 3]
        shutil.copytree(run.dir, dest)
        return dest


@pytest.fixture(scope="module")
def runs(trained_runs: TrainedRuns) -> Runs:
    return Runs(trained_runs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [SP1, SP2], ids=["sp1", "sp2"])
def test_interrupted_run_resumes_bitwise(runs, tmp_path, layout) -> None:
    resumed = runs.preempted_copy(layout, tmp_path / "resumed")
    proc = _train(resumed, layout[1], layout[0])
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout
    assert _curve(resumed) == _curve(runs.straight(layout))
    # The schedule is rebuilt from the config at the saved position: the same learning rates, bit for bit.
    assert [m["lr"] for m in read_metrics(resumed)] == [m["lr"] for m in read_metrics(runs.straight(layout))]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "resumed"),
    [(SP2, SP1), (SP1, SP2), (DP2, DP1), (DP2, DP4)],
    # One rank in float32 trains plain tensors, more ranks DTensors: DCP reshards both ways. Sharded
    # over 2 and 4 ranks, the AdaLN projections are computed where their weights live, resharded too.
    ids=["sp2_to_sp1", "sp1_to_sp2", "dp_shard2_to_1", "dp_shard2_to_4"],
)
def test_resume_on_another_layout_continues_the_same_run(runs, tmp_path, saved, resumed) -> None:
    path = runs.preempted_copy(saved, tmp_path / "resumed")
    _train(path, resumed[1], resumed[0])
    straight, other = _curve(runs.straight(saved)), _curve(path)
    assert [s for s, _, _ in other] == [1, 2, 3, 4, 5, 6]
    for (_, loss_a, norm_a), (_, loss_b, norm_b) in zip(straight, other):
        assert loss_b == pytest.approx(loss_a, rel=1e-6)
        assert norm_b == pytest.approx(norm_a, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("write", ["sync", "async"])
def test_kill_during_save_keeps_previous_checkpoint(runs, tmp_path, write) -> None:
    # Async: the kill lands while step 2's shards are written in the background.
    run = tmp_path / "crashed"
    mode = f"checkpoint.async_save={write == 'async'}"
    proc = _train(run, ["checkpoint.every=1", "debug.fault=[kill_in_save@2]", mode], check=False)
    assert proc.returncode == -signal.SIGKILL
    ckpt = run / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000001"]
    assert (ckpt / ".tmp-step_00000002").is_dir()  # the half-written save, never loadable

    again = _train(run, ["checkpoint.every=1", "checkpoint.keep_last=3", mode])
    assert "step_00000001" in again.stdout
    assert not (ckpt / ".tmp-step_00000002").exists()
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000004", "step_00000005", "step_00000006"]
    # Step 2 was redone: the log has each step once and ends where the straight run ends.
    assert _curve(run) == _curve(runs.straight(SP1))


@pytest.mark.slow
def test_async_save_writes_what_the_step_held_and_resumes_bitwise(runs, tmp_path) -> None:
    """Training goes on while the shards are written: the checkpoint still holds the saved step's state."""
    import torch

    sync, background = runs.straight(SP1), tmp_path / "async"
    proc = _train(background, [*EVERY_2, "checkpoint.async_save=true"])
    assert proc.stdout.count("saving checkpoint") == 3 and proc.stdout.count("saved checkpoint") == 3
    assert _curve(background) == _curve(sync)
    for step in (2, 4):
        a, b = checkpoint_tensors(checkpoint_dir(sync, step)), checkpoint_tensors(checkpoint_dir(background, step))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    resumed = tmp_path / "resumed"
    shutil.copytree(background, resumed)
    _train(resumed, [f"checkpoint.resume={checkpoint_dir(resumed, 4)}", "checkpoint.async_save=true"])
    assert _curve(resumed) == _curve(sync)


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path) -> None:
    log_dir = tmp_path / "run"
    # checkpoint.every=0: only the preemption saves
    proc = start_in_session(h3train_command(tiny_args(log_dir, "train.steps=100000", "checkpoint.every=0")), run_env())
    out, err = signal_after_steps(proc, log_dir, signal.SIGTERM, steps=2)
    assert proc.returncode == 0, err[-2000:]
    saved = complete_checkpoints(log_dir / "checkpoints")
    assert len(saved) == 1
    assert int(saved[0].name.split("_")[1]) == read_metrics(log_dir)[-1]["step"]


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    train(tiny_args(tmp_path, *COMMON, "train.steps=1", "checkpoint.every=1"))
    proc = _train(tmp_path, ["model.config.hidden_size=48"], check=False)
    assert proc.returncode == 2
    assert "'model.config.hidden_size'" in proc.stderr and proc.stderr.strip().count("\n") == 0


def _fake_checkpoint(root, step: int, commit: int, mtime: float):
    from h3train.checkpoint import STATE_FILE

    path = root / step_dir_name(step)
    path.mkdir()
    (path / ".metadata").write_text("")
    (path / STATE_FILE).write_text(json.dumps({"step": step, "commit": commit}))
    os.utime(path / STATE_FILE, (mtime, mtime))
    return path


def _join_prune_threads() -> None:
    for thread in threading.enumerate():
        if thread.name == "checkpoint-prune":
            thread.join()


def test_commit_order_comes_from_the_commit_record_not_mtimes(tmp_path) -> None:
    from h3train.checkpoint import Checkpointer

    # Resumed from step 100 while 200 and 300 existed: 150 is the newest commit. The mtimes run the
    # other way, as after copying the run folder.
    for commit, step in enumerate((100, 200, 300, 150), start=1):
        _fake_checkpoint(tmp_path, step, commit, mtime=5000 - commit)
    assert [p.name[5:] for p in complete_checkpoints(tmp_path)] == ["00000100", "00000200", "00000300", "00000150"]
    Checkpointer(tmp_path, keep_last=2, is_main=True)._prune(keep=tmp_path / step_dir_name(150))
    _join_prune_threads()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000300", "step_00000150"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000150", "step_00000300"]


def test_prune_never_retires_later_checkpoints_this_run_did_not_write(tmp_path) -> None:
    from h3train.checkpoint import Checkpointer

    # Resumed from step 100 while 200 existed (an explicit resume would have renamed it aside).
    for commit, step in enumerate((100, 200, 110, 120), start=1):
        _fake_checkpoint(tmp_path, step, commit, mtime=1000 + commit)
    ckpt = Checkpointer(tmp_path, keep_last=1, is_main=True)
    ckpt.protected_after = 100  # resumed from step 100; it wrote 110 and 120
    ckpt.written = {step_dir_name(110), step_dir_name(120)}
    ckpt._prune(keep=tmp_path / step_dir_name(120))
    _join_prune_threads()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000120", "step_00000200"]


# -- async save: the snapshot is taken before the state changes -----------------------------------


def _in_process_trainer(log_dir, hooks):
    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    overrides = tiny_overrides(log_dir, "train.steps=4", "checkpoint.async_save=true")
    return build_trainer(load_config(TINY_FL2VA, [*overrides, "checkpoint.keep_last=0"]), hooks=hooks)


def _sync_copy(trainer, root):
    """The checkpoint state as it is now, written by a plain (blocking) save of its own."""
    from h3train.checkpoint import Checkpointer

    path = Checkpointer(root, keep_last=0, is_main=True).save(trainer.parts.checkpoint_state, {}, trainer.step)
    return checkpoint_tensors(path)


def _differing(a: dict, b: dict) -> list[str]:
    """The keys whose tensors differ (both checkpoints must hold the same keys)."""
    import torch

    assert a.keys() == b.keys()
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def test_async_save_holds_the_state_at_the_save_although_the_next_update_follows_at_once(tmp_path) -> None:
    """The step after an async save updates weights and AdamW moments only once the copy is taken."""
    trainer = _in_process_trainer(tmp_path / "run", hooks=[])
    try:
        trainer.train_step(1)  # AdamW's moments exist from here on
        trainer.step = 1
        expected = _sync_copy(trainer, tmp_path / "expected")
        path = trainer.save_checkpoint()
        trainer.train_step(2)
        trainer.step = 2
        trainer.parts.checkpointer.wait()
        later = _sync_copy(trainer, tmp_path / "later")
    finally:
        trainer.close()
    assert _differing(expected, checkpoint_tensors(path)) == []
    # The step did change the checkpointed tensors: a copy taken after it would differ.
    changed = _differing(expected, later)
    assert any(k.startswith("model.") for k in changed) and any(k.startswith("optim.") for k in changed)


def test_async_save_holds_the_weights_not_the_ema_swapped_in_before_the_next_update(tmp_path) -> None:
    """Validation with the EMA can run before the next update (after a skipped step): it waits for the copy."""
    from h3train.train.ema import EmaHook

    ema = EmaHook(0.5)
    trainer = _in_process_trainer(tmp_path / "run", hooks=[ema])
    try:
        trainer.train_step(1)
        ema.after_step(trainer, 1, {})  # the EMA now differs from the weights
        trainer.step = 1
        expected = _sync_copy(trainer, tmp_path / "expected")
        path = trainer.save_checkpoint()
        with ema.swapped_in():
            trainer.parts.checkpointer.wait_staged()  # the copy, if still to come, sees the EMA in the weights
            with_ema = _sync_copy(trainer, tmp_path / "with_ema")
        trainer.parts.checkpointer.wait()
    finally:
        trainer.close()
    assert _differing(expected, checkpoint_tensors(path)) == []
    assert any(k.startswith("model.") for k in _differing(expected, with_ema))


def test_async_save_commits_once_written_without_waiting_for_the_next_save(tmp_path) -> None:
    """A crash after the background write, before the next save, still finds the checkpoint committed."""
    trainer = _in_process_trainer(tmp_path / "run", hooks=[])
    try:
        trainer.train_step(1)
        trainer.step = 1
        path = trainer.save_checkpoint()
        pending = trainer.parts.checkpointer._pending
        pending.committed.result(timeout=60)
        # Nothing on the training thread has waited for the save: the writer thread committed it.
        assert trainer.parts.checkpointer._pending is pending
        assert complete_checkpoints(path.parent) == [path]
        assert json.loads((path / "trainer_state.json").read_text())["step"] == 1
        assert trainer.parts.checkpointer.wait() == path
    finally:
        trainer.close()
