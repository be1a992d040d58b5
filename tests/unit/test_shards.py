"""Shards (`data/shard_files.py`): a dataset's samples copied unchanged into a few files, each found by its index
line's shard, offset and length, and read exactly as its own file would be.

One synthetic dataset of mixed tasks is sharded into shards of a few samples each; every sample read from
the shards equals the one read from its file, tensor by tensor and bitwise, and a run trained from the
shards has the losses of the run trained from the folder. A damaged, truncated or missing shard is named
when read, and the index checks and rebuilds of a sharded dataset work as a folder's do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import index_problems, open_index, rebuild_index, write_index
from h3train.data.location import INDEX_NAME, SHARD_SUFFIX, read_shard_header, shard_samples
from h3train.data.sample_file import read_cached_sample
from h3train.data.shard_files import write_shards
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import DatasetError, SampleError

from helpers.launch import read_metrics, run_cli, tiny_args
from helpers.paths import TINY_FL2VA

SAMPLES = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the dataset folder, its sharded copy): 12 mixed samples in 4 shards or more."""
    root = tmp_path_factory.mktemp("shards")
    folder = write_synthetic_dataset(root / "folder", task="mixed", num_samples=SAMPLES, seed=3, text_dim=16)
    table = open_index(folder)
    # One sample with the encoder's record beside its file, as `h3train encode` leaves it.
    first = folder / table[0].file
    first.with_name(f"{table[0].sample_id}.inputs.json").write_text(json.dumps({"digest": "abc", "frames": 9}))
    total = sum((folder / table[i].file).stat().st_size for i in range(len(table)))
    done = write_shards(folder, root / "sharded", shard_bytes=total // 4)
    assert len(done.shards) >= 3 and len(done.entries) == SAMPLES
    return folder, root / "sharded"


def _tensors(sample) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(sample).items() if isinstance(v, torch.Tensor)}


def test_every_sample_reads_back_bitwise_from_its_shard(folders: tuple[Path, Path]) -> None:
    folder, sharded = folders
    plain, shards = CachedDataset(folder), CachedDataset(sharded)
    assert len(plain) == len(shards) == SAMPLES
    for i in range(SAMPLES):
        a, b = plain.entries[i], shards.entries[i]
        assert (a.sample_id, a.task, a.seq_len, a.geometry) == (b.sample_id, b.task, b.seq_len, b.geometry)
        assert b.in_shard and b.file.endswith(SHARD_SUFFIX) and not a.in_shard
        left, right = read_cached_sample(plain.path(i)), read_cached_sample(shards.path(i))
        assert left.sample_id == right.sample_id
        for name, tensor in _tensors(left).items():
            other = _tensors(right)[name]
            assert tensor.dtype == other.dtype and torch.equal(tensor.view(torch.uint8), other.view(torch.uint8))
        # The bytes in the shard are the file's, unchanged.
        at = shards.path(i)
        with open(at.path, "rb") as handle:
            handle.seek(at.offset)
            assert handle.read(at.length) == (folder / a.file).read_bytes()


def test_the_shards_and_their_index_say_where_each_sample_lies(folders: tuple[Path, Path]) -> None:
    folder, sharded = folders
    lines = [json.loads(line) for line in (sharded / INDEX_NAME).read_text().splitlines()]
    assert [line["id"] for line in lines] == [e.sample_id for e in CachedDataset(folder).entries]
    by_shard: dict[str, list[tuple[str, int, int]]] = {}
    for line in lines:
        by_shard.setdefault(line["file"], []).append((line["id"], line["offset"], line["length"]))
    for name, samples in by_shard.items():
        header = read_shard_header(sharded / name)
        assert list(header.samples) == samples
        # The encoder's record of each sample that had one beside its file.
        first = lines[0]["id"]
        assert header.inputs == ({first: {"digest": "abc", "frames": 9}} if name == lines[0]["file"] else {})
    assert not index_problems(sharded, open_index(sharded))


