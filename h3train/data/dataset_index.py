"""The index of a dataset folder: `index.jsonl`, one JSON line per sample file (`sample_file.py`).

`index.jsonl` lists the samples, one JSON line each (`IndexEntry`); it is the source of truth, and beside
it lies its compact index (`index_table.py`), which starts read instead (`open_index`) and which is
rebuilt from it whenever it no longer matches its bytes. A hand-edited index is held against the sample
files' headers by `index_problems` (what `h3train check --strict` and a start report) and rewritten from
them by `rebuild_index` (`h3train index DIR`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..errors import DatasetError, SampleError
from ..infra.atomic import atomic_write
from ..tasks.layout import Geometry
from ..tasks.table import SAMPLE_TASKS
from .index_table import (
    COMPACT_NAME,
    STRING_BLOCK,
    IndexEntry,
    IndexSource,
    IndexTable,
    IndexTableBuilder,
    table_of,
)
from .location import INDEX_NAME, SAMPLE_SUFFIX, SHARD_SUFFIX, SampleLocation, shard_samples
from .sample_file import SampleHeader, as_location, read_header

logger = logging.getLogger(__name__)


def resolve_in_folder(folder: Path, relative: str, where: str) -> Path:
    """`folder / relative`, refusing absolute paths and paths that leave the folder."""
    rel = Path(relative)
    if not relative or rel.is_absolute() or ".." in rel.parts:
        raise DatasetError(f"{where}: file '{relative}' must be a path relative to the dataset folder, without '..'")
    resolved = (folder / rel).resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise DatasetError(f"{where}: file '{relative}' resolves to '{resolved}', outside the dataset folder")
    return resolved


class _FolderPaths:
    """`resolve_in_folder` for every file of one index, with each directory resolved and listed once.

    A file whose directory resolves inside the folder and whose own name is not a symbolic link there
    resolves inside the folder too: it passes without a look at the file system. Anything else (a link,
    an odd spelling, a directory outside) goes through `resolve_in_folder` itself, which decides as ever.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.root = folder.resolve()
        self.directories: dict[tuple[str, ...], tuple[bool, frozenset[str]]] = {}

    def check(self, relative: str, where: str) -> None:
        parts = relative.split("/")
        if not relative or relative.startswith("/") or "\0" in relative or any(p in ("", ".", "..") for p in parts):
            resolve_in_folder(self.folder, relative, where)
            return
        directory = tuple(parts[:-1])
        if directory not in self.directories:
            self.directories[directory] = self._look(directory)
        inside, links = self.directories[directory]
        if not inside or parts[-1] in links:
            resolve_in_folder(self.folder, relative, where)

    def _look(self, directory: tuple[str, ...]) -> tuple[bool, frozenset[str]]:
        """Whether `directory` resolves inside the folder, and the names of the links in it."""
        resolved = self.folder.joinpath(*directory).resolve()
        try:
            with os.scandir(resolved) as listing:
                links = frozenset(e.name for e in listing if e.is_symlink())
        except OSError:
            links = frozenset()  # nothing there to follow: names resolve as they are spelled
        return resolved.is_relative_to(self.root), links


