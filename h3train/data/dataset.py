"""A folder of cached samples, planned from its index without opening the sample files.

Sample `i` is the `i`-th index entry that passes the task filter (and `data.max_rows`), in index order,
so every rank that reads the same index numbers the samples the same way. The entries come from the
compact index beside `index.jsonl` (`index_table.py`), mapped, not parsed: the filters are masks over its
columns, and an entry is made only when a sample is read.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import DatasetError, SampleError
from ..tasks.sample import TrainingSample
from ..tasks.table import TRAINING_TASKS
from .dataset_index import location_of, open_index, resolve_in_folder
from .index_table import IndexRows, IndexTable, Lengths
from .location import INDEX_NAME, SampleLocation
from .sample_file import read_sample
from .storage import dataset_folder

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


def index_entries(folder: str | os.PathLike) -> IndexTable:
    """`open_index(folder)`: the compact index, opened once per process for as long as `index.jsonl` is unchanged.

    Start-up reads the index twice, in the preflight checks before any process group and in the
    dataset built after it; both get this one table.
    """
    index = Path(folder) / INDEX_NAME
    try:
        st = index.stat()
    except OSError:
        return open_index(folder)  # raises the DatasetError that names what is missing
    return _opened_index(str(folder), st.st_ino, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _opened_index(folder: str, inode: int, mtime_ns: int, size: int) -> IndexTable:
    return open_index(folder)


class DroppedSamples(Sequence[tuple[str, int]]):
    """(sample id, packed rows) of the index rows `rows` of `table`, made when asked for."""

    def __init__(self, table: IndexTable, rows: np.ndarray) -> None:
        self.entries = IndexRows(table, rows)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> tuple[str, int]:  # type: ignore[override]
        entry = self.entries[index]
        return entry.sample_id, entry.seq_len


class CachedDataset:
    """Indexable `TrainingSample`s of one dataset folder.

    `task_filter` is a `task.name`: the dataset holds the index entries of its `TRAINING_TASKS[...].sample_tasks`
    (a t2va run skips the fl2va clips of a mixed folder). `on_error="skip"` replaces a sample
    whose file fails validation (`SampleError`) by the next loadable one in index order, with a warning;
    the substitute is a function of the index alone, so every SP rank still gets the identical sample.
    I/O errors (`OSError`) always raise: they can be transient and differ between ranks.
    `max_rows` (`data.max_rows`, 0: no bound) drops the entries that pack to more rows, listed in
    `dropped` as (sample id, rows), before the samples are numbered.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        task_filter: str = "mixed",
        on_error: str = "raise",
        on_skip: Callable[[str, str], None] | None = None,
        injected_corrupt: Iterable[str] = (),
        max_rows: int = 0,
    ) -> None:
        if task_filter not in TRAINING_TASKS:
            raise DatasetError(f"task filter '{task_filter}' is not one of {', '.join(TRAINING_TASKS)}")
        if on_error not in ON_ERROR:
            raise DatasetError(f"on_error '{on_error}' is not one of {', '.join(ON_ERROR)}")
        # As the config names it (a folder, or a URL: `data/storage.py`), and the local folder planned from.
        self.name = os.fspath(folder)
        self.folder = dataset_folder(folder)
        self.where = f"dataset '{self.name}'"
        self.task_filter = task_filter
        self.on_error = on_error
        table = index_entries(self.folder)
        accepted = TRAINING_TASKS[task_filter].sample_tasks
        rows = table.rows_of(accepted)
        if not rows.size:
            found = sorted(table.task_counts()) or ["none"]
            raise DatasetError(
                f"dataset '{self.name}' has no samples for task '{task_filter}' (it accepts "
                f"{', '.join(accepted)}; the index lists {len(table)} samples of tasks {', '.join(found)})"
            )
        lengths = table.seq_len[rows]
        self.dropped = DroppedSamples(table, rows[:0])
        if max_rows > 0:
            longer = lengths > max_rows
            self.dropped = DroppedSamples(table, rows[longer])
            if longer.all():
                raise DatasetError(
                    f"dataset '{self.name}': every {task_filter} sample packs to more than data.max_rows={max_rows} "
                    f"rows (the shortest {int(lengths.min())}); raise data.max_rows"
                )
            rows, lengths = rows[~longer], lengths[~longer]
        # Index entry `i` of the dataset is row `rows[i]` of the table; entries are made when asked for.
        self.entries = IndexRows(table, rows)
        self._lengths = Lengths(lengths)
        self._skipped: set[int] = set()
        # The prefetcher's threads may reach the same unreadable sample at once: it is reported once.
        self._skip_lock = threading.Lock()
        # Called as `on_skip(sample_id, reason)` for every sample `skip` passes over.
        self.on_skip = on_skip
        # Sample ids that fail validation as a corrupt file would (`debug.fault=corrupt_sample@ID`).
        self.injected_corrupt = frozenset(injected_corrupt)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def lengths(self) -> Lengths:
        """Packed sequence length of every sample, from the index (for bucketing and planning)."""
        return self._lengths

    def path(self, index: int) -> SampleLocation:
        """Where sample `index` lies: its file, or its bytes in a shard (`data/shard_files.py`), here or on object
        storage (`data/storage.py`)."""
        entry = self.entries[index]
        at = location_of(self.folder, entry)
        if at.store is None:
            return SampleLocation(resolve_in_folder(self.folder, entry.file, self.where), entry.offset, entry.length)
        return at

    def load(self, index: int) -> TrainingSample:
        """Read sample `index`, checking it is the one the index describes (a stale index raises)."""
        entry = self.entries[index]
        path = self.path(index)
        if entry.sample_id in self.injected_corrupt:
            raise SampleError(f"sample '{path}': field 'video_latents' is corrupt (injected by debug.fault)")
        sample = read_sample(path)
        if sample.sample_id != entry.sample_id or sample.task != entry.task:
            raise SampleError(
                f"sample '{path}': holds {sample.task} sample '{sample.sample_id}', the index lists "
                f"{entry.task} sample '{entry.sample_id}'; rebuild the index with 'h3train index {self.name}'"
            )
        if sample.layout.seq_len != entry.seq_len:
            raise SampleError(
                f"sample '{path}': packs to {sample.layout.seq_len} rows, the index says "
                f"{entry.seq_len}; rebuild the index with 'h3train index {self.name}'"
            )
        return sample

    def __getitem__(self, index: int) -> TrainingSample:
        if not 0 <= index < len(self.entries):
            raise IndexError(f"sample {index} outside [0, {len(self.entries)})")
        if self.on_error == "raise":
            return self.load(index)
        for step in range(len(self.entries)):
            candidate = (index + step) % len(self.entries)
            if candidate in self._skipped:
                continue
            try:
                return self.load(candidate)
            except SampleError as exc:
                with self._skip_lock:
                    first = candidate not in self._skipped
                    self._skipped.add(candidate)
                if first:
                    logger.warning("skipping unreadable sample %d: %s", candidate, exc)
                    if self.on_skip is not None:
                        self.on_skip(self.entries[candidate].sample_id, str(exc))
        raise DatasetError(f"dataset '{self.name}': no sample of task '{self.task_filter}' could be read")
