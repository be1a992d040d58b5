"""Whether a checkpoint can be trusted: its files against their digests, its components against the run's."""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as ObjectFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointError
from ..infra.digest import ALGORITHM, digest_file
from ..infra.objects import LISTING, Folder, RemoteDir
from .folders import DIGESTS_FIELD, METADATA_FILE, STATE_FILE, committed_checkpoints, is_complete, read_trainer_state


def complete_checkpoints(root: Folder) -> list[Folder]:
    """Committed checkpoints that still have their state file and metadata, oldest commit first."""
    return [p for p in committed_checkpoints(root) if is_complete(p)]


def validate_checkpoint(path: Folder) -> str | None:
    """What is wrong with checkpoint `path`, in a few words naming the file; None if it looks loadable.

    Checks what can be checked without a model: `trainer_state.json` parses and has a step, the DCP
    `.metadata` unpickles, and every `.distcp` file it names exists with at least the bytes its
    entries need. Flipped bytes inside a file of the right size show only when it is loaded.
    """
    state_file = path / STATE_FILE
    if not state_file.is_file():
        return f"{state_file} is missing"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{state_file} is not valid JSON ({_first_line(exc)})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "model_config" not in state:
        return f"{state_file} has no step and model_config"
    if not (path / METADATA_FILE).is_file():
        return f"{path / METADATA_FILE} is missing"
    try:
        metadata = NamingReader(path).read_metadata()
        storage = metadata.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same: unreadable
        return f"{path / METADATA_FILE} cannot be read ({_first_line(exc)})"
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        have = file.stat().st_size
        if have < size:
            return f"{file} is truncated ({have} of {size} bytes)"
    return None


def file_digest_problem(path: Folder, rank: int = 0, world: int = 1) -> str | None:
    """What of checkpoint `path`'s files differs from the digests recorded at commit, for this rank's
    share (every `world`-th file from `rank`); None if all match or the checkpoint predates digests."""
    record = read_trainer_state(path).get(DIGESTS_FIELD)
    if record is None:
        return None
    if record.get("algorithm") != ALGORITHM:
        return f"{path / STATE_FILE} records digests of {record.get('algorithm')!r}; this h3train checks {ALGORITHM!r}"
    for i, (name, recorded) in enumerate(sorted(record["files"].items())):
        if i % world != rank:
            continue
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if digest_file(file) != recorded:
            return f"{file} does not match the digest recorded when the checkpoint was committed"
    return None


def verify_file_digests(path: Folder) -> None:
    """Every rank checks its share of checkpoint `path`'s files against their digests (collective); all
    raise `CorruptCheckpoint` naming the first file that differs on any rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems: list[str | None] = [file_digest_problem(path, rank, world)]
    if world > 1:
        mine, problems = problems[0], [None] * world
        dist.all_gather_object(problems, mine)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CorruptCheckpoint(f"checkpoint '{path}' cannot be read: {first}")


def _first_line(exc: BaseException) -> str:
    """`Type: first sentence of the message`: enough to say what is wrong in one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].split('. ')[0].rstrip('.')}" if text else type(exc).__name__


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (as opposed to one that does not fit this run)."""


class UnreadableFile(Exception):
    """A checkpoint file that failed to load, named (raised inside DCP's read on the failing rank)."""


class _Recording:
    """A DCP file system that notes the file it opened last (the one a failed read was on)."""

    current: str | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        self.current = str(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class _RecordingFileSystem(_Recording, FileSystem):
    pass


class _RecordingObjectFileSystem(_Recording, ObjectFileSystem):
    pass


# An export, the adapter files of each save and a verification read a checkpoint in one process on
# purpose (`no_dist=True`, also inside a run); DCP warns about it on every such read.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _Naming:
    """A DCP reader naming the file a read failed on (DCP's own error names none)."""

    fs: _Recording

    def read_data(self, plan, planner):  # noqa: ANN001, ANN201 - FileSystemReader's signature
        try:
            return super().read_data(plan, planner)
        except ValueError:
            # DCP's size checks: a tensor that does not fit this run's, not a damaged file.
            raise
        except Exception as exc:
            name = self.fs.current.rsplit("/", 1)[-1] if self.fs.current else "a .distcp file"
            raise UnreadableFile(f"{name} cannot be read ({_first_line(exc)})") from exc


class _FolderReader(_Naming, FileSystemReader):
    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _RecordingFileSystem()


class _ObjectReader(_Naming, FsspecReader):
    def __init__(self, url: str) -> None:
        FileSystemReader.__init__(self, url)
        self.fs = _RecordingObjectFileSystem()
        self.path = self.fs.init_path(url, **LISTING)


def NamingReader(path: str | os.PathLike | RemoteDir) -> FileSystemReader:  # noqa: N802 - a reader's constructor
    """DCP's reader of checkpoint `path` (a folder, or a prefix on object storage: its fsspec reader), naming
    the file a read failed on."""
    if isinstance(path, RemoteDir):
        return _ObjectReader(str(path))
    return _FolderReader(path)


def check_components(path: Folder, components: dict[str, Stateful]) -> dict[str, Stateful]:
    """On this rank, before the collective read: the components of this run to read from `path`.

    An optional component (`fresh_if_missing`, e.g. an EMA switched on for the resumed part of a
    run) that the checkpoint lacks is left out, to start afresh. Raises CorruptCheckpoint when the
    metadata cannot be read, CheckpointError naming any other component the checkpoint lacks.
    """
    try:
        saved = {key.split(".", 1)[0] for key in NamingReader(path).read_metadata().state_dict_metadata}
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: unreadable
        raise CorruptCheckpoint(f"checkpoint '{path}' cannot be read: {METADATA_FILE} ({_first_line(exc)})") from exc
    optional = {name for name, c in components.items() if getattr(c, "fresh_if_missing", False)}
    missing = [name for name in components if name not in saved and name not in optional]
    if missing:
        raise CheckpointError(
            f"checkpoint '{path}' holds no state for {', '.join(missing)}, which this run has (it holds "
            f"{', '.join(sorted(saved))}); resume with the settings it was written with, or start afresh"
        )
    return {name: c for name, c in components.items() if name in saved}


def read_components(path: Folder, components: dict[str, Stateful]) -> dict[str, Any]:
    """Read every component's saved state from checkpoint `path` (collective); apply nothing yet.

    Raises CorruptCheckpoint naming the file when the files cannot be read, and CheckpointError
    when the checkpoint does not fit this run (a tensor of another shape). DCP gathers a failure
    on any rank and raises it on every rank, so all ranks fail together.
    """
    state = {name: component.state_dict() for name, component in components.items()}
    try:
        dcp.load(state, storage_reader=NamingReader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any read failure is reported
        failures = getattr(exc, "failures", None) or {}
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [exc]
        kind = CorruptCheckpoint if any(isinstance(e, UnreadableFile) for e in inner) else CheckpointError
        raise kind(f"checkpoint '{path}' cannot be read: {read_failure_reason(exc)}") from exc
    return state


def read_failure_reason(exc: BaseException) -> str:
    # DCP wraps per-rank failures in a CheckpointException whose text is a whole traceback per rank.
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"{inner} (rank {rank})" if isinstance(inner, UnreadableFile) else f"rank {rank}: {_first_line(inner)}"
    return str(exc) if isinstance(exc, UnreadableFile) else _first_line(exc)
