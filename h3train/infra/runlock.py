"""One writer per folder: the lock a run (or an encode, or an export) takes before it writes anything.

A folder on shared storage can be named by two jobs at once (a double-submitted job, a colleague's
run with the same `logging.dir`). The first to create `<folder>/.h3train.lock` (an exclusive create,
which NFS and parallel filesystems honour) holds the folder; the lock file records who: host, pid
namespace, pid and its start time, the command, when it started, and a heartbeat refreshed every
`HEARTBEAT_S` seconds. A second writer stops with one line naming the holder.

A lock whose holder is gone is taken over with one line: on this machine (same host and pid
namespace) when its process is dead, elsewhere when its heartbeat is older than `STALE_AFTER_S`. Two
writers that find the same stale lock race for `<lock>.takeover` (another exclusive create), so
only one of them replaces it.

Under Slurm the record also holds the job (`SLURM_JOB_ID`) and how many times it was restarted
(`SLURM_RESTART_COUNT`, absent before the first requeue: 0). A requeued job, preempted or timed out
before it released its lock, takes over its own earlier restart's lock at once, from any host:
Slurm ends every step of a job before it runs it again, so that holder has stopped. A lock of the
same job and restart (a second step started beside the first) is judged like any other.

Temporary folders a holder writes carry `OWNER_NAME` with its token (`mark_owned`); once a writer
holds the lock, such a folder with another token belongs to a writer that stopped, and only such
folders are cleaned up (`owned_by_another`). Nothing without the marker is ever deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .objects import location

LOCK_NAME = ".h3train.lock"
OWNER_NAME = ".h3train-owner"
HEARTBEAT_S = 30.0
# A holder on another machine whose heartbeat is this old has stopped (a live one refreshes it
# every HEARTBEAT_S); generous, for clocks that disagree a little and filesystems that lag.
STALE_AFTER_S = 600.0
# A takeover marker this old was left by a writer that died while taking over.
_TAKEOVER_STALE_S = 60.0

# Tokens of the locks this process holds now: a lock naming this pid with another token was left
# by an earlier run in this same process (one that was never closed).
_held: set[str] = set()


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None where unknown; tells a
    reused pid from the holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slurm_job() -> tuple[str, int] | None:
    """This process's Slurm job id and restart count (`SLURM_JOB_ID`, `SLURM_RESTART_COUNT`, 0 when
    unset); None outside a Slurm job."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job:
        return None
    try:
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restart = 0
    return job, restart


def writer_record(token: str) -> dict[str, Any]:
    """Who this process is, as a lock or a temporary folder's marker records it; under Slurm also its
    job (`slurm_job_id`, `slurm_restart_count`)."""
    job = slurm_job()
    slurm = {} if job is None else {"slurm_job_id": job[0], "slurm_restart_count": job[1]}
    return {
        "token": token,
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "command": " ".join(sys.argv[:3])[:200],
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "heartbeat": time.time(),
        **slurm,
    }


class FolderLock:
    """The lock of one folder. `what` names it in messages, e.g. "logging.dir 'runs/a'"."""

    def __init__(self, folder: Path, what: str, token: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.what = what
        self.token = token
        self.record = writer_record(token)
        self._created = False

    def acquire(self) -> str | None:
        """Take the lock; returns a line saying whose stale lock was taken over, or None.

        Raises `UsageError` (exit 2) naming the holder when a live writer holds it.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            if self._create(self.path):
                return None
            holder = self._read()
            if holder is None:
                time.sleep(0.1)  # being written by its creator this instant
                continue
            reason = stale_reason(holder)
            if reason is None:
                raise UsageError(
                    f"{self.what} is in use by another run ({describe(holder)}); wait for it to finish or choose "
                    f"another folder; if that run is gone, remove '{self.path}'"
                )
            if self._take_over(holder):
                return (
                    f"h3train: took over the lock of {self.what} from a writer that stopped "
                    f"({describe(holder)}: {reason})"
                )
        raise UsageError(f"{self.what}: could not take '{self.path}'; remove it if no run is writing there")

    def _create(self, path: Path, body: dict[str, Any] | None = None) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        if body is None:
            self._created = True  # ours from here on, even if interrupted before it holds the record
        with os.fdopen(fd, "w") as handle:
            json.dump(body or self.record, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if body is None:
            _held.add(self.token)
        return True

    def _read(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            # Unreadable: a creator killed between create and write leaves an empty file.
            try:
                age = time.time() - self.path.stat().st_mtime
            except OSError:
                return None
            return {"token": "?", "heartbeat": 0.0} if age > 5 else None
        return holder if isinstance(holder, dict) else {"token": "?", "heartbeat": 0.0}

    def _take_over(self, stale: dict[str, Any]) -> bool:
        """Replace the stale lock with ours, if no other writer is doing so; True once ours."""
        marker = self.path.with_name(LOCK_NAME + ".takeover")
        if not self._create(marker, {"token": self.token, "started": time.time()}):
            try:
                if time.time() - marker.stat().st_mtime > _TAKEOVER_STALE_S:
                    marker.unlink(missing_ok=True)
            except OSError:
                pass
            time.sleep(0.2)
            return False
        try:
            current = self._read()
            if current is not None and current.get("token") != stale.get("token"):
                return False  # someone else took it over meanwhile: look again
            self.path.unlink(missing_ok=True)
            return self._create(self.path)
        finally:
            marker.unlink(missing_ok=True)

    def beat(self) -> None:
        """Refresh the heartbeat, if the lock is still ours."""
        current = self._read()
        if current is None or current.get("token") != self.token:
            return
        self.record["heartbeat"] = time.time()
        tmp = self.path.with_name(f"{LOCK_NAME}.{self.token}.beat")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the lock file if it is still ours (or is the empty file this writer created and was
        interrupted before filling)."""
        _held.discard(self.token)
        try:
            text = self.path.read_text()
        except OSError:
            return
        if not text and self._created:
            self.path.unlink(missing_ok=True)
            return
        try:
            ours = json.loads(text).get("token") == self.token
        except (ValueError, AttributeError):
            ours = False
        if ours:
            self.path.unlink(missing_ok=True)


def stale_reason(holder: dict[str, Any]) -> str | None:
    """Why the lock of `holder` is stale, or None while its writer may still be writing."""
    if holder.get("token") == "?":
        return "its lock file is empty or unreadable"
    earlier = _earlier_restart(holder)
    if earlier is not None:
        return earlier
    same_machine = holder.get("host") == socket.gethostname() and holder.get("pid_namespace") == _pid_namespace()
    if same_machine:
        pid = int(holder.get("pid", -1))
        if pid == os.getpid():
            return None if holder.get("token") in _held else "left by an earlier run of this process"
        if not _pid_alive(pid):
            return "its process is gone"
        start = holder.get("pid_start")
        if start is not None and _process_start(pid) not in (None, start):
            return "its process is gone (the pid was reused)"
        return None
    age = time.time() - float(holder.get("heartbeat", 0.0))
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age:.0f} s (limit {STALE_AFTER_S:.0f} s)"
    return None


