"""Writing checkpoints: DCP saves (background or blocking), committed atomically, pruned by `keep_last`.

In a folder a save is written to `.tmp-step_N` and committed by its rename to `step_N`. On object storage
(`checkpoint.dir` a URL, `infra/objects.py`), which has no rename, a save is written under `step_N/`
through DCP's fsspec writer and committed by its record, `trainer_state.json`, written last in one PUT:
a step prefix without it is never listed (`folders.committed_checkpoints`), so a save cut short is never
resumed; pruning deletes the record first."""

from __future__ import annotations

import inspect
import itertools
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import DiskFullError
from ..infra.atomic import apply_file_mode, atomic_write_text, fsync_path, set_aside
from ..infra.digest import ALGORITHM, digest_file
from ..infra.diskspace import free_bytes, human_bytes, no_space
from ..infra.objects import LISTING, Folder, RemoteDir
from ..infra.runlock import OWNER_NAME, mark_owned, owned_by_another
from ..parallel.dims import new_group
from .folders import (
    DIGESTS_FIELD,
    METADATA_FILE,
    STATE_FILE,
    STEP_DIR,
    _commit_key,
    committed_checkpoints,
    size_on_disk,
    step_dir_name,
    step_of,
)
from .staging import HostStaging
from .verify import complete_checkpoints

# torch 2.8's DCP file writer calls `tensor.storage()` on every tensor it writes, which warns once per
# rank and save; the call is torch's own, and a stopped run's console should end with its own lines.
warnings.filterwarnings(
    "ignore", message="TypedStorage is deprecated", module="torch.distributed.checkpoint.filesystem"
)

# A failed save that leaves less than this free (and less than a checkpoint) ran out of space.
_FULL_BELOW = 64 * 1024**2


def room_needed(planned: int, root: Folder) -> int:
    """Bytes the next checkpoint in `root` needs: `planned`, or the newest complete one's size if larger
    (DCP's framing included)."""
    return max([planned, *(size_on_disk(p) for p in complete_checkpoints(root)[-1:])])


def own_files(folder: Folder, rank: int) -> list[Folder]:
    """The files rank `rank` wrote into a save's `folder`: its shards (`__<rank>_<n>.distcp`, DCP's
    naming) and, on rank 0 (DCP's coordinator), `.metadata`."""
    files = sorted(folder.glob(f"__{rank}_*.distcp"), key=lambda p: p.name)
    if rank == 0 and (folder / METADATA_FILE).is_file():
        files.append(folder / METADATA_FILE)
    return files


