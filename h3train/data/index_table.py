"""The compact index of a dataset folder: `index.jsonl` as memory-mapped columns.

`index.jsonl` (`dataset_index.py`) is the index's human-readable source of truth; parsed, a million lines
take tens of seconds and hundreds of MiB in every rank. Beside it lies `.h3train.index`, the same
entries as columns in one file that every rank maps read-only (`np.memmap`): opening it reads a
header, and the pages a start touches (the task and length columns) are shared between the ranks
of a node through the page cache.

File layout (little-endian throughout):

    bytes 0-7      magic `H3INDEX\\n`
    bytes 8-15     uint64: length of the JSON header that follows
    JSON header    {"version", "rows", "tasks": [task name of each code], "source": {"size",
                   "mtime_ns", "sha256"} of the index.jsonl it was built from,
                   "columns": {name: {"dtype", "shape", "offset"}}}
    columns        raw arrays from the first 64-byte boundary after the header, each at the offset
                   (64-byte aligned) its "columns" entry gives from there:
                   seq_len [N] int64, geometry [N, 4] int64 (num_latent_frames, latent_height,
                   latent_width, num_audio_latents), task [N] uint8 (a code into "tasks"),
                   has_audio [N] bool, ids and files: UTF-8 bytes of every sample id (relative
                   file path) one after the other, with ids_offsets / files_offsets [N + 1] int64
                   (entry i is bytes [offsets[i], offsets[i + 1])), offset and length [N] int64 (where
                   a sample in a shard lies in its file; length -1: the whole file)

It is written atomically (a temporary name, then a rename), so ranks racing to write it are harmless
and a reader maps either a whole old file or a whole new one, never part of one; nothing here
rewrites the file in place, so a mapping stays valid while the file is replaced (a copy made over it
in place, `cp` onto a running job's folder, would pull pages from under that job: copy folders by
rename, as `rsync` does). `format.open_index` decides when it is stale (`IndexSource`) and rebuilds it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..infra.atomic import atomic_write
from ..tasks.layout import Geometry

COMPACT_NAME = ".h3train.index"
_MAGIC = b"H3INDEX\n"
_VERSION = 2
_ALIGN = 64
_RECENT_ENTRIES = 4096
# Rows a pass over a string column decodes at once: a few MiB of Python strings, whatever the index's size.
STRING_BLOCK = 1 << 16
# Values are checked, not trusted: a header naming another dtype is not one of these files.
_COLUMNS = {
    "seq_len": ("<i8", 1),
    "geometry": ("<i8", 2),
    "task": ("|u1", 1),
    "has_audio": ("|b1", 1),
    "ids": ("|u1", 1),
    "ids_offsets": ("<i8", 1),
    "files": ("|u1", 1),
    "files_offsets": ("<i8", 1),
    "offset": ("<i8", 1),
    "length": ("<i8", 1),
}
# Reading `index.jsonl` for its hash, a block at a time.
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class IndexEntry:
    """One line of `index.jsonl`. `file` is relative to the dataset folder; `seq_len` is the packed length.

    A sample in a shard (`data/shard_files.py`) is the `length` bytes of `file` from byte `offset`, the bytes its
    own sample file would hold; `length` -1: the sample is the whole of `file` (`offset` 0).
    """

    sample_id: str
    file: str
    task: str
    seq_len: int
    geometry: Geometry
    has_audio: bool
    offset: int = 0
    length: int = -1

    @property
    def in_shard(self) -> bool:
        return self.length >= 0

    def to_json(self) -> dict[str, Any]:
        line = {
            "id": self.sample_id,
            "file": self.file,
            "task": self.task,
            "seq_len": self.seq_len,
            "geometry": dataclasses.asdict(self.geometry),
            "has_audio": self.has_audio,
        }
        if self.in_shard:
            line.update(offset=self.offset, length=self.length)
        return line


@dataclass(frozen=True)
class IndexSource:
    """The `index.jsonl` a compact index was built from: its size, modification time and sha256.

    The content decides: an index with the recorded size and hash is the one the columns hold, whatever
    its time (a folder copied without its times still matches); the time is recorded to tell when.
    """

    size: int
    mtime_ns: int
    sha256: str

    def matches(self, index: Path) -> bool:
        """Whether `index` holds the bytes recorded here (its size first, then its hash)."""
        try:
            if index.stat().st_size != self.size:
                return False
            return sha256_of_file(index) == self.sha256
        except OSError:
            return False


def sha256_of_file(path: Path) -> str:
    """The hex sha256 of the file's bytes, read a block at a time into one buffer."""
    hasher = hashlib.sha256()
    block = bytearray(_HASH_BLOCK)
    view = memoryview(block)
    with open(path, "rb") as handle:
        while got := handle.readinto(block):
            hasher.update(view[:got])
    return hasher.hexdigest()