def write_index(folder: str | os.PathLike) -> list[IndexEntry]:
    """Rebuild `index.jsonl` from every `*.safetensors` file and every sample of each shard (`*.h3shard`,
    `data/shard_files.py`) under `folder` (headers only), and the compact index beside it (`index_table.py`).

    A subfolder with an `index.jsonl` of its own is another dataset (the encoder's held-out split):
    its files are left out. Files are listed in sorted relative-path order so the index, and with it
    the sample numbering, is reproducible. Every header is validated; both files are written atomically.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder '{folder}' does not exist")
    entries, seen = [], {}
    nested = [p.parent for p in folder.rglob(INDEX_NAME) if p.parent != folder]
    files = sorted(
        p
        for suffix in (SAMPLE_SUFFIX, SHARD_SUFFIX)
        for p in folder.rglob(f"*{suffix}")
        if not p.name.startswith(".") and not any(d in p.parents for d in nested)
    )
    locations = [at for p in files for at in (shard_samples(p) if p.suffix == SHARD_SUFFIX else [SampleLocation(p)])]
    for path in locations:
        header = read_header(path)
        meta = header.meta
        if meta["sample_id"] in seen:
            raise DatasetError(
                f"dataset '{folder}': sample id '{meta['sample_id']}' is used by both "
                f"'{seen[meta['sample_id']]}' and '{path}'"
            )
        seen[meta["sample_id"]] = path
        entries.append(entry_of(folder, path, header))
    write_entries(folder, entries)
    return entries


def write_entries(folder: Path, entries: list[IndexEntry]) -> None:
    """Write `entries` as `folder/index.jsonl` and its compact index, each atomically."""
    text = "".join(json.dumps(e.to_json()) + "\n" for e in entries).encode("utf-8")
    index = folder / INDEX_NAME
    atomic_write(index, lambda tmp: tmp.write_bytes(text))
    source = IndexSource(len(text), index.stat().st_mtime_ns, hashlib.sha256(text).hexdigest())
    table_of(entries, tuple(SAMPLE_TASKS)).write(folder / COMPACT_NAME, source)


def entry_of(folder: Path, path: Path | SampleLocation, header: SampleHeader) -> IndexEntry:
    """The index entry of the sample at `path` (a file under `folder`, or its bytes in a shard there), from its
    validated header."""
    at = as_location(path)
    meta = header.meta
    return IndexEntry(
        sample_id=meta["sample_id"],
        file=at.path.as_posix() if at.store is not None else at.path.relative_to(folder).as_posix(),
        task=meta["task"],
        seq_len=header.seq_len(),
        geometry=header.geometry,
        has_audio=meta["has_audio"],
        offset=at.offset,
        length=at.length,
    )


def location_of(folder: Path, entry: IndexEntry) -> SampleLocation:
    """Where the sample an index entry of `folder` lists lies (`entry.file` is relative to `folder`, or to the
    URL of the dataset whose index `folder` holds a copy of, `storage.mirror_index`)."""
    from .storage import remote_store

    store = remote_store(folder)
    if store is not None:
        return SampleLocation(PurePosixPath(entry.file), entry.offset, entry.length, store)  # type: ignore[arg-type]
    return SampleLocation(folder / entry.file, entry.offset, entry.length)


def _differences(listed: IndexEntry, found: IndexEntry) -> str:
    """What an index line says and its file's header holds instead, in words; empty when they agree."""
    said, held = [], []
    for name, attribute in (
        ("sample", "sample_id"),
        ("task", "task"),
        ("seq_len", "seq_len"),
        ("geometry", "geometry"),
        ("has_audio", "has_audio"),
    ):
        a, b = getattr(listed, attribute), getattr(found, attribute)
        if a != b:
            said.append(f"{name} {_said(a)}")
            held.append(f"{name} {_said(b)}")
    if not said:
        return ""
    return f"the line says {', '.join(said)}, its file '{found.file}' holds {', '.join(held)}"


def _said(value: Any) -> str:
    if isinstance(value, Geometry):
        return "x".join(str(n) for n in dataclasses.astuple(value))
    return f"'{value}'" if isinstance(value, str) else str(value)


def index_problems(folder: str | os.PathLike, table: IndexTable, files: bool = True, headers: bool = True) -> list[str]:
    """What `folder`'s index (`table`, its open compact index) gets wrong about the sample files: one line
    each, `index.jsonl line N: ...`, in line order; empty when nothing is.

    `files` (cheap: the index's columns and one listing per directory, no sample file opened): a sample id
    or a file listed twice (trained twice an epoch), a file that does not exist. `headers`: every listed
    file's header (not its tensors) read and held against its line: sample id, task, seq_len, geometry
    and has_audio (a header that does not validate is left to the sample's read, as `data.on_error` asks).
    A file listed twice or missing is not read.
    """
    folder = Path(folder)
    # (row, the earlier row it repeats or None, what is wrong or what repeats): rows become line numbers at the end.
    problems: list[tuple[int, int | None, str]] = []
    repeated = _repeated_rows(table)
    skipped = {row for row, _, _ in repeated}
    missing = _missing_rows(folder, table, skipped)
    skipped.update(missing)
    if files:
        problems += repeated
        for row in missing:
            listed = table[row]
            problems.append((row, None, f"sample '{listed.sample_id}': its file '{listed.file}' does not exist"))
    if headers:
        for row in range(len(table)):
            if row in skipped:
                continue
            listed = table[row]
            at = location_of(folder, listed)
            try:
                found = entry_of(folder, at, read_header(at))
            except SampleError:
                # The file's fault, not the index's: its read says so when the sample is drawn, raised or
                # passed over as `data.on_error` asks.
                continue
            differences = _differences(listed, found)
            if differences:
                problems.append((row, None, f"sample '{listed.sample_id}': {differences}"))
    if not problems:
        return []
    # Rows are counted without blank lines; a user edits index.jsonl by its line numbers.
    lines = _line_numbers(folder / INDEX_NAME)
    again = "is listed again (first on line {}): it trains twice an epoch"
    return [
        f"{INDEX_NAME} line {lines[row]}: {text}" + ("" if earlier is None else " " + again.format(lines[earlier]))
        for row, earlier, text in sorted(problems, key=lambda problem: problem[0])
    ]