def gather_digests(folder: Folder, group: dist.ProcessGroup | None) -> dict[str, str]:
    """Collective over `group` (None: the default one), once per save on every rank: each rank digests
    the files it wrote (`own_files`), so no rank reads another's bytes; returns all of them by name.

    A rank that cannot read its own file makes every rank raise the same `OSError`, naming it.
    """
    rank = dist.get_rank(group)
    try:
        mine: dict[str, str] | str = {p.name: digest_file(p) for p in own_files(folder, rank)}
    except OSError as exc:
        mine = f"rank {rank} could not read back what it wrote to '{folder}' ({exc})"
    gathered: list[dict[str, str] | str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [part for part in gathered if isinstance(part, str)]
    if failed:
        raise OSError(failed[0])
    return {name: digest for part in gathered if isinstance(part, dict) for name, digest in part.items()}


# -- writing checkpoints --------------------------------------------------------------------------


class SaveAbandoned(RuntimeError):
    """A save stopped at once (`Checkpointer.abandon`): its temporary folder was not committed."""


# Whether this torch's DCP can keep a save's plans for the next save of the same state (torch >= 2.7).
PLAN_CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters
_planner_keys = itertools.count()


class _SavePlans:
    """DCP's default save planner, made anew for each save, with DCP's save-plan caching where this torch
    has it: a save whose tensors have the FQNs, shapes and ranks' shares of the previous one reuses its
    global plan and metadata, and the coordinator sends each rank only what changed.

    DCP keeps the plans in class-level tables under a key (the planner's class name by default); each
    checkpointer has a key of its own, so the saves of two checkpointers (another folder, another
    process group) never mix, and `forget()` drops its plans when the checkpointer closes."""

    def __init__(self) -> None:
        self.key = f"h3train-checkpointer-{next(_planner_keys)}"

    def planner(self) -> DefaultSavePlanner:
        if not PLAN_CACHING:
            return DefaultSavePlanner()
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self.key
        return planner

    def forget(self) -> None:
        for table in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
            getattr(SavePlanner, table, {}).pop(self.key, None)


class _NotedWrites:
    """A DCP writer with `before_write` (fault injection), run where the shards are about to be written:
    inside DCP's save, on the thread that writes. It notes when the writes begin: from the save's start
    to then, DCP plans (local plans, their exchange, the global plan)."""

    before_write: Callable[[], None] | None = None
    writes_began: float | None = None

    def write_data(self, plan: Any, planner: Any) -> Future:
        self.writes_began = time.perf_counter()
        if self.before_write is not None:
            self.before_write()
        return super().write_data(plan, planner)


class _Writer(_NotedWrites, FileSystemWriter):
    """DCP's file writer, what `checkpoint_id` alone chooses for a folder."""


class _ObjectWriter(_NotedWrites, FsspecWriter):
    """DCP's fsspec writer, for a checkpoint folder on object storage. No fsync (an object is durable once
    its PUT returns); no cached listing."""


def _writer(path: Folder, before_write: Callable[[], None] | None) -> _NotedWrites:
    if isinstance(path, RemoteDir):
        writer: _NotedWrites = _ObjectWriter(str(path), sync_files=False, **LISTING)
    else:
        writer = _Writer(str(path))
    writer.before_write = before_write
    return writer


@dataclass
class _PendingSave:
    """A background save in flight."""

    committed: Future  # rank 0: written and committed; the other ranks: written
    final: Folder


class Checkpointer:
    """Saves commit by rename; prunes only what this run's lineage holds (see `_prune`).

    With `async_save` a save runs in two parts. On the training thread: each component's
    `state_dict()` (plain values such as the step counters, the sampler and schedule positions are
    read here, so they are already a snapshot), rank 0's creation of the temporary folder, and the
    copy of every tensor into this checkpointer's `HostStaging` (on CUDA queued on a stream of its
    own, non-blocking into pinned buffers; on the CPU done before `save()` returns). On a writer
    thread: the wait for that copy, DCP's save of the host copy (its planning over this
    checkpointer's own gloo group, and the writes), then each rank's digests of its own files,
    gathered over that group; rank 0 commits there as soon as it has them (`_write_and_commit`).
    `wait()` waits for all of it and lines the ranks up after it. The same on every torch version:
    DCP's own staging (`async_save`, `DefaultStager`) is not used.

    The invariant the caller keeps: nothing changes a tensor of the checkpoint state in place
    before `wait_staged()`, or the checkpoint would hold part of a later state. On CUDA it queues
    the current stream behind the copy (no host sync), so the writes it orders are the ones queued
    on that stream after it; on the CPU the copy is already taken. The trainer calls it right
    before `optimizer.step()`, the first write after a save (weights, AdamW moments; the LR
    schedule, the EMA shadows and LoRA weights change after that point), and `EmaHook.swapped_in`
    calls it before writing the EMA into the parameters (validation or rendering after a step that
    was skipped runs before the next update).

    One host copy serves every save of a checkpointer (one copy of this rank's share of the state,
    allocated at the first save and kept while the state's layout is unchanged), which the next
    save copies into again; that is safe because a save first waits for the previous one's writes.
    `close()` frees it.

    Every save plans with DCP's save-plan caching where the torch in use has it (`_SavePlans`): a
    run's saves hold the same tensors, so from the second save on DCP reuses the first one's global
    plan; `planning_s` records what each save's planning took.

    A second Ctrl-C stops the run at once (`abandon()`): the save in progress is never committed;
    its temporary folder stays, never read, until the next start removes it (`clean_incomplete`).
    """

    def __init__(
        self,
        root: Folder,
        keep_last: int,
        is_main: bool,
        async_save: bool = False,
        device: torch.device | None = None,
        owner: str = "",
        planned_bytes: int = 0,
        best_step: Callable[[], int | None] | None = None,
        after_commit: Callable[[Folder], None] | None = None,
    ) -> None:
        self.root = root
        # One checkpoint's planned size (`assemble.planned_checkpoint_bytes`), for a disk-full message.
        self.planned_bytes = planned_bytes
        # The token of the run lock this writer holds (`infra/runlock.py`): its temporary folders carry it.
        self.owner = owner
        self.keep_last = keep_last
        self.is_main = is_main
        self.async_save = async_save
        self._pending: _PendingSave | None = None
        # Background writes plan over a gloo group of their own, so their collectives never
        # interleave with the training loop's on the default group (and work beside NCCL).
        self._group = new_group("gloo") if async_save else None
        self._staging = HostStaging(device or torch.device("cpu")) if async_save else None
        # One writer thread: saves follow one another (each waits for the one before).
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write") if async_save else None
        # Checkpoints newer than the resume point that this run did not write are never pruned.
        # Resuming sets such later ones aside under another name, so this is a second guard.
        self.protected_after: int | None = None
        self.written: set[str] = set()
        # The step of the best checkpoint so far (`checkpoint.keep_best`), never pruned; None: none.
        self.best_step: Callable[[], int | None] = best_step or (lambda: None)
        # Run by rank 0 with each checkpoint's final path once it is committed and pruned (no collective:
        # on the writer thread for a background save); None: nothing.
        self.after_commit = after_commit
        # The step of the save begun and not yet complete (its background write included); None: none.
        self.saving: int | None = None
        # Held across the commit's decision and rename, so that after `abandon()` none follows.
        self._commit_lock = threading.Lock()
        self._abandoned = False
        self._plans = _SavePlans()
        # Seconds each save spent in DCP's planning (from its start to its first write), in save order.
        self.planning_s: list[float] = []

    @property
    def staging(self) -> HostStaging | None:
        """The host copy background saves write from (None without `async_save`)."""
        return self._staging

    @property
    def plans_key(self) -> str:
        """The key DCP's save-plan cache keeps this checkpointer's plans under (`_SavePlans`)."""
        return self._plans.key

    def clean_incomplete(self) -> None:
        """Remove the `.tmp-*` leftovers of saves that never committed (rank 0; others wait).

        Only folders that carry an h3train writer's marker, of a writer other than this one, go:
        this run holds the folder's lock, so that writer has stopped. Anything else stays.
        """
        if self.is_main and isinstance(self.root, RemoteDir):
            for path in self.root.iterdir():
                # A step prefix without its record was never committed (a save cut short, a prune cut short).
                uncommitted = STEP_DIR.match(path.name) and not (path / STATE_FILE).is_file()
                if uncommitted and path.is_dir() and owned_by_another(path, self.owner):
                    path.remove_tree()
        elif self.is_main and self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(".tmp-") and path.is_dir() and owned_by_another(path, self.owner):
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def _next_commit(self) -> int:
        commits = [_commit_key(p)[0] for p in committed_checkpoints(self.root)]
        finite = [int(c) for c in commits if c != float("inf")]
        return max(finite, default=0) + 1

    def save(
        self,
        components: dict[str, Stateful],
        info: dict[str, Any],
        step: int,
        before_commit: Callable[[], None] | None = None,
        before_write: Callable[[], None] | None = None,
    ) -> Folder:
        """Write every rank's shards to a temporary folder, then commit it by an atomic rename (on object
        storage: to the step's prefix, committed by its record; the module docstring).

        `info` goes to `trainer_state.json` with the step and the commit number. With `async_save`
        the call returns once the components' `state_dict()` are taken and their copy to host memory
        is queued (CUDA) or taken (CPU); the writes run in the background (see the class docstring
        for what must wait for the copy), and rank 0 commits as soon as they are complete; `wait()`
        (the next save, the end of training, a stop) waits for that. `before_commit` (fault
        injection) then runs while the background work is in flight; `before_write` (fault
        injection) runs inside DCP's save, on the thread that writes, before the shards are written.
        Returns the checkpoint's final name (committed, or committed once written).
        """
        self.wait()
        self.saving = step
        final = self.root / step_dir_name(step)
        tmp = self._tmp_of(final)
        if self.is_main and isinstance(final, RemoteDir):
            self._clear_prefix(final)
            mark_owned(final, self.owner)
        elif self.is_main:
            # A leftover of this name would mix its files into the new one: a marked one goes, one with
            # files of someone else's (`clean_incomplete` kept it) is set aside. An empty one is another
            # rank's DCP writer that created the folder first: it is used as it is.
            if tmp.exists() and any(tmp.iterdir()):
                if (tmp / OWNER_NAME).is_file():
                    shutil.rmtree(tmp)
                else:
                    set_aside(tmp, "kept")
            tmp.mkdir(parents=True, exist_ok=True)
            mark_owned(tmp, self.owner)
        # No barrier: DCP's writer creates the folder on every rank, and no rank writes a file before
        # the plan exchange, which needs rank 0's plan, made after the lines above.
        writer = _writer(tmp, before_write)
        if self._staging is not None:
            # What `dcp.save` would take of each component, taken here: the host copy is of this moment.
            state = {name: component.state_dict() for name, component in components.items()}
            staged = self._staging.stage(state)
            committed = self._writes.submit(self._write_and_commit, staged, writer, tmp, final, step, dict(info))
            self._pending = _PendingSave(committed, final)
            if before_commit is not None:
                before_commit()
            return final
        try:
            self._dcp_save(dict(components), writer, tmp, None)
            self._commit(tmp, final, step, info, before_commit)
        except BaseException as exc:
            self._raise_if_full(exc, tmp, step)
            raise
        self.saving = None
        return final

    def wait_staged(self) -> None:
        """After this, the state may change: on CUDA the current stream waits for the copy of the save in
        flight (queued; the host does not wait), on the CPU the copy was taken in `save()`. Nothing
        when no save is in flight."""
        if self._pending is not None:
            self._staging.order_after_copy()

    def _clear_prefix(self, final: RemoteDir) -> None:
        """Rank 0, before a save to object storage: what `final` holds already goes out of the way. A
        committed checkpoint (only this lineage's can be there) is set aside as `.replaced`; an uncommitted
        save of an h3train writer (one that carries its marker) is removed; anything else is set aside."""
        if (final / STATE_FILE).is_file():
            set_aside(final, "replaced", first=STATE_FILE)
        elif (final / OWNER_NAME).is_file():
            final.remove_tree()
        elif any(True for _ in final.iterdir()):
            set_aside(final, "kept")

    def _tmp_of(self, final: Folder) -> Folder:
        """Where the save of `final` is written: `.tmp-<name>` beside it, or on object storage `final` itself."""
        return final if isinstance(final, RemoteDir) else final.with_name(f".tmp-{final.name}")

    def wait(self) -> Folder | None:
        """Finish the background save in flight, if any, and commit it (collective). Returns its path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.committed.result()
        except BaseException as exc:
            self._raise_if_full(exc, self._tmp_of(pending.final), step_of(pending.final))
            raise
        self.saving = None
        self.written.add(pending.final.name)
        # Every rank returns once rank 0 has committed.
        dist.barrier()
        return pending.final

    def _raise_if_full(self, exc: BaseException, tmp: Folder, step: int) -> None:
        """A save that ran out of space becomes one `DiskFullError` line; other failures pass through.

        Out of space: an ENOSPC / EDQUOT `OSError` behind `exc`, or a folder left with less free space
        than the checkpoint needs and than `_FULL_BELOW` (torch's zip writer turns a short write into a
        RuntimeError that does not name the errno). Rank 0 then removes the partial save (its own
        marked temporary folder: no rank writes to it once DCP has raised), so the space is free
        again, and names what is needed and free; earlier checkpoints stay as they are. DCP raises a
        failure on every rank alike, so rank 0 alone reports it; a failure of rank 0's commit is its own.
        An object store reports no free space: its failures pass through.
        """
        if isinstance(self.root, RemoteDir):
            return
        kept = complete_checkpoints(self.root)
        needed = room_needed(self.planned_bytes, self.root)
        full = no_space(exc)
        free = free_bytes(self.root)
        if full is None and (free is None or free >= min(needed, _FULL_BELOW)):
            return
        if self.is_main and (tmp / OWNER_NAME).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            free = free_bytes(self.root)
        what = "with the partial save removed" if self.is_main else "before rank 0 removes the partial save"
        error = DiskFullError(
            f"checkpoint folder '{self.root}' is full: the checkpoint of step {step} needs about "
            f"{human_bytes(needed)} and {human_bytes(free) if free is not None else 'an unknown amount'} is free "
            f"({what}); "
            + (f"{kept[-1].name} is kept. " if kept else "no checkpoint was saved. ")
            + "Free space there or set checkpoint.dir to a disk with room, then resume with checkpoint.resume=auto"
        )
        error.agreed = isinstance(exc, CheckpointException)
        raise error from exc

    def _write_and_commit(
        self,
        staged: dict[str, Any],
        writer: _NotedWrites,
        tmp: Folder,
        final: Folder,
        step: int,
        info: dict[str, Any],
    ) -> None:
        """Every rank, on its writer thread: wait for the host copy, write it (DCP), digest its own files,
        gather the digests over this checkpointer's group; rank 0 then commits. What it raises, `wait()`
        raises on the training thread.

        DCP's save returns on every rank only after the coordinator (rank 0 of the group) has gathered
        every rank's write results and written the metadata, so the whole checkpoint is on disk; a
        failed write raises on every rank alike, so either all ranks gather or none does. Committing
        then, not at the next save, means a crash any time after the write finds this checkpoint.
        """
        self._staging.wait_copied()
        self._dcp_save(staged, writer, tmp, self._group)
        digests = gather_digests(tmp, self._group)
        if self.is_main:
            self._rename_into_place(tmp, final, step, info, digests)

    def _dcp_save(
        self, state: dict[str, Any], writer: _NotedWrites, tmp: Folder, group: dist.ProcessGroup | None
    ) -> None:
        start = time.perf_counter()
        dcp.save(
            state, checkpoint_id=str(tmp), storage_writer=writer, planner=self._plans.planner(), process_group=group
        )
        if writer.writes_began is not None:
            self.planning_s.append(writer.writes_began - start)

    def abandon(self) -> None:
        """Commit no save from now on (a stop at once; no collective): the one in flight, if any, stays
        a temporary folder, never read. Once this returns, the complete checkpoints are final."""
        with self._commit_lock:
            self._abandoned = True

    def close(self) -> None:
        """Free the host copy and let the writer thread end; no collective, so also after a failure.

        A save still in flight commits on its own once written (rank 0's writer thread); `wait()`
        waits for that. After `abandon()` nothing waits for its copy to host memory either.
        """
        if self._staging is not None:
            self._staging.close(wait=not self._abandoned)
            self._writes.shutdown(wait=False)
        self._plans.forget()

    def _commit(
        self, tmp: Folder, final: Folder, step: int, info: dict[str, Any], before_commit: Callable[[], None] | None
    ) -> None:
        """Every rank's shards are in `tmp`: the ranks gather their digests and rank 0 commits it."""
        digests = gather_digests(tmp, None)
        if before_commit is not None:
            before_commit()
        if self.is_main:
            self._rename_into_place(tmp, final, step, info, digests)
        self.written.add(final.name)
        dist.barrier()

    def _rename_into_place(
        self, tmp: Folder, final: Folder, step: int, info: dict[str, Any], digests: dict[str, str]
    ) -> None:
        """Rank 0, no collective: write the record into the complete `tmp`, rename it to `final`, prune.
        On object storage `tmp` is `final`, and the record's one PUT is the commit.

        The record holds `digests`, every rank's of the files it wrote (`gather_digests`): nothing
        here reads a file's bytes.
        """
        files = dict(sorted(digests.items()))
        record = {
            "step": step,
            "commit": self._next_commit(),
            **info,
            DIGESTS_FIELD: {"algorithm": ALGORITHM, "files": files},
        }
        text = json.dumps(record, indent=2, default=str)
        if isinstance(final, RemoteDir):
            with self._commit_lock:
                if self._abandoned:
                    raise SaveAbandoned(f"the save of step {step} was stopped; {final} is not committed")
                (final / STATE_FILE).write_text(text)
            self._after_commit(final)
            return
        atomic_write_text(tmp / STATE_FILE, text)
        for file in tmp.iterdir():
            apply_file_mode(file)
        with self._commit_lock:
            if self._abandoned:
                raise SaveAbandoned(f"the save of step {step} was stopped; {tmp} is not committed")
            if final.exists():
                # Only a checkpoint of this very lineage can be here (later ones were set aside at
                # resume); it is still kept, under another name, rather than deleted.
                set_aside(final, "replaced")
            os.replace(tmp, final)
        fsync_path(self.root)
        self._after_commit(final)

    def _after_commit(self, final: Folder) -> None:
        self._prune(keep=final)
        if self.after_commit is not None:
            self.after_commit(final)

    def _prune(self, keep: Folder) -> None:
        """Retire all but the newest `keep_last` checkpoints and the best; delete them in the background.

        A checkpoint newer than the resume point that this run did not write is never retired. A
        retired checkpoint is first renamed to `.tmp-*` (atomic), so an interrupted deletion never
        leaves a half checkpoint under a valid name; deleting hundreds of GB must not hold up training.
        On object storage the record is deleted first instead (one request: the prefix is no longer a
        checkpoint), then the rest.
        """
        if self.keep_last <= 0:
            return
        retired = []
        best = self.best_step()
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            foreign_later = (
                self.protected_after is not None
                and step_of(old) > self.protected_after
                and old.name not in self.written
            )
            if old == keep or foreign_later or step_of(old) == best:
                continue
            mark_owned(old, self.owner)  # before the rename: a retired folder always carries it
            if isinstance(old, RemoteDir):
                (old / STATE_FILE).unlink()
                retired.append(old)
                continue
            target = old.with_name(f".tmp-retired-{old.name}")
            os.replace(old, target)
            retired.append(target)
        if retired:
            threading.Thread(
                target=lambda: [_remove(p) for p in retired],
                name="checkpoint-prune",
                daemon=False,
            ).start()


def _remove(folder: Folder) -> None:
    if isinstance(folder, RemoteDir):
        folder.remove_tree()
    else:
        shutil.rmtree(folder, ignore_errors=True)