def _decode(blob: np.ndarray, offsets: np.ndarray, row: int) -> str:
    return blob[int(offsets[row]) : int(offsets[row + 1])].tobytes().decode("utf-8", "surrogatepass")


def _pieces(blob: np.ndarray, offsets: np.ndarray, start: int, stop: int) -> tuple[bytes, list[int]]:
    """The bytes of rows [start, stop) of a string column and their ends within those bytes (stop - start + 1)."""
    ends = offsets[start : stop + 1]
    first = int(ends[0])
    return blob[first : int(ends[-1])].tobytes(), (ends - first).tolist()


class IndexTable(Sequence[IndexEntry]):
    """Every entry of one index as columns (numpy arrays, mapped from the file or in memory).

    `table[i]` is entry `i` as an `IndexEntry`, made when asked for; the columns answer the questions of
    a start (which rows are of which task, their lengths) without making any.
    """

    def __init__(self, columns: dict[str, np.ndarray], tasks: Sequence[str]) -> None:
        self.columns = columns
        self.tasks = tuple(tasks)
        self.seq_len: np.ndarray = columns["seq_len"]
        self.task_codes: np.ndarray = columns["task"]
        # Entries made lately, kept so that one asked for again (a sample's entry, then its path) is the same.
        self._entry = functools.lru_cache(maxsize=_RECENT_ENTRIES)(self._make_entry)

    def __len__(self) -> int:
        return int(self.seq_len.shape[0])

    def __getitem__(self, row: int) -> IndexEntry:  # type: ignore[override]
        if isinstance(row, slice):
            raise TypeError("an IndexTable is indexed by row, not sliced; select rows with rows_of")
        row = int(row)
        n = len(self)
        if row < 0:
            row += n
        if not 0 <= row < n:
            raise IndexError(f"index entry {row} outside [0, {n})")
        return self._entry(row)

    def __iter__(self) -> Iterator[IndexEntry]:
        for row in range(len(self)):
            yield self[row]

    def _make_entry(self, row: int) -> IndexEntry:
        c = self.columns
        return IndexEntry(
            sample_id=_decode(c["ids"], c["ids_offsets"], row),
            file=_decode(c["files"], c["files_offsets"], row),
            task=self.tasks[int(c["task"][row])],
            seq_len=int(c["seq_len"][row]),
            geometry=Geometry(*(int(v) for v in c["geometry"][row])),
            has_audio=bool(c["has_audio"][row]),
            offset=int(c["offset"][row]),
            length=int(c["length"][row]),
        )

    def rows_of(self, tasks: Iterable[str]) -> np.ndarray:
        """The rows (int64, ascending) whose task is one of `tasks`."""
        wanted = set(tasks)
        codes = [code for code, name in enumerate(self.tasks) if name in wanted]
        return np.flatnonzero(np.isin(self.task_codes, codes)).astype(np.int64, copy=False)

    def strings(self, column: str, start: int, stop: int) -> list[str]:
        """Rows [start, stop) of `column` ("ids": sample ids, "files": files relative to the dataset folder),
        decoded in one pass over their bytes (no `IndexEntry` made).

        A caller that reads every row takes them a block at a time (`STRING_BLOCK`): a million rows as
        Python strings are a hundred MiB or more.
        """
        raw, ends = _pieces(self.columns[column], self.columns[column + "_offsets"], start, stop)
        return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in zip(ends[:-1], ends[1:])]

    def hashes(self, column: str) -> np.ndarray:
        """`hash()` of every row's UTF-8 bytes in `column` ("ids" or "files"), int64 [N] in row order.

        Equal strings hash equally (and `text.encode("utf-8", "surrogatepass")` is a row's bytes), so rows
        whose hash no other row shares hold a string no other row does, found without a Python object per
        row held. Python's own hash: equal within this process only.
        """
        blob, offsets = self.columns[column], self.columns[column + "_offsets"]
        n = len(self)
        out = np.empty(n, dtype=np.int64)
        for start in range(0, n, STRING_BLOCK):
            stop = min(start + STRING_BLOCK, n)
            raw, ends = _pieces(blob, offsets, start, stop)
            out[start:stop] = [hash(raw[a:b]) for a, b in zip(ends[:-1], ends[1:])]
        return out

    def task_counts(self) -> dict[str, int]:
        """Samples of each task the index lists (tasks it lists none of left out)."""
        counts = np.bincount(self.task_codes, minlength=len(self.tasks))
        return {name: int(n) for name, n in zip(self.tasks, counts) if n}

    def write(self, path: Path, source: IndexSource) -> None:
        """Write the table to `path` atomically, recording the index it was built from."""
        arrays = {name: np.ascontiguousarray(self.columns[name], dtype=dtype) for name, (dtype, _) in _COLUMNS.items()}
        columns, offset = {}, 0
        for name, values in arrays.items():
            columns[name] = {"dtype": values.dtype.str, "shape": list(values.shape), "offset": offset}
            offset = _aligned(offset + values.nbytes)
        header = {
            "version": _VERSION,
            "rows": len(self),
            "tasks": list(self.tasks),
            "source": dataclasses.asdict(source),
            "columns": columns,
        }
        text = json.dumps(header).encode()
        base = _aligned(len(_MAGIC) + 8 + len(text))

        def fill(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                handle.write(_MAGIC + len(text).to_bytes(8, "little") + text)
                for name, values in arrays.items():
                    handle.write(b"\0" * (base + columns[name]["offset"] - handle.tell()))
                    handle.write(values.tobytes())

        atomic_write(path, fill)

    @classmethod
    def open(cls, path: Path) -> tuple[IndexTable, IndexSource] | None:
        """The table mapped from `path` and the index it was built from; None when `path` is missing
        or is not a whole compact index of this version (then it is rebuilt)."""
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if handle.read(len(_MAGIC)) != _MAGIC:
                    return None
                length = int.from_bytes(handle.read(8), "little")
                if length > size:
                    return None
                header = json.loads(handle.read(length))
            base = _aligned(len(_MAGIC) + 8 + length)
            found = _columns_of(header, size - base)
            if found is None:
                return None
            source = IndexSource(**header["source"])
            raw = np.memmap(path, dtype=np.uint8, mode="r") if size > base else None
            columns = {}
            for name, (dtype, offset, shape) in found.items():
                if raw is None or 0 in shape:
                    columns[name] = np.zeros(shape, dtype=dtype)
                else:
                    columns[name] = np.ndarray(shape, dtype=dtype, buffer=raw, offset=base + offset)
            for blob, offsets in (("ids", "ids_offsets"), ("files", "files_offsets")):
                ends = columns[offsets]
                if ends.shape != (header["rows"] + 1,) or ends[0] != 0 or ends[-1] != columns[blob].shape[0]:
                    return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
            # A damaged header: rebuilt from index.jsonl, as a stale one is.
            return None
        return cls(columns, header["tasks"]), source


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _columns_of(header: Any, size: int) -> dict[str, tuple[np.dtype, int, tuple[int, ...]]] | None:
    """Each column's (dtype, offset from the data, shape), None unless the header is this version's and its
    columns fit in the `size` bytes of data."""
    if not isinstance(header, dict) or header.get("version") != _VERSION:
        return None
    rows, tasks = header.get("rows"), header.get("tasks")
    if not isinstance(rows, int) or not isinstance(tasks, list) or not isinstance(header.get("source"), dict):
        return None
    found = {}
    for name, (dtype, ndim) in _COLUMNS.items():
        spec = header["columns"][name]
        shape, offset = tuple(int(n) for n in spec["shape"]), int(spec["offset"])
        if spec["dtype"] != np.dtype(dtype).str or len(shape) != ndim or offset < 0:
            return None
        if offset + int(np.prod(shape)) * np.dtype(dtype).itemsize > size:
            return None
        found[name] = (np.dtype(dtype), offset, shape)
    wanted = {
        "seq_len": (rows,),
        "geometry": (rows, 4),
        "task": (rows,),
        "has_audio": (rows,),
        "offset": (rows,),
        "length": (rows,),
    }
    if any(found[name][2] != shape for name, shape in wanted.items()):
        return None
    return found


class IndexTableBuilder:
    """Collects entries one at a time (`add`) into the columns of an `IndexTable` (`build`)."""

    def __init__(self, tasks: Sequence[str]) -> None:
        self.tasks = tuple(tasks)
        self._codes = {name: code for code, name in enumerate(self.tasks)}
        self._seq_len = array("q")
        self._geometry = array("q")
        self._task = array("B")
        self._has_audio = array("B")
        self._ids, self._files = bytearray(), bytearray()
        self._ids_offsets, self._files_offsets = array("q", [0]), array("q", [0])
        self._offset, self._length = array("q"), array("q")

    def add(self, entry: IndexEntry) -> None:
        """Append `entry`. Raises `OverflowError` for a number beyond int64 (the caller names the line)."""
        geo = entry.geometry
        self._seq_len.append(entry.seq_len)
        self._geometry.extend((geo.num_latent_frames, geo.latent_height, geo.latent_width, geo.num_audio_latents))
        self._task.append(self._codes[entry.task])
        self._has_audio.append(entry.has_audio)
        self._ids += entry.sample_id.encode("utf-8", "surrogatepass")
        self._files += entry.file.encode("utf-8", "surrogatepass")
        self._ids_offsets.append(len(self._ids))
        self._files_offsets.append(len(self._files))
        self._offset.append(entry.offset)
        self._length.append(entry.length)

    def build(self) -> IndexTable:
        columns = {
            "seq_len": np.frombuffer(self._seq_len, dtype=np.int64),
            "geometry": np.frombuffer(self._geometry, dtype=np.int64).reshape(-1, 4),
            "task": np.frombuffer(self._task, dtype=np.uint8),
            "has_audio": np.frombuffer(self._has_audio, dtype=np.uint8).astype(bool),
            "ids": np.frombuffer(self._ids, dtype=np.uint8),
            "ids_offsets": np.frombuffer(self._ids_offsets, dtype=np.int64),
            "files": np.frombuffer(self._files, dtype=np.uint8),
            "files_offsets": np.frombuffer(self._files_offsets, dtype=np.int64),
            "offset": np.frombuffer(self._offset, dtype=np.int64),
            "length": np.frombuffer(self._length, dtype=np.int64),
        }
        return IndexTable(columns, self.tasks)


def table_of(entries: Iterable[IndexEntry], tasks: Sequence[str]) -> IndexTable:
    """The `IndexTable` of `entries`, in their order; `tasks` names every task they may have."""
    builder = IndexTableBuilder(tasks)
    for entry in entries:
        builder.add(entry)
    return builder.build()


class IndexRows(Sequence[IndexEntry]):
    """The entries of some rows of a table (`rows`, int64), in that order, made when asked for."""

    def __init__(self, table: IndexTable, rows: np.ndarray) -> None:
        self.table = table
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: int) -> IndexEntry:  # type: ignore[override]
        if isinstance(index, slice):
            return IndexRows(self.table, self.rows[index])  # type: ignore[return-value]
        return self.table[int(self.rows[index])]

    def __iter__(self) -> Iterator[IndexEntry]:
        for row in self.rows.tolist():
            yield self.table[row]


