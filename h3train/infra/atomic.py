"""Atomic file writes: readers see the old file or the complete new one, never a torn one.

Each write goes to a hidden temporary name in the target's folder, is flushed to disk, and is
renamed over the target (`os.replace` is atomic within a filesystem).

Every file written here gets the mode a plain `open()` would give it, `0o666 & ~umask`
(`file_mode()`), whatever the writer used: safetensors creates its files 0600, which on shared
storage would hide samples, exports and checkpoints from the collaborators who can read the JSON
written beside them.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .objects import RemoteDir


def _read_umask() -> int:
    # Linux reports it without changing it; `os.umask` has to set it to read it, which another
    # thread creating a file at that moment would see.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        current = os.umask(0o022)
        os.umask(current)
    return current


_umask_lock = threading.Lock()


def file_mode() -> int:
    """The permission bits `open()` gives a new file in this process now: `0o666 & ~umask`."""
    return 0o666 & ~_read_umask()


def apply_file_mode(path: str | os.PathLike) -> None:
    """Give an existing file the mode of `file_mode()` (a no-op where it already has it)."""
    mode = file_mode()
    if os.stat(path).st_mode & 0o777 != mode:
        os.chmod(path, mode)


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (after a rename), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_taken(path: Path | RemoteDir) -> bool:
    """Whether anything has the name `path` (a link that points nowhere too; on object storage, an object
    or a prefix)."""
    return path.exists() if isinstance(path, RemoteDir) else os.path.lexists(path)


def free_name(path: Path | RemoteDir) -> Path | RemoteDir:
    """`path` if nothing has that name, else `path.2`, `path.3`, ...: a name nothing is moved over."""
    if not is_taken(path):
        return path
    n = 2
    while is_taken(path.with_name(f"{path.name}.{n}")):
        n += 1
    return path.with_name(f"{path.name}.{n}")


def set_aside(path: Path | RemoteDir, tag: str, first: str | None = None) -> Path | RemoteDir:
    """Rename `path` to `<name>.<tag>` (or a numbered variant); never deletes. Returns the new path.

    On object storage a rename is a move of each object: `first` (a child's name, e.g. a checkpoint's
    commit record) moves before the others, so an interrupted move never leaves it beside a partial folder."""
    target = free_name(path.with_name(f"{path.name}.{tag}"))
    if isinstance(path, RemoteDir):
        return path.rename(target, first=first)
    os.replace(path, target)
    return target


# The temporary name of an atomic write: `.<name>.<32 hex digits>.tmp`, h3train's own mark on it.
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")


def is_temporary(path: Path) -> bool:
    """Whether `path` is named as the temporary file of an atomic write (`_temporary_for`)."""
    return bool(_TEMPORARY.match(path.name))


@contextmanager
def _temporary_for(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        apply_file_mode(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`write(tmp_path)` fills a temporary file that then replaces `path`."""
    with _temporary_for(Path(path)) as tmp:
        write(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, atomically, with the mode of `file_mode()`.

    A failed write is an `OSError` naming `path` with the errno safetensors reports in its text
    (`... (os error 28)`), so a full disk is recognised as one (`diskspace.no_space`).
    """

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as exc:
            found = re.search(r"os error (\d+)", str(exc))
            if found is None:
                raise
            code = int(found[1])
            raise OSError(code, os.strerror(code), str(path)) from exc

    atomic_write(path, write)
