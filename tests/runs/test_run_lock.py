"""One writer per folder: the run lock, its takeover, and clean-up that deletes only what h3train marked."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from h3train.cli import main
from h3train.infra.runlock import LOCK_NAME, OWNER_NAME, STALE_AFTER_S, RunLock, writer_record

from helpers.launch import (
    checkpoint_dir,
    h3train_command,
    read_metrics,
    run_env,
    start_in_session,
    tiny_args,
    torchrun_error_line,
)


def _lines(capsys: pytest.CaptureFixture) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _write_lock(folder: Path, **fields) -> Path:
    """A lock file as another writer would have left it: this process's identity with `fields` changed."""
    folder.mkdir(parents=True, exist_ok=True)
    record = writer_record("another-writer") | fields
    (folder / LOCK_NAME).write_text(json.dumps(record))
    return folder / LOCK_NAME


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        pid -= 1


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run, checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(tiny_args(run, "train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=0")) == 0
    return run


def test_a_finished_run_leaves_no_lock_and_its_checkpoint_folder_clean(finished: Path) -> None:
    assert not (finished / LOCK_NAME).exists() and not (finished / "checkpoints" / LOCK_NAME).exists()
    assert not any(p.name.startswith(".tmp-") for p in (finished / "checkpoints").iterdir())


def test_a_second_run_into_a_held_folder_is_exit_2_naming_the_holder(tmp_path, capsys) -> None:
    shared = tmp_path / "shared-checkpoints"
    holder = RunLock([(shared, f"checkpoint.dir '{shared}'")])
    holder.acquire()
    try:
        run = tmp_path / "run"
        assert main(tiny_args(run, "train.steps=1", f"checkpoint.dir={shared}")) == 2
        (line,) = _lines(capsys)
        assert f"checkpoint.dir '{shared}' is in use by another run" in line
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in line and "last heartbeat" in line
        assert not dist.is_initialized()
        assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
        # The holder's lock is untouched, and so is the logging.dir lock the refused run had taken.
        assert json.loads((shared / LOCK_NAME).read_text())["token"] == holder.token
        assert not (run / LOCK_NAME).exists()
    finally:
        holder.release()
    assert not (shared / LOCK_NAME).exists()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"pid": "dead"}, "its process is gone"),
        ({"host": "node-17", "heartbeat": time.time() - STALE_AFTER_S - 5}, "no heartbeat for"),
    ],
    ids=["dead_process_here", "silent_elsewhere"],
)
def test_a_stale_lock_is_taken_over_with_one_line(tmp_path, capsys, fields: dict, reason: str) -> None:
    run = tmp_path / "run"
    fields = {k: (_dead_pid() if v == "dead" else v) for k, v in fields.items()}
    _write_lock(run, **fields)
    assert main(tiny_args(run, "train.steps=1", "checkpoint.every=0")) == 0
    notes = [line for line in _lines(capsys) if "took over the lock" in line]
    assert len(notes) == 1 and reason in notes[0] and f"logging.dir '{run}'" in notes[0]
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert not (run / LOCK_NAME).exists()