def test_an_index_rebuilt_from_the_shards_is_the_same(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, sharded = folders
    assert rebuild_index(sharded).fixes == []
    copy = tmp_path / "copy"
    (copy / "shards").mkdir(parents=True)
    for shard in (sharded / "shards").iterdir():
        (copy / "shards" / shard.name).write_bytes(shard.read_bytes())
    entries = write_index(copy)
    assert [e.to_json() for e in entries] == [json.loads(x) for x in (sharded / INDEX_NAME).read_text().splitlines()]


def test_a_line_listing_a_sample_of_a_shard_again_is_found(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, sharded = folders
    copy = tmp_path / "again"
    (copy / "shards").mkdir(parents=True)
    for shard in (sharded / "shards").iterdir():
        (copy / "shards" / shard.name).write_bytes(shard.read_bytes())
    lines = (sharded / INDEX_NAME).read_text().splitlines()
    twice = json.loads(lines[1])
    twice["id"] = "another-id"
    (copy / INDEX_NAME).write_text("\n".join([*lines, json.dumps(twice)]) + "\n")
    (problem,) = index_problems(copy, open_index(copy), headers=False)
    assert f"line {len(lines) + 1}: file '{twice['file']}' from byte {twice['offset']}" in problem
    assert "first on line 2" in problem


def test_a_damaged_or_truncated_shard_is_named_when_read(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, sharded = folders
    copy = tmp_path / "damaged"
    copy.mkdir()
    (copy / INDEX_NAME).write_text((sharded / INDEX_NAME).read_text())
    (copy / "shards").mkdir()
    for shard in (sharded / "shards").iterdir():
        (copy / "shards" / shard.name).write_bytes(shard.read_bytes())
    dataset = CachedDataset(copy)
    at = dataset.path(1)
    data = bytearray(at.path.read_bytes())
    data[at.offset + at.length - 3] ^= 0xFF
    at.path.write_bytes(bytes(data))
    with pytest.raises(SampleError, match=rf"sample '{at.path}, bytes {at.offset}-{at.offset + at.length}'.*digest"):
        dataset.load(1)
    last = dataset.path(len(dataset) - 1)
    last.path.write_bytes(last.path.read_bytes()[: last.offset + last.length // 2])
    with pytest.raises(SampleError, match="truncated"):
        dataset.load(len(dataset) - 1)
    (copy / dataset.entries[0].file).unlink()
    with pytest.raises(SampleError, match="does not exist"):
        dataset.load(0)
    assert "does not exist" in index_problems(copy, open_index(copy), headers=False)[0]


def test_a_shard_header_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / f"x{SHARD_SUFFIX}"
    bad.write_bytes(b"not a shard at all")
    with pytest.raises(SampleError, match=f"shard '{bad}': not an h3train shard"):
        shard_samples(bad)


def test_sharding_into_a_dataset_already_there_is_refused(folders: tuple[Path, Path], capsys) -> None:
    folder, sharded = folders
    before = (sharded / INDEX_NAME).read_bytes()
    with pytest.raises(DatasetError, match=f"'{sharded / INDEX_NAME}' exists already"):
        write_shards(folder, sharded)
    assert (sharded / INDEX_NAME).read_bytes() == before
    rc, _, err = run_cli(capsys, ["shard", str(folder), "--out", str(sharded)])
    assert rc == 2 and "exists already" in err


def test_a_run_from_the_shards_trains_the_losses_of_the_run_from_the_folder(
    folders: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    folder, _ = folders
    fl2va = write_synthetic_dataset(tmp_path / "fl2va", task="fl2va", num_samples=6, seed=5, text_dim=16)
    rc, out, _ = run_cli(capsys, ["shard", str(fl2va), "--out", str(tmp_path / "fl2va_shards"), "--shard-gb", "1e-5"])
    assert rc == 0 and "shards" in out
    losses = {}
    for name in ("fl2va", "fl2va_shards"):
        run = tmp_path / f"run_{name}"
        args = tiny_args(run, "train.steps=3", "data.source=cached", f"data.path={tmp_path / name}")
        rc, _, err = run_cli(capsys, args)
        assert rc == 0, err[-2000:]
        losses[name] = [row["loss"] for row in read_metrics(run) if "loss" in row]
    assert len(losses["fl2va"]) == 3 and losses["fl2va"] == losses["fl2va_shards"]
    assert TINY_FL2VA.is_file() and folder.is_dir()