def _earlier_restart(holder: dict[str, Any]) -> str | None:
    """Why `holder` is an earlier restart of this very Slurm job (it has stopped), or None if it is not."""
    job = slurm_job()
    if job is None or str(holder.get("slurm_job_id", "")) != job[0]:
        return None
    try:
        theirs = int(holder.get("slurm_restart_count", 0))
    except (TypeError, ValueError):
        return None
    if theirs >= job[1]:
        return None
    return f"left by restart {theirs} of this Slurm job {job[0]}, now at restart {job[1]}"


def describe(holder: dict[str, Any]) -> str:
    age = time.time() - float(holder.get("heartbeat", 0.0))
    job = holder.get("slurm_job_id")
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}, "
        f"last heartbeat {age:.0f} s ago"
        + (f", Slurm job {job} restart {holder.get('slurm_restart_count', 0)}" if job else "")
    )


class RunLock:
    """The locks of a writer's folders, taken together, with one heartbeat thread for all of them."""

    def __init__(self, folders: list[tuple[Path, str]]) -> None:
        self.token = uuid.uuid4().hex
        seen: set[Path] = set()
        self.locks: list[FolderLock] = []
        for folder, what in folders:
            key = Path(os.path.abspath(folder))
            if key not in seen:
                seen.add(key)
                self.locks.append(FolderLock(key, what, self.token))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> list[str]:
        """Take every lock (releasing those taken if one is held); returns the takeover lines."""
        notes: list[str] = []
        taken: list[FolderLock] = []
        try:
            for lock in self.locks:
                taken.append(lock)  # released below if anything fails, even inside its own acquire
                note = lock.acquire()
                if note:
                    notes.append(note)
        except BaseException:
            # Only a lock file holding this writer's token is removed: another holder's stays.
            for lock in taken:
                lock.release()
            raise
        self._thread = threading.Thread(target=self._beat, name="h3train-lock-heartbeat", daemon=True)
        self._thread.start()
        return notes

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for lock in self.locks:
                with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                    lock.beat()

    def release(self) -> None:
        self._stop.set()
        # A Ctrl-C inside `acquire` can land between the thread's creation and its start.
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()
        self._thread = None
        for lock in self.locks:
            with contextlib.suppress(OSError):
                lock.release()


def mark_owned(folder: Path, token: str) -> None:
    """Mark a temporary folder as this process's, written under `token` (`owned_by_another`, `left_behind`)."""
    (location(folder) / OWNER_NAME).write_text(json.dumps(writer_record(token)))


def _marker(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((location(folder) / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("token") else None


def owned_by_another(folder: Path, token: str) -> bool:
    """Whether `folder` carries the marker of a writer other than `token`. The caller holds the folder's
    lock, so that writer has stopped. A folder without the marker is not h3train's to delete."""
    record = _marker(folder)
    return record is not None and record["token"] != token


def left_behind(folder: Path) -> bool:
    """Whether `folder` carries the marker of a writer that has stopped (`stale_reason`), for writers that
    hold no lock (an export's temporary sibling)."""
    record = _marker(folder)
    return record is not None and stale_reason(record) is not None
