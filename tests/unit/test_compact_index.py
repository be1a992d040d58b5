"""The compact index beside `index.jsonl`: the same entries, rebuilt when stale, never read half-written."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import open_index, read_index
from h3train.data.index_table import COMPACT_NAME, IndexTable, Lengths, sha256_of_file
from h3train.data.location import INDEX_NAME
from h3train.data.sampler import DistributedSampler
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import DatasetError
from h3train.infra import atomic
from h3train.tasks.table import TRAINING_TASKS

REAL = 12  # sample files written; the index lists more, whose files nothing opens
LISTED = 50


def _lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / INDEX_NAME).read_text().splitlines()]


def _write_lines(folder: Path, rows: list[dict]) -> None:
    (folder / INDEX_NAME).write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def listed(tmp_path: Path) -> Path:
    """A mixed dataset of `REAL` samples whose index.jsonl, rewritten by hand, lists `LISTED` entries: the real
    ones, then copies under other ids and files (one in a subfolder, one id not ASCII), lengths varied."""
    folder = write_synthetic_dataset(tmp_path / "data", task="mixed", num_samples=REAL, seed=3, text_dim=8)
    real = _lines(folder)
    rows = list(real)
    for i in range(REAL, LISTED):
        row = dict(real[i % REAL], id=f"copy-{i}", file=f"copy-{i}.safetensors", seq_len=100 + (i * 37) % 90)
        rows.append(row)
    rows[20]["file"] = "shard/deep/copy-20.safetensors"
    rows[21]["id"] = "clip-é-✓"
    _write_lines(folder, rows)
    return folder


def test_the_compact_index_holds_every_entry_of_index_jsonl(listed: Path) -> None:
    expected = read_index(listed)
    assert len(expected) == LISTED
    built = open_index(listed)  # the synthetic writer's compact index lists REAL entries: stale, rebuilt
    assert list(built) == expected
    mapped, source = IndexTable.open(listed / COMPACT_NAME)
    assert isinstance(mapped.seq_len, np.memmap) or isinstance(mapped.seq_len.base, np.memmap)
    assert [mapped[i] for i in range(LISTED)] == expected and mapped[-1] == expected[-1]
    assert source.size == (listed / INDEX_NAME).stat().st_size
    assert source.sha256 == sha256_of_file(listed / INDEX_NAME)
    assert mapped.task_counts() == {t: sum(e.task == t for e in expected) for t in {e.task for e in expected}}


def test_write_index_writes_the_compact_index_with_it(tmp_path: Path) -> None:
    folder = write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=4, seed=0, text_dim=8)
    found = IndexTable.open(folder / COMPACT_NAME)
    assert found is not None and found[1].matches(folder / INDEX_NAME)
    assert list(found[0]) == read_index(folder)


def test_an_index_edited_by_hand_is_rebuilt_and_read_as_edited(listed: Path) -> None:
    index = listed / INDEX_NAME
    before = open_index(listed)
    assert IndexTable.open(listed / COMPACT_NAME)[1].matches(index)
    # One digit changed in place: the same size, and the time put back, so only the content tells.
    stat = index.stat()
    text = index.read_text()
    old = f'"seq_len": {before[5].seq_len},'
    assert text.count(old) >= 1 and before[5].seq_len < 900
    line = text.splitlines()[5]
    edited_line = line.replace(old, f'"seq_len": {before[5].seq_len + 1:0{len(str(before[5].seq_len))}d},')
    index.write_text(text.replace(line, edited_line, 1))
    os.utime(index, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert index.stat().st_size == stat.st_size and index.stat().st_mtime_ns == stat.st_mtime_ns
    assert not IndexTable.open(listed / COMPACT_NAME)[1].matches(index)

    after = open_index(listed)
    assert after[5].seq_len == before[5].seq_len + 1 and list(after) == read_index(listed)
    assert IndexTable.open(listed / COMPACT_NAME)[1].matches(index)  # rewritten from the edit

    # A line added by hand: the dataset a start builds sees it.
    rows = _lines(listed)
    rows.append(dict(rows[0], id="added", file="added.safetensors", seq_len=7))
    _write_lines(listed, rows)
    dataset = CachedDataset(listed, "mixed")
    assert len(dataset) == LISTED + 1 and dataset.entries[LISTED].sample_id == "added" and dataset.lengths[-1] == 7


# name -> (line 3 of the index, given its good line 3; what the one line says)
MALFORMED = {
    "torn": (lambda good: '{"id": "x", "file": ', "malformed entry (JSONDecodeError"),
    "no_file": (lambda good: '{"id": "x"}', "malformed entry (KeyError"),
    "length_text": (lambda good: json.dumps(dict(good, seq_len="long")), "malformed entry (ValueError"),
    "unknown_task": (lambda good: json.dumps(dict(good, task="t2v")), "task 't2v' is not one of"),
    "outside": (lambda good: json.dumps(dict(good, file="../x.safetensors")), "file '../x.safetensors' must be"),
}


@pytest.mark.parametrize("compact", ["stale", "missing"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_line_is_one_line_naming_it(listed: Path, case: str, compact: str) -> None:
    make, says = MALFORMED[case]
    rows = [json.dumps(row) for row in _lines(listed)]
    rows[2] = make(json.loads(rows[2]))
    (listed / INDEX_NAME).write_text("\n".join(rows) + "\n")
    if compact == "missing":
        (listed / COMPACT_NAME).unlink()
    before = (listed / COMPACT_NAME).read_bytes() if compact == "stale" else None
    with pytest.raises(DatasetError) as info:
        open_index(listed)
    message = str(info.value)
    assert message.startswith(f"index '{listed / INDEX_NAME}' line 3: ") and says in message and "\n" not in message
    with pytest.raises(DatasetError) as parsed:
        read_index(listed)
    assert str(parsed.value) == message  # the same check, the same words
    # Nothing is written from a broken index: the old compact index (or none) stays.
    if before is None:
        assert not (listed / COMPACT_NAME).exists()
    else:
        assert (listed / COMPACT_NAME).read_bytes() == before


def test_a_number_beyond_int64_is_one_line_naming_it(listed: Path) -> None:
    rows = _lines(listed)
    rows[6]["geometry"]["latent_width"] = 2**70
    _write_lines(listed, rows)
    with pytest.raises(DatasetError, match=r"line 7: malformed entry \(OverflowError") as info:
        open_index(listed)
    assert "\n" not in str(info.value)


def test_a_file_through_a_link_out_of_the_folder_is_refused_as_read_index_refuses_it(listed: Path) -> None:
    outside = listed.parent / "outside"
    outside.mkdir()
    (listed / "away.safetensors").symlink_to(outside / "x.safetensors")
    rows = _lines(listed)
    rows[4]["file"] = "away.safetensors"
    _write_lines(listed, rows)
    with pytest.raises(DatasetError, match="line 5: file 'away.safetensors' resolves to .* outside") as info:
        open_index(listed)
    with pytest.raises(DatasetError) as parsed:
        read_index(listed)
    assert str(parsed.value) == str(info.value)


@pytest.mark.parametrize("task_filter", ["mixed", "fl2va", "ref2va", "t2va"])
@pytest.mark.parametrize("max_rows", [0, "median"])
def test_a_dataset_from_the_compact_index_is_the_one_index_jsonl_describes(
    listed: Path, task_filter: str, max_rows: int | str
) -> None:
    parsed = read_index(listed)
    if max_rows == "median":
        max_rows = int(np.median([e.seq_len for e in parsed]))
    accepted = TRAINING_TASKS[task_filter].sample_tasks
    kept = [e for e in parsed if e.task in accepted and not (max_rows and e.seq_len > max_rows)]
    dropped = [(e.sample_id, e.seq_len) for e in parsed if e.task in accepted and max_rows and e.seq_len > max_rows]
    (listed / COMPACT_NAME).unlink()
    dataset = CachedDataset(listed, task_filter, max_rows=max_rows)
    assert (listed / COMPACT_NAME).is_file()  # built on the first read
    assert kept and list(dataset.entries) == kept and len(dataset) == len(kept)
    assert dataset.lengths == [e.seq_len for e in kept] and list(dataset.dropped) == dropped
    assert [dataset.entries[i] for i in range(len(dataset))] == kept
    real = [i for i, e in enumerate(kept) if (listed / e.file).is_file()]
    assert real
    for i in real:
        sample = dataset[i]
        assert sample.sample_id == kept[i].sample_id and sample.layout.seq_len == dataset.lengths[i]
    # The sampler orders the same lengths the same way, from the array as from the list.
    bucketed = DistributedSampler(len(dataset), 0, 1, seed=1, lengths=dataset.lengths, bucket_size=4)
    reference = DistributedSampler(len(kept), 0, 1, seed=1, lengths=[e.seq_len for e in kept], bucket_size=4)
    assert [bucketed.next_index() for _ in range(2 * len(kept))] == [
        reference.next_index() for _ in range(2 * len(kept))
    ]


def test_a_missing_compact_index_is_built_on_first_read(listed: Path) -> None:
    compact = listed / COMPACT_NAME
    compact.unlink()
    table = open_index(listed)
    assert compact.is_file() and list(table) == read_index(listed)
    written = compact.stat().st_mtime_ns
    again = open_index(listed)  # fresh now: read, not rebuilt
    assert compact.stat().st_mtime_ns == written and list(again) == list(table)


def test_a_leftover_temporary_of_a_killed_writer_is_neither_read_nor_removed(listed: Path) -> None:
    open_index(listed)
    compact = listed / COMPACT_NAME
    whole = compact.read_bytes()
    # A writer killed mid-write leaves its temporary name (`atomic_write`), half-filled.
    leftover = listed / f".{COMPACT_NAME}.{'ab' * 16}.tmp"
    leftover.write_bytes(whole[: len(whole) // 2])
    assert atomic.is_temporary(leftover)
    assert list(open_index(listed)) == read_index(listed) and compact.read_bytes() == whole
    compact.unlink()
    assert list(open_index(listed)) == read_index(listed) and compact.read_bytes() == whole
    assert leftover.read_bytes() == whole[: len(whole) // 2]  # not ours to judge: another writer's, maybe


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
def test_a_truncated_compact_index_is_rebuilt_not_mapped(listed: Path, cut: float) -> None:
    open_index(listed)
    compact = listed / COMPACT_NAME
    whole = compact.read_bytes()
    compact.write_bytes(whole[: int(len(whole) * cut)])
    assert IndexTable.open(compact) is None
    assert list(open_index(listed)) == read_index(listed) and compact.read_bytes() == whole


def test_a_failed_write_leaves_the_old_compact_index_whole(listed: Path, monkeypatch, caplog) -> None:
    old = (listed / COMPACT_NAME).read_bytes()  # the synthetic writer's, of REAL entries: stale

    def fail(path: Path) -> None:
        raise OSError(30, "Read-only file system")

    # The temporary is filled, then fails before its rename, as on a folder that cannot be written.
    monkeypatch.setattr(atomic, "apply_file_mode", fail)
    table = open_index(listed)
    assert list(table) == read_index(listed)  # used from memory
    assert "cannot write the compact index" in caplog.text
    assert (listed / COMPACT_NAME).read_bytes() == old
    assert [p.name for p in listed.iterdir() if atomic.is_temporary(p)] == []


def test_ranks_racing_to_build_it_all_read_the_same_entries(listed: Path) -> None:
    (listed / COMPACT_NAME).unlink()
    found: list[list] = []
    errors: list[BaseException] = []

    def rank() -> None:
        try:
            found.append(list(open_index(listed)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = read_index(listed)
    assert not errors and len(found) == 4 and all(entries == expected for entries in found)
    assert list(IndexTable.open(listed / COMPACT_NAME)[0]) == expected
    assert [p.name for p in listed.iterdir() if atomic.is_temporary(p)] == []


def test_lengths_read_as_a_list_and_as_an_array() -> None:
    values = [5, 3, 9, 3]
    lengths = Lengths(np.array(values))
    assert lengths == values and values == lengths and lengths != [5, 3, 9] and lengths != [5, 3, 9, 4]
    assert lengths + [1] == [*values, 1] and [1] + lengths == [1, *values]
    assert lengths + Lengths([2]) == [*values, 2] and isinstance(lengths + [1], Lengths)
    assert lengths.index(3) == 1 and lengths.index(3, 2) == 3 and lengths.count(3) == 2
    with pytest.raises(ValueError):
        lengths.index(4)
    assert list(lengths) == values and all(type(v) is int for v in lengths) and lengths[-1] == 3
    assert max(lengths) == 9 and 9 in lengths and 4 not in lengths and lengths[1:3] == [3, 9]
    assert np.asarray(lengths) is lengths.array
    assert torch.equal(torch.as_tensor(np.asarray(lengths)), torch.tensor(values))
