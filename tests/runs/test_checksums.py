"""Damaged data is found, not trained on: sample digests, samples in owned memory, checkpoint digests."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from h3train.checkpoint import read_trainer_state
from h3train.cli import main
from h3train.data.dataset_index import read_index
from h3train.data.sample_file import DIGESTS_KEY, METADATA_KEY, read_cached_sample
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import SampleError
from h3train.infra.digest import digest_file

from helpers.launch import (
    checkpoint_dir,
    h3train_command,
    read_metrics,
    run_env,
    run_forked,
    start_in_session,
    tiny_args,
)


def _payload_span(path: Path, name: str) -> tuple[int, int]:
    """Where tensor `name`'s bytes lie in the file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    first, last = header[name]["data_offsets"]
    return 8 + length + first, 8 + length + last


def _flip_one_byte(path: Path, name: str) -> None:
    """One changed byte in the middle of tensor `name`: a plausible float, every header check still passes."""
    first, last = _payload_span(path, name)
    raw = bytearray(path.read_bytes())
    raw[(first + last) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(data, task="fl2va", num_samples=8, seed=0, text_dim=16)
    return data


def test_every_sample_records_a_digest_of_each_tensor(dataset: Path) -> None:
    entry = read_index(dataset)[0]
    raw = (dataset / entry.file).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    record = json.loads(header["__metadata__"][METADATA_KEY])[DIGESTS_KEY]
    assert set(record["tensors"]) == {k for k in header if k != "__metadata__"}
    read_cached_sample(dataset / entry.file)  # verifies


def test_a_flipped_byte_is_a_data_error_naming_file_and_tensor(dataset: Path, tmp_path: Path, capsys) -> None:
    data = Path(shutil.copytree(dataset, tmp_path / "data"))
    entry = read_index(data)[2]
    _flip_one_byte(data / entry.file, "video_latents")
    with pytest.raises(SampleError, match=r"field 'video_latents' does not match the digest"):
        read_cached_sample(data / entry.file)

    common = [f"data.path={data}", "data.source=cached", "train.grad_accum=1", "checkpoint.every=0"]
    run = tmp_path / "raise"
    assert main(tiny_args(run, "train.steps=8", "data.on_error=raise", *common)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert entry.file in last and "'video_latents'" in last and "digest" in last

    run = tmp_path / "skip"
    assert main(tiny_args(run, "train.steps=8", "data.on_error=skip", *common)) == 0
    records = [json.loads(line) for line in (run / "data_errors.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in records] == [entry.sample_id] and "digest" in records[0]["reason"]
    assert read_metrics(run)[-1]["data_errors"] == 1


@pytest.mark.slow
def test_samples_truncated_under_a_running_sp2_job_are_a_data_error_not_a_signal(dataset: Path, tmp_path) -> None:
    data = Path(shutil.copytree(dataset, tmp_path / "data"))
    run = tmp_path / "run"
    args = tiny_args(
        run,
        f"data.path={data}",
        "data.source=cached",
        "train.grad_accum=1",
        "train.steps=40",
        "checkpoint.every=0",
        "parallel.sp=2",
        "data.on_error=raise",
    )
    proc = start_in_session(h3train_command(args, nproc=2), run_env())
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    # Every sample, those prefetched already included, loses its second half.
    for entry in read_index(data):
        path = data / entry.file
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, -signal.SIGBUS), err[-3000:]
    assert "SIGBUS" not in err and "Signal 7" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("h3train: error: sample")]
    assert ours and all("truncated" in line or "not a readable" in line for line in ours), err[-3000:]
    # The steps trained before the truncation reached the log; none after a failed read.
    assert len(read_metrics(run)) < 40


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory) -> Path:
    """Four steps at sp=2, committed at steps 2 and 4."""
    run = tmp_path_factory.mktemp("sp2") / "run"
    run_forked(tiny_args(run, "train.steps=4", "checkpoint.every=2", "parallel.sp=2"), nproc=2)
    return run


def test_every_checkpoint_file_has_a_digest_that_matches(sp2_run: Path) -> None:
    for step in (2, 4):
        ckpt = checkpoint_dir(sp2_run, step)
        record = read_trainer_state(ckpt)["digests"]
        assert set(record["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert all(digest_file(ckpt / name) == value for name, value in record["files"].items())


def _flip_in_file(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_flipped_byte_in_a_shard_sets_the_checkpoint_aside_at_sp2(sp2_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(sp2_run, tmp_path / "run"))
    shard = checkpoint_dir(run, 4) / "__1_0.distcp"
    _flip_in_file(shard)
    proc = run_forked(tiny_args(run, "train.steps=5", "checkpoint.every=2", "parallel.sp=2"), nproc=2)
    warnings = [line for line in proc.stderr.splitlines() if "skipped checkpoint" in line]
    assert len(warnings) == 1 and "__1_0.distcp does not match the digest" in warnings[0], proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout
    assert (run / "checkpoints" / "step_00000004.corrupt").is_dir()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5]


def test_export_refuses_a_checkpoint_whose_bytes_changed(sp2_run: Path, tmp_path: Path, capsys) -> None:
    ckpt = Path(shutil.copytree(checkpoint_dir(sp2_run, 4), tmp_path / "step_00000004"))
    _flip_in_file(ckpt / "__0_0.distcp")
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "__0_0.distcp does not match the digest" in line
    assert not (tmp_path / "out").exists()
