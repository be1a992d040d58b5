"""Atomic file writes: readers see the old file or the complete new one, never a torn one.

Each write goes to a hidden temporary name in the target's folder, is flushed to disk, and is
renamed over the target (`os.replace` is atomic within a filesystem).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (after a rename), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _temporary_for(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
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
    """`safetensors.torch.save_file`, atomically."""
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
