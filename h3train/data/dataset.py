"""A folder of cached samples, planned from its `index.jsonl` without opening the sample files.

Sample `i` is the `i`-th index entry that passes the task filter, in index order, so every rank that
reads the same index numbers the samples the same way.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ..tasks.packed import PackedSample
from ..tasks.table import TRAINING_TASKS
from .format import INDEX_NAME, DatasetError, IndexEntry, SampleError, read_index, read_sample, resolve_in_folder

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


def index_entries(folder: str | os.PathLike) -> list[IndexEntry]:
    """`read_index(folder)`, parsed once per process for as long as `index.jsonl` is unchanged.

    Start-up reads the index twice, in the preflight checks before any process group and in the
    dataset built after it; an index of a million samples takes tens of seconds to parse.
    """
    index = Path(folder) / INDEX_NAME
    try:
        st = index.stat()
    except OSError:
        return read_index(folder)  # raises the DatasetError that names what is missing
    return list(_parsed_index(str(folder), st.st_ino, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=2)
def _parsed_index(folder: str, inode: int, mtime_ns: int, size: int) -> tuple[IndexEntry, ...]:
    return tuple(read_index(folder))


class CachedDataset:
    """Indexable `PackedSample`s of one dataset folder.

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
        self.folder = Path(folder)
        self.task_filter = task_filter
        self.on_error = on_error
        all_entries = index_entries(self.folder)
        accepted = TRAINING_TASKS[task_filter].sample_tasks
        self.entries: list[IndexEntry] = [e for e in all_entries if e.task in accepted]
        if not self.entries:
            found = sorted({e.task for e in all_entries}) or ["none"]
            raise DatasetError(
                f"dataset '{self.folder}' has no samples for task '{task_filter}' (it accepts "
                f"{', '.join(accepted)}; the index lists {len(all_entries)} samples of tasks {', '.join(found)})"
            )
        self.dropped: list[tuple[str, int]] = []
        if max_rows > 0:
            self.dropped = [(e.sample_id, e.seq_len) for e in self.entries if e.seq_len > max_rows]
            self.entries = [e for e in self.entries if e.seq_len <= max_rows]
            if not self.entries:
                raise DatasetError(
                    f"dataset '{self.folder}': every {task_filter} sample packs to more than data.max_rows={max_rows} "
                    f"rows (the shortest {min(n for _, n in self.dropped)}); raise data.max_rows"
                )
        self._skipped: set[int] = set()
        # Called as `on_skip(sample_id, reason)` for every sample `skip` passes over.
        self.on_skip = on_skip
        # Sample ids that fail validation as a corrupt file would (`debug.fault=corrupt_sample@ID`).
        self.injected_corrupt = frozenset(injected_corrupt)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def lengths(self) -> list[int]:
        """Packed sequence length of every sample, from the index (for bucketing and planning)."""
        return [e.seq_len for e in self.entries]

    def path(self, index: int) -> Path:
        return resolve_in_folder(self.folder, self.entries[index].file, f"dataset '{self.folder}'")

    def load(self, index: int) -> PackedSample:
        """Read sample `index`, checking it is the one the index describes (a stale index raises)."""
        entry = self.entries[index]
        path = self.path(index)
        if entry.sample_id in self.injected_corrupt:
            raise SampleError(f"sample '{path}': field 'video_latents' is corrupt (injected by debug.fault)")
        sample = read_sample(path)
        if sample.sample_id != entry.sample_id or sample.task != entry.task:
            raise SampleError(
                f"sample '{path}': holds {sample.task} sample '{sample.sample_id}', the index lists "
                f"{entry.task} sample '{entry.sample_id}'; rebuild the index with write_index"
            )
        if sample.layout.seq_len != entry.seq_len:
            raise SampleError(
                f"sample '{path}': packs to {sample.layout.seq_len} rows, the index says "
                f"{entry.seq_len}; rebuild the index with write_index"
            )
        return sample

    def __getitem__(self, index: int) -> PackedSample:
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
                self._skipped.add(candidate)
                logger.warning("skipping unreadable sample %d: %s", candidate, exc)
                if self.on_skip is not None:
                    self.on_skip(self.entries[candidate].sample_id, str(exc))
        raise DatasetError(f"dataset '{self.folder}': no sample of task '{self.task_filter}' could be read")
