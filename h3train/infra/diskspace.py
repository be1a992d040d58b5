"""Free space on the run's disks: checked before a run starts, named when a write runs out of it.

A full disk shows up as an `OSError` with `errno` ENOSPC (or EDQUOT, a quota), often wrapped:
DCP gathers every rank's write failure into one `CheckpointException` raised on all ranks.
`no_space` finds it wherever it sits; `full_disk_line` turns it into the one line a user reads.
Only the standard library is imported, so the CLI can use this after any failure.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..errors import ConfigError

# A quota (EDQUOT) runs out as a disk does, with the same way out.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    """`n` bytes as a short text in binary units: '1.25 GiB', '512 B'."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def nearest_existing(path: Path) -> Path:
    """`path` made absolute, or its nearest ancestor that exists (the root at worst)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(path: Path) -> int | None:
    """Bytes this user may still write on the file system of `path` (its nearest existing folder).

    None when the file system does not say (a `statvfs` that fails): the caller cannot know.
    """
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def no_space(exc: BaseException) -> OSError | None:
    """The out-of-space `OSError` behind `exc`, if there is one: in its cause/context chain or, for
    DCP's `CheckpointException`, in any rank's gathered failure."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            # DCP's failures: rank -> (exception, stack summary).
            wrapped = (f[0] for f in failures.values() if isinstance(f, tuple) and f)
            pending.extend(e for e in wrapped if isinstance(e, BaseException))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def full_disk_line(error: OSError) -> str:
    """One line for an out-of-space write outside a checkpoint save: the file, its folder, what is free."""
    where = Path(error.filename) if error.filename else None
    if where is None:
        return f"no space left on the device ({error.strerror or 'ENOSPC'}); free space where this run writes"
    free = free_bytes(where.parent)
    room = f"{human_bytes(free)} free there" if free is not None else "the free space there is not known"
    return (
        f"no space left on the device writing '{where}' (folder '{where.parent}', {room}); "
        "free space there or write elsewhere; what was written before is kept"
    )


def check_room(folder: Path, key: str, needed: int) -> str | None:
    """Start-up check: `folder` has room for `needed` bytes (one checkpoint of this run).

    Raises `ConfigError` (exit 2) naming `key`, the bytes needed and free when it has not. Returns a
    warning line when the file system does not report its free space, None when there is room.
    """
    free = free_bytes(folder)
    if free is None:
        return (
            f"h3train: warning: {key} '{folder}': the file system does not report its free space; one "
            f"checkpoint of this run needs about {human_bytes(needed)}"
        )
    if free < needed:
        raise ConfigError(
            f"config key '{key}': '{folder}' has {human_bytes(free)} free, and one checkpoint of this run needs "
            f"about {human_bytes(needed)} ({needed:,} bytes); free space there or choose a {key} with room"
        )
    return None