class Lengths(Sequence[int]):
    """Packed lengths as a read-only sequence of ints over one int64 array (`array`).

    It reads as the list it replaces (`==` a list, `+` to join, `index`, iteration), and as that array
    to numpy (`np.asarray(lengths)` copies nothing), so no caller needs a Python int per sample.
    """

    def __init__(self, values: Any) -> None:
        self.array = np.asarray(values, dtype=np.int64)
        if self.array.ndim != 1:
            raise ValueError(f"lengths must be one-dimensional, got shape {self.array.shape}")

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        if isinstance(index, slice):
            return Lengths(self.array[index])  # type: ignore[return-value]
        return int(self.array[index])

    def __iter__(self) -> Iterator[int]:
        step = 1 << 16
        for start in range(0, len(self), step):
            yield from self.array[start : start + step].tolist()

    def __contains__(self, value: object) -> bool:
        return bool((self.array == value).any()) if isinstance(value, (int, np.integer)) else False

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        hits = np.flatnonzero(self.array[start:stop] == value)
        if not hits.size:
            raise ValueError(f"{value!r} is not in lengths")
        return int(hits[0]) + (start if start >= 0 else max(len(self) + start, 0))

    def count(self, value: Any) -> int:
        return int((self.array == value).sum())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if dtype is None and not copy:
            return self.array
        return np.array(self.array, dtype=dtype, copy=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, (Sequence, np.ndarray)):
            return NotImplemented
        return len(self) == len(other) and bool(np.array_equal(self.array, np.asarray(other)))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[int]) -> Lengths:
        return Lengths(np.concatenate([self.array, np.asarray(other, dtype=np.int64)]))

    def __radd__(self, other: Sequence[int]) -> Lengths:
        return Lengths(np.concatenate([np.asarray(other, dtype=np.int64), self.array]))

    def __repr__(self) -> str:
        return f"Lengths({self.array.tolist() if len(self) <= 20 else f'<{len(self)} values>'})"