def test_a_live_lock_on_another_host_is_respected(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    lock = _write_lock(run, host="node-17", pid=1, heartbeat=time.time() - 60)
    assert main(tiny_args(run, "train.steps=1")) == 2
    (line,) = _lines(capsys)
    assert "is in use by another run (host node-17, pid 1" in line and str(lock) in line
    assert json.loads(lock.read_text())["token"] == "another-writer"


def _in_slurm_job(monkeypatch: pytest.MonkeyPatch, job: str | None, restart: int | None) -> None:
    """This process as a step of Slurm job `job` at restart `restart` (None: the variable unset)."""
    for name, value in (("SLURM_JOB_ID", job), ("SLURM_RESTART_COUNT", restart)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def test_the_lock_records_the_slurm_job_and_its_restart(tmp_path, monkeypatch) -> None:
    _in_slurm_job(monkeypatch, "4242", 3)
    lock = RunLock([(tmp_path, "logging.dir")])
    lock.acquire()
    try:
        record = json.loads((tmp_path / LOCK_NAME).read_text())
    finally:
        lock.release()
    assert (record["slurm_job_id"], record["slurm_restart_count"]) == ("4242", 3)
    _in_slurm_job(monkeypatch, None, None)
    assert "slurm_job_id" not in writer_record("t") and "slurm_restart_count" not in writer_record("t")


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_host_at_once(tmp_path, capsys, monkeypatch) -> None:
    """Killed before it released the lock, on a node whose pid cannot be checked from here, seconds ago."""
    run = tmp_path / "run"
    _write_lock(run, host="node-17", pid=1, heartbeat=time.time() - 5, slurm_job_id="4242", slurm_restart_count=0)
    _in_slurm_job(monkeypatch, "4242", 1)
    assert main(tiny_args(run, "train.steps=1", "checkpoint.every=0")) == 0
    notes = [line for line in _lines(capsys) if "took over the lock" in line]
    assert len(notes) == 1 and f"logging.dir '{run}'" in notes[0], notes
    assert "left by restart 0 of this Slurm job 4242, now at restart 1" in notes[0]
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert not (run / LOCK_NAME).exists()


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (("4242", 1), ("9999", 0)),
        (("4242", 1), ("4242", 1)),
        (("4242", 1), ("4242", 2)),
        ((None, None), ("4242", 0)),
    ],
    ids=["another_job", "same_job_same_restart", "same_job_later_restart", "not_under_slurm"],
)
def test_a_young_lock_on_another_host_is_respected_unless_it_is_our_jobs_earlier_restart(
    tmp_path, capsys, monkeypatch, ours: tuple, theirs: tuple
) -> None:
    run = tmp_path / "run"
    job, restart = theirs
    lock = _write_lock(
        run, host="node-17", pid=1, heartbeat=time.time() - 5, slurm_job_id=job, slurm_restart_count=restart
    )
    _in_slurm_job(monkeypatch, *ours)
    assert main(tiny_args(run, "train.steps=1")) == 2
    (line,) = _lines(capsys)
    assert "is in use by another run (host node-17, pid 1" in line and str(lock) in line
    assert f"Slurm job {job} restart {restart}" in line
    assert json.loads(lock.read_text())["token"] == "another-writer"


def test_start_up_removes_only_marked_leftovers_of_stopped_writers(finished: Path, tmp_path) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    ckpts = run / "checkpoints"
    # A user's own folder whose name happens to start like ours, with no marker.
    draft = ckpts / ".tmp-draft"
    draft.mkdir()
    (draft / "notes.txt").write_text("mine\n")
    # A save killed midway by an earlier writer: marked, its process gone.
    killed = ckpts / ".tmp-step_00000009"
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half")
    (killed / OWNER_NAME).write_text(json.dumps(writer_record("stopped") | {"pid": _dead_pid()}))
    assert main(tiny_args(run, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=0")) == 0
    assert (draft / "notes.txt").read_text() == "mine\n"
    assert not killed.exists()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_a_killed_exports_leftover_goes_with_the_next_export_and_nothing_else(finished: Path, tmp_path, capsys) -> None:
    out = tmp_path / "export"
    killed = tmp_path / ".export.tmp-0badf00d"
    killed.mkdir()
    (killed / "diffusion_pytorch_model.safetensors").write_bytes(b"half")
    (killed / OWNER_NAME).write_text(json.dumps(writer_record(killed.name) | {"pid": _dead_pid()}))
    # A sibling of the same pattern without the marker, and one whose writer is alive (pid 1 here).
    unmarked = tmp_path / ".export.tmp-users"
    unmarked.mkdir()
    live = tmp_path / ".export.tmp-alive000"
    live.mkdir()
    (live / OWNER_NAME).write_text(json.dumps(writer_record(live.name) | {"pid": 1, "pid_start": None}))
    assert main(["export", str(checkpoint_dir(finished, 2)), "--out", str(out)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".export.tmp-alive000", ".export.tmp-users", "export"]
    assert OWNER_NAME not in {p.name for p in out.iterdir()}


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_folder_under_torchrun_sp2(tmp_path) -> None:
    """A double-submitted job: one run trains to the end, the other stops at once naming it."""
    run = tmp_path / "run"
    # Long enough that the second run, started at the same moment, finds the first one still writing,
    # even when a loaded machine starts one of the two launchers many seconds after the other.
    common = ["train.steps=40", "parallel.sp=2", "checkpoint.every=20"]
    procs = [
        start_in_session(h3train_command(tiny_args(run, *common, f"train.seed={seed}"), nproc=2), run_env())
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1] or sorted(codes) == [0, 2], outs
    winner = codes.index(0)
    loser_err = outs[1 - winner][1]
    assert f"logging.dir '{run}' is in use by another run" in torchrun_error_line(loser_err), loser_err[-3000:]
    assert "exitcode  : 2" in loser_err
    # The winner's history is whole and its own: every step once, its seed in config.yaml.
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 41))
    assert f"seed: {winner + 1}" in (run / "config.yaml").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000020", "step_00000040"]
    assert not (run / LOCK_NAME).exists()
