"""Shards: many samples in one file, each the unchanged bytes of its sample file, found by the index.

Object storage answers a GET per object: a million sample files are a million objects to list, copy
and open. A shard holds the samples of a stretch of the index, a few GB, back to back, and the index
names each sample's shard, offset and length (`IndexEntry.offset`, `.length`), so reading a sample is
one ranged read of exactly its bytes, and the bytes are those its own file held: the same header,
metadata and digests, checked as a file's are. What the encoder records of a sample's inputs and settings
beside its file (`<id>.inputs.json`, `encode/manifest_run.py`) goes into the shard's header.

The file layout and the reading of a shard's header are in `data/location.py`.

`write_shards` cuts a dataset folder into shards of about `shard_bytes` each (a sample never spans two)
and writes the sharded dataset's `index.jsonl` beside them; `shard_samples` lists a shard's samples
from its header alone (`format.write_index` rebuilds an index from them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DatasetError
from ..infra.atomic import atomic_write
from .dataset_index import location_of, open_index, write_entries
from .index_table import IndexEntry
from .location import (
    INDEX_NAME,
    INPUTS_SUFFIX,
    SHARD_SUFFIX,
    SampleLocation,
    read_shard_header,
    shard_header_bytes,
)
from .sample_file import read_header

SHARDS_DIR = "shards"
# The default shard size: a few seconds of one GET at object storage's per-connection rates, and a few
# hundred shards a million samples.
DEFAULT_SHARD_BYTES = 2 * 10**9


def _groups(sizes: list[int], shard_bytes: int) -> list[range]:
    """Consecutive runs of samples (by position) of at most `shard_bytes` each, one sample at least."""
    groups, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > shard_bytes:
            groups.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        groups.append(range(start, len(sizes)))
    return groups


@dataclass(frozen=True)
class ShardedDataset:
    """What `write_shards` wrote: the shards (relative to the output folder) and the entries of its index."""

    shards: list[str]
    entries: list[IndexEntry]
    bytes_written: int


def write_shards(
    folder: str | os.PathLike, out: str | os.PathLike, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> ShardedDataset:
    """Write the samples `folder`'s index lists, in index order, into shards of at most `shard_bytes` each
    under `out/shards/` (a sample larger than that is a shard of its own), and `out/index.jsonl` listing
    each sample's shard, offset and length (with its compact index).

    The samples' bytes are copied unchanged; each is checked against its index line first (its header),
    so a damaged dataset is refused before anything is written. `out` must not hold a dataset yet: a
    shard or an index already there is never replaced (`DatasetError` naming it).
    """
    from .storage import RemoteStore, is_url

    check_shard_target(out)
    if is_url(out):
        # Written here a shard at a time, each uploaded and removed before the next: the disk holds one.
        import tempfile

        with tempfile.TemporaryDirectory(prefix="h3train-shard-") as local:
            return _write_shards(Path(folder), Path(local), shard_bytes, RemoteStore(os.fspath(out)))
    return _write_shards(Path(folder), Path(out), shard_bytes, None)


def check_shard_target(out: str | os.PathLike) -> None:
    """Refuse an `out` (a folder or a URL) that holds a dataset already, its index or its shards, as one
    `DatasetError` naming it: nothing there is ever replaced. One listing for a URL."""
    from .storage import RemoteStore, is_url

    if is_url(out):
        store = RemoteStore(os.fspath(out))
        there = set(store.names_in(""))
        found = [store.name(name) for name in (INDEX_NAME, SHARDS_DIR) if name in there]
        where = "prefix"
    else:
        found = [str(path) for path in (Path(out) / INDEX_NAME, Path(out) / SHARDS_DIR) if path.exists()]
        where = "folder"
    if found:
        raise DatasetError(f"'{found[0]}' exists already: shard into an empty {where}, or move it aside first")


def _write_shards(folder: Path, out: Path, shard_bytes: int, store: Any) -> ShardedDataset:
    """`write_shards` into the folder `out`, each shard (then the index) uploaded to `store` when there is one."""
    if shard_bytes < 1:
        raise DatasetError(f"--shard-size is {shard_bytes} bytes; give at least 1 (about 1-4 GB is usual)")
    table = open_index(folder)
    listed = [table[row] for row in range(len(table))]
    if not listed:
        raise DatasetError(f"dataset '{folder}' lists no samples in its {INDEX_NAME}: nothing to shard")
    locations = [location_of(folder, entry) for entry in listed]
    sizes, records = [], []
    for entry, at in zip(listed, locations):
        header = read_header(at)
        if header.meta["sample_id"] != entry.sample_id:
            raise DatasetError(
                f"dataset '{folder}': '{at}' holds sample '{header.meta['sample_id']}', its index line says "
                f"'{entry.sample_id}'; rebuild the index with 'h3train index {folder}' first"
            )
        sizes.append(at.length if at.length >= 0 else at.path.stat().st_size)
        records.append(_inputs_record(at, entry.sample_id))
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    names, entries, written = [], [], 0
    for number, group in enumerate(_groups(sizes, shard_bytes)):
        name = f"{SHARDS_DIR}/shard-{number:05d}{SHARD_SUFFIX}"
        kinds = {listed[i].sample_id: records[i] for i in group if records[i] is not None}
        # The header's length depends on the offsets it lists: lay out with the offsets' final widths.
        layout = [(listed[i].sample_id, 0, sizes[i]) for i in group]
        base = len(shard_header_bytes(layout, kinds))
        while True:
            offsets, at = [], base
            for i in group:
                offsets.append(at)
                at += sizes[i]
            layout = [(listed[i].sample_id, o, sizes[i]) for i, o in zip(group, offsets)]
            head = shard_header_bytes(layout, kinds)
            if len(head) == base:
                break
            base = len(head)
        target = out / name
        if target.exists():
            raise DatasetError(f"'{target}' exists already: shard into an empty folder, or move it aside first")

        def fill(tmp: Path, head: bytes = head, group: range = group) -> None:
            with open(tmp, "wb") as handle:
                handle.write(head)
                for i in group:
                    handle.write(_sample_bytes(locations[i]))

        atomic_write(target, fill)
        if store is not None:
            store.fs.put_file(str(target), store.key(name))
            target.unlink()
        names.append(name)
        written += at
        for i, offset in zip(group, offsets):
            entries.append(_in_shard(listed[i], name, offset, sizes[i]))
    write_entries(out, entries)
    if store is not None:
        # The index last: a dataset whose upload stopped half way has none, and no start reads it.
        store.fs.put_file(str(out / INDEX_NAME), store.key(INDEX_NAME))
    return ShardedDataset(names, entries, written)


def _inputs_record(at: SampleLocation, sample_id: str) -> Any:
    """The encoder's inputs record of a sample: beside its own file, or in the header of the shard it is in."""
    if at.length >= 0:
        return read_shard_header(at.path).inputs.get(sample_id)
    record = at.path.with_name(f"{sample_id}{INPUTS_SUFFIX}")
    try:
        return json.loads(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        problem = f"the encoder's record of sample '{sample_id}' is not readable ({exc})"
        raise DatasetError(f"'{record}': {problem}") from None


def _sample_bytes(at: SampleLocation) -> bytes:
    with open(at.path, "rb") as handle:
        handle.seek(at.offset)
        return handle.read() if at.length < 0 else handle.read(at.length)


def _in_shard(entry: IndexEntry, shard: str, offset: int, length: int) -> IndexEntry:
    return IndexEntry(
        sample_id=entry.sample_id,
        file=shard,
        task=entry.task,
        seq_len=entry.seq_len,
        geometry=entry.geometry,
        has_audio=entry.has_audio,
        offset=offset,
        length=length,
    )
