"""A full disk is one line naming the folder, the bytes needed and free; nothing already written is lost.

The disks are real (`reference.on_small_disk`): a tmpfs of a chosen size in a mount namespace of
the run's own, so writes fail with ENOSPC as on a full cluster volume.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from h3train.checkpoint import complete_checkpoints, verify_file_digests
from h3train.config import load_config
from h3train.errors import ConfigError
from h3train.infra.diskspace import check_room, free_bytes, no_space
from h3train.model.architecture import model_dims
from h3train.plan import checkpoint_bytes

from helpers.launch import checkpoint_tensor_bytes, on_small_disk, read_metrics, torchrun_error_line
from helpers.paths import TINY_FL2VA


def _planned() -> int:
    cfg = load_config(TINY_FL2VA, [])
    return checkpoint_bytes(model_dims(cfg), cfg)


def _args(run: Path, ckpt: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(TINY_FL2VA),
        f"logging.dir={run}",
        f"checkpoint.dir={ckpt}",
        "logging.progress=false",
        "train.steps=4",
        "checkpoint.every=2",
        "checkpoint.keep_last=1",
        *extra,
    ]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("h3train: error:")]


def _check_full_save(
    proc: subprocess.CompletedProcess, kept: Path, run: Path, ckpt: Path, torchrun: bool = False
) -> None:
    assert proc.returncode != 0, proc.stderr[-4000:]
    if torchrun:
        line = torchrun_error_line(proc.stderr)
    else:
        lines = _error_lines(proc.stderr)
        assert len(lines) == 1, proc.stderr[-4000:]
        line = lines[0]
    assert f"checkpoint folder '{ckpt}' is full: the checkpoint of step 4 needs about" in line, line
    assert "MiB" in line and "is free" in line and "step_00000002 is kept" in line, line
    assert "checkpoint.resume=auto" in line
    assert "[rank" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr[-4000:]
    # What was written before stays: the step-2 checkpoint, whole (its digests hold), and every metrics row.
    assert [p.name for p in complete_checkpoints(kept)] == ["step_00000002"]
    verify_file_digests(kept / "step_00000002")
    # The partial save was this run's own: removed, so the space is free again.
    assert not [p for p in kept.iterdir() if p.name.startswith(".tmp-")]
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def full_at_second_save(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path, Path]:
    """A run whose checkpoint disk has room for one checkpoint (DCP's framing included), not for two."""
    root = tmp_path_factory.mktemp("full")
    run, ckpt = root / "run", root / "ckpt"
    proc, kept = on_small_disk(ckpt, 2 * _planned(), _args(run, ckpt))
    return proc, kept, run, ckpt


def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(full_at_second_save) -> None:
    proc, kept, run, ckpt = full_at_second_save
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    _check_full_save(proc, kept, run, ckpt)
    # The size it planned with is the tensors' (weights and AdamW moments; AdamW's step counts on top).
    planned, held = _planned(), checkpoint_tensor_bytes(kept / "step_00000002")
    assert 0 <= held - planned <= 0.01 * planned, (held, planned)


@pytest.mark.slow
def test_a_background_save_on_a_full_disk_is_said_once_under_torchrun_sp2(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = _args(run, ckpt, "parallel.sp=2", "checkpoint.async_save=true")
    proc, kept = on_small_disk(ckpt, 2 * _planned(), args, nproc=2)
    _check_full_save(proc, kept, run, ckpt, torchrun=True)


def test_a_run_started_without_room_for_a_checkpoint_stops_before_the_model(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    planned = _planned()
    proc, kept = on_small_disk(ckpt, planned // 2, _args(run, ckpt))
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"config key 'checkpoint.dir': '{ckpt}' has" in lines[0]
    assert f"({planned:,} bytes)" in lines[0] and "choose a checkpoint.dir with room" in lines[0]
    # Stopped before anything was written: no step, no lock, no metrics.
    assert "step 1/" not in proc.stderr and not list(kept.iterdir())
    assert not (run / "metrics.jsonl").exists() and not (run / ".h3train.lock").exists()


def test_an_export_onto_a_full_disk_names_the_file_and_leaves_nothing(full_at_second_save, tmp_path: Path) -> None:
    checkpoint = full_at_second_save[1] / "step_00000002"
    disk = tmp_path / "disk"
    proc, kept = on_small_disk(disk, 64 * 1024, ["export", str(checkpoint), "--out", str(disk / "model")])
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on the device writing '{disk}/.model.tmp-" in lines[0], lines[0]
    assert ".safetensors'" in lines[0] and "free there" in lines[0]
    # The half-written export was its own temporary sibling: gone, and no `model` folder appeared.
    assert not list(kept.iterdir())


def test_a_full_logging_dir_names_the_file(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc, kept = on_small_disk(run, 16 * 1024, _args(run, ckpt, "train.steps=400", "checkpoint.every=0"))
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on the device writing '{run / 'metrics.jsonl'}'" in lines[0], lines[0]
    assert "free there" in lines[0]
    # The rows written before the disk filled are whole.
    rows = (kept / "metrics.jsonl").read_text().splitlines()
    assert len(rows) > 5 and all(r.startswith('{"step": ') for r in rows[:-1])


def test_no_space_is_found_behind_wrappers_and_in_a_rank_failure() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/x/f")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("writer failed") from exc
    except RuntimeError as wrapped:
        assert no_space(wrapped) is full
    gathered = CheckpointException("save failed", {1: (OSError(errno.EDQUOT, "Disk quota exceeded"), None)})
    assert no_space(gathered).errno == errno.EDQUOT
    assert no_space(RuntimeError("something else")) is None
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None


def test_room_check_passes_fails_and_warns_where_it_cannot_know(tmp_path: Path, monkeypatch) -> None:
    free = free_bytes(tmp_path)
    assert free is not None and free > 0
    assert check_room(tmp_path / "not" / "yet", "checkpoint.dir", 1024) is None
    with pytest.raises(ConfigError, match="config key 'checkpoint.dir'.*free, and one checkpoint"):
        check_room(tmp_path, "checkpoint.dir", free * 4)

    def no_statvfs(path):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr("h3train.infra.diskspace.shutil.disk_usage", no_statvfs)
    warning = check_room(tmp_path, "checkpoint.dir", 5 * 1024**2)
    assert warning is not None and "does not report its free space" in warning and "5.00 MiB" in warning