@dataclass(frozen=True)
class IndexRebuild:
    """What `rebuild_index` did: the entries the index now lists, one line per fix (empty: nothing to
    fix, nothing written), and where the index it replaced was kept (None when none was replaced)."""

    entries: list[IndexEntry]
    fixes: list[str]
    backup: Path | None


def rebuild_index(folder: str | os.PathLike) -> IndexRebuild:
    """Rewrite `folder/index.jsonl`, and its compact index, from the headers of the sample files it lists.

    Only the files the index lists are read, so a sample file whose line was deleted stays out: a removal
    is the absence of its line. A line is rewritten when its sample id, task, seq_len, geometry or
    has_audio disagree with its file's header (or it is malformed but names a file), and dropped when its
    file does not exist or an earlier line lists the same file. Without an `index.jsonl`, every sample
    file under `folder` is listed (`write_index`). With nothing to fix nothing is written; otherwise the
    old index is first kept beside it (`_backup_name`), then both files are written atomically.

    Raises `DatasetError` (a line naming no file, two files holding one sample id) or `SampleError` (a
    listed file whose header does not validate) naming the line, before anything is written.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder '{folder}' does not exist")
    index = folder / INDEX_NAME
    if not index.is_file():
        entries = write_index(folder)
        return IndexRebuild(entries, [f"{INDEX_NAME}: none was there; listed all {len(entries)} sample files"], None)
    again = f"then run 'h3train index {folder}' again"
    old = index.read_bytes()
    try:
        text = old.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"index '{index}': not UTF-8 text ({exc}); fix it, {again}") from None
    paths = _FolderPaths(folder)
    entries: list[IndexEntry] = []
    fixes: list[str] = []
    by_file: dict[tuple[str, int], int] = {}
    by_id: dict[str, tuple[int, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where, label = f"index '{index}' line {number}", f"{INDEX_NAME} line {number}"
        listed: IndexEntry | None
        try:
            listed = _parse_index_line(paths, where, line)
            name = listed.file
        except DatasetError as exc:
            listed, name = None, _file_named(line)
            if name is None:
                raise DatasetError(f"{exc}; fix or delete the line, {again}") from None
            paths.check(name, where)
        at = SampleLocation(folder / name) if listed is None else location_of(folder, listed)
        key = (PurePosixPath(name).as_posix(), at.offset)
        if key in by_file:
            again_at = f" from byte {at.offset}" if at.length >= 0 else ""
            fixes.append(f"{label}: dropped, it lists file '{name}'{again_at} again (first on line {by_file[key]})")
            continue
        if not at.path.is_file():
            fixes.append(f"{label}: dropped, its file '{name}' does not exist")
            continue
        try:
            found = entry_of(folder, at, read_header(at))
        except SampleError as exc:
            raise SampleError(f"{exc}; re-encode it or delete {label}, {again}") from None
        if found.sample_id in by_id:
            first, other = by_id[found.sample_id]
            raise DatasetError(
                f"{where}: file '{found.file}' holds sample '{found.sample_id}', as does '{other}' (line {first}); "
                f"delete one of the two lines, {again}"
            )
        by_file[key], by_id[found.sample_id] = number, (number, found.file)
        if listed is None:
            fixes.append(f"{label}: rewritten from its file '{found.file}' (the line was malformed)")
        elif differences := _differences(listed, found):
            fixes.append(f"{label}: rewritten, {differences}")
        entries.append(found)
    if not fixes:
        return IndexRebuild(entries, [], None)
    backup = _backup_name(index)
    atomic_write(backup, lambda tmp: tmp.write_bytes(old))
    write_entries(folder, entries)
    return IndexRebuild(entries, fixes, backup)


def _file_named(line: str) -> str | None:
    """The `file` a malformed index line still names, or None."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    name = row.get("file") if isinstance(row, dict) else None
    return name if isinstance(name, str) and name else None


def _backup_name(index: Path) -> Path:
    """`index.jsonl.bak-<UTC time>` beside `index`, numbered on when one of that second is there already."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    backup = index.with_name(f"{index.name}.bak-{stamp}")
    number = 1
    while backup.exists():
        number += 1
        backup = index.with_name(f"{index.name}.bak-{stamp}-{number}")
    return backup


def _line_numbers(index: Path) -> list[int]:
    """The line number (from 1) of each entry of `index`, blank lines skipped, as `read_index` counts them."""
    return [number for number, line in enumerate(index.read_text().splitlines(), start=1) if line.strip()]


def _repeated_rows(table: IndexTable) -> list[tuple[int, int, str]]:
    """(row, the earlier row it repeats, what repeats) of each row whose sample id or file an earlier row that
    is not itself a repeat lists, in row order.

    Only the rows whose id or file hash like another row's (`IndexTable.hashes`) can repeat one, or be
    repeated: those alone are decoded and compared, so an index without repeats holds no string per row.
    """
    # The samples of one shard share its file: a sample's bytes are its file and where they start.
    where = table.hashes("files") ^ (table.columns["offset"] * np.int64(-7046029254386353131))
    candidates = np.union1d(_shared(table.hashes("ids")), _shared(where))
    first_id: dict[str, int] = {}
    first_file: dict[tuple[str, int], int] = {}
    found = []
    for row in candidates.tolist():
        entry = table[row]
        sample_id, name = entry.sample_id, (entry.file, entry.offset)
        if name in first_file or sample_id in first_id:
            earlier = first_file.get(name, first_id.get(sample_id))
            what = f"file '{entry.file}'" + (f" from byte {entry.offset}" if entry.in_shard else "")
            found.append((row, earlier, f"sample '{sample_id}'" if sample_id in first_id else what))
            continue
        first_id[sample_id], first_file[name] = row, row
    return found


def _shared(values: np.ndarray) -> np.ndarray:
    """The positions (int64, ascending by value) of the entries of `values` [N] that another entry equals."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    same = ordered[1:] == ordered[:-1]
    shared = np.zeros(values.shape[0], dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    return order[shared]


def _missing_rows(folder: Path, table: IndexTable, skipped: set[int]) -> list[int]:
    """The rows, but those in `skipped`, whose file is not in the listing of its directory, ascending.

    The files are decoded a block of rows at a time (`STRING_BLOCK`) and each directory is listed once (on
    object storage, one listing of its objects).
    """
    from .storage import remote_store

    store = remote_store(folder)
    listings: dict[str, _Listing] = {}
    missing = []
    n = len(table)
    for start in range(0, n, STRING_BLOCK):
        asked: dict[str, tuple[list[int], list[bytes]]] = {}
        for row, name in enumerate(table.strings("files", start, min(start + STRING_BLOCK, n)), start=start):
            if row in skipped:
                continue
            directory, _, base = name.rpartition("/")
            rows, bases = asked.setdefault(directory, ([], []))
            rows.append(row)
            bases.append(base.encode("utf-8", "surrogatepass"))
        for directory, (rows, bases) in asked.items():
            if directory not in listings:
                listings[directory] = _Listing(
                    _names_in(folder / directory) if store is None else iter(store.names_in(directory))
                )
            missing += [row for row, there in zip(rows, listings[directory].holds(bases)) if not there]
    return sorted(missing)


class _Listing:
    """The names in one directory (none when it is not one), listed once: a million stat calls cost more.

    Held as the `hash()` of each name's UTF-8 bytes (int64, sorted, `order` the listing position of each)
    and those bytes end to end, about 50 bytes a name where a set of strings takes over 100; a name whose
    hash is found is compared byte for byte. A name is encoded as the compact index encodes its files
    (`surrogatepass`), so bytes are equal where the strings are.
    """

    def __init__(self, names: Iterator[str]) -> None:
        hashes, self.ends, self.blob = array("q"), array("q", [0]), bytearray()
        for text in names:
            name = text.encode("utf-8", "surrogatepass")
            hashes.append(hash(name))
            self.blob += name
            self.ends.append(len(self.blob))
        unsorted = np.frombuffer(hashes, dtype=np.int64)
        order = np.argsort(unsorted, kind="stable")
        self.hashes = unsorted[order]
        self.order = array("q", order.tobytes())

    def holds(self, names: list[bytes]) -> list[bool]:
        """Whether each of `names` (UTF-8 bytes) is in the directory."""
        found = [False] * len(names)
        size = len(self.order)
        if not size or not names:
            return found
        wanted = np.fromiter((hash(name) for name in names), dtype=np.int64, count=len(names))
        at = np.minimum(np.searchsorted(self.hashes, wanted), size - 1)
        hit = np.flatnonzero(self.hashes[at] == wanted)
        for i, k in zip(hit.tolist(), at[hit].tolist()):
            # Names that hash alike lie side by side from `k`: one of them may be this one.
            while k < size and self.hashes[k] == wanted[i]:
                j = self.order[k]
                if self.blob[self.ends[j] : self.ends[j + 1]] == names[i]:
                    found[i] = True
                    break
                k += 1
        return found


def _names_in(directory: Path) -> Iterator[str]:
    """The names in `directory` one at a time (a million of them are never a list), none when it is not one."""
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                yield entry.name
    except OSError:
        return


def read_index(folder: str | os.PathLike) -> list[IndexEntry]:
    """Parse `folder/index.jsonl`. Raises `DatasetError` naming the line of any malformed entry."""
    folder = Path(folder)
    index = _index_file(folder)
    paths = _FolderPaths(folder)
    entries = []
    for number, line in enumerate(index.read_text().splitlines(), start=1):
        if line.strip():
            entries.append(_parse_index_line(paths, f"index '{index}' line {number}", line))
    return entries


def open_index(folder: str | os.PathLike) -> IndexTable:
    """The entries of `folder/index.jsonl`, from the compact index beside it, mapped read-only.

    A compact index that is missing, unreadable or built from other bytes than `index.jsonl` holds now
    is rebuilt from `index.jsonl` (each line checked as `read_index` checks it, a `DatasetError` naming
    the line) and written atomically beside it; where the folder cannot be written, the rebuilt columns
    are used from memory, with a warning.
    """
    folder = Path(folder)
    index = _index_file(folder)
    compact = folder / COMPACT_NAME
    found = IndexTable.open(compact)
    if found is not None and found[1].matches(index):
        return found[0]
    table, source = _build_table(folder, index)
    try:
        table.write(compact, source)
    except OSError as exc:
        logger.warning("cannot write the compact index '%s' (%s); using it from memory", compact, exc)
        return table
    written = IndexTable.open(compact)
    # Another process may have replaced it meanwhile, from other bytes: then keep the one built here.
    return written[0] if written is not None and written[1] == source else table


def _index_file(folder: Path) -> Path:
    if not folder.is_dir():
        raise DatasetError(f"dataset folder '{folder}' does not exist")
    index = folder / INDEX_NAME
    if not index.is_file():
        raise DatasetError(f"dataset folder '{folder}' has no {INDEX_NAME}; build it with 'h3train index {folder}'")
    return index


def _build_table(folder: Path, index: Path) -> tuple[IndexTable, IndexSource]:
    """The table of `index`'s lines, split and checked as `read_index` does, and the bytes it read."""
    builder = IndexTableBuilder(tuple(SAMPLE_TASKS))
    paths = _FolderPaths(folder)
    hasher, size, number = hashlib.sha256(), 0, 0
    with open(index, "rb") as handle:
        mtime_ns = os.fstat(handle.fileno()).st_mtime_ns
        for raw in handle:
            hasher.update(raw)
            size += len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"index '{index}' line {number + 1}: not UTF-8 text ({exc})") from None
            # `read_index` splits the decoded text with `str.splitlines`, at more than newlines.
            for line in text.splitlines():
                number += 1
                if not line.strip():
                    continue
                where = f"index '{index}' line {number}"
                try:
                    builder.add(_parse_index_line(paths, where, line))
                except OverflowError as exc:
                    raise DatasetError(f"{where}: malformed entry (OverflowError: {exc})") from None
    return builder.build(), IndexSource(size, mtime_ns, hasher.hexdigest())


def _parse_index_line(paths: _FolderPaths, where: str, line: str) -> IndexEntry:
    try:
        row = json.loads(line)
        geo = row["geometry"]
        entry = IndexEntry(
            sample_id=str(row["id"]),
            file=str(row["file"]),
            task=str(row["task"]),
            seq_len=int(row["seq_len"]),
            geometry=Geometry(
                int(geo["num_latent_frames"]),
                int(geo["latent_height"]),
                int(geo["latent_width"]),
                int(geo["num_audio_latents"]),
            ),
            has_audio=bool(row["has_audio"]),
            offset=int(row.get("offset", 0)),
            length=int(row.get("length", -1)),
        )
        if entry.length < -1 or entry.offset < 0 or (entry.length < 0 and entry.offset):
            raise ValueError(f"offset {entry.offset}, length {entry.length}: not a sample's bytes")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DatasetError(f"{where}: malformed entry ({type(exc).__name__}: {exc})") from None
    if entry.task not in SAMPLE_TASKS:
        raise DatasetError(f"{where}: task '{entry.task}' is not one of {', '.join(SAMPLE_TASKS)}")
    paths.check(entry.file, where)
    return entry
