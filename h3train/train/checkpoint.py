"""Checkpoints of the whole training state with `torch.distributed.checkpoint`, committed atomically.

Layout of `checkpoint.dir`:

    step_00000012/           a committed checkpoint (only committed ones carry this name)
      .metadata, *.distcp    DCP: every component of the checkpoint state, sharded
      trainer_state.json     step, commit number, model config, resolved config, a digest of every
                             file (JSON, for people and for the checks that run before a model exists)
    .h3train.lock            the lock of the run writing here (`h3train/runlock.py`)
    .tmp-step_00000013/      being written; renamed to step_00000013 once every rank is done
    step_00000014.corrupt    a checkpoint that failed to load, set aside by a resume (never read)
    step_00000020.abandoned-12   a later checkpoint set aside when a run resumed from step 12

A checkpoint is valid only once it has its final name: the rename is the commit, done by rank 0 once
every rank's write is complete (after a barrier; a background save, as soon as DCP reports it done).
`.tmp-*` folders are never read. Each carries its writer's marker (`runlock.mark_owned`); at start the
run, holding the folder's lock, removes those of writers that stopped, and nothing without the marker.
The checkpoint state is one dict of named `Stateful` components (`Trainer.checkpoint_state`): the
model, the optimizer, the LR schedule position, the sampler, the step counters. A later
feature joins it with `trainer.checkpoint_state["ema"] = ema`. Tensors are keyed by their FQN, so
DCP reshards on load: a run resumes under another `dp_shard` / `sp` / `dp_replicate`.

A LoRA run's `model` component holds the trainable parameters only (`ModelState(trainable_only=True)`:
adapters and `lora.train_modules`, no frozen base weight); its `trainer_state.json` adds the
adapter's peft config (`lora`) and the base it was trained on (`lora_base`, `h3train/lora/base.py`).

The digests (`h3train/digest.py`) are taken at commit, each rank reading back the shard files it
wrote; before a resume the ranks check them in parallel (`verify_file_digests`), and a file whose bytes
changed takes the corrupt-checkpoint path (set aside, the next older one used); export checks them too.

Commit order is recorded, not inferred: each commit writes `commit` (one more than any checkpoint
in the folder) into `trainer_state.json`, so a run folder copied elsewhere (new mtimes) keeps it.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:  # torch >= 2.9: DCP can stage on a thread of its own
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # torch 2.8: `dcp.async_save` copies to host memory on the calling thread
    DefaultStager = StagingOptions = None
from torch.distributed.checkpoint.stateful import Stateful

from ..atomic import apply_file_mode, atomic_write_text, fsync_path, set_aside
from ..digest import ALGORITHM, digest_file
from ..diskspace import free_bytes, human_bytes, no_space
from ..errors import CheckpointError, ConfigError, DiskFullError
from ..runlock import OWNER_NAME, mark_owned, owned_by_another

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "trainer_state.json"
METADATA_FILE = ".metadata"
# DCP key prefix of the transformer's weights: component "model", module "transformer".
MODEL_PREFIX = "model.transformer."


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


# -- reading checkpoints --------------------------------------------------------------------------


def is_complete(path: Path) -> bool:
    return (
        path.is_dir()
        and STEP_DIR.match(path.name) is not None
        and (path / STATE_FILE).is_file()
        and (path / METADATA_FILE).is_file()
    )


def _commit_key(path: Path) -> tuple[float, int]:
    try:
        commit = json.loads((path / STATE_FILE).read_text()).get("commit", 0)
        commit = float(commit) if isinstance(commit, int) else float("inf")
    except (OSError, ValueError, AttributeError):
        # Unreadable: ranked newest, so a resume checks it first, reports it and sets it aside.
        commit = float("inf")
    return commit, step_of(path)


# A failed save that leaves less than this free (and less than a checkpoint) ran out of space.
_FULL_BELOW = 64 * 1024**2


# The checkpoint folder of a run whose config leaves `checkpoint.dir` unset.
RUN_CHECKPOINTS = "checkpoints"


def checkpoint_root(checkpoint_dir: str | None, log_dir: Path) -> Path:
    """Where a run's checkpoints go: `checkpoint.dir`, else `<logging.dir>/checkpoints`."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(log_dir) / RUN_CHECKPOINTS


def room_needed(planned: int, root: Path) -> int:
    """Bytes the next checkpoint in `root` needs: `planned`, or the newest complete one's size if larger
    (DCP's framing included)."""
    return max([planned, *(size_on_disk(p) for p in complete_checkpoints(root)[-1:])])


def size_on_disk(path: Path) -> int:
    """Bytes of the files in checkpoint folder `path` (0 if it cannot be listed)."""
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def committed_checkpoints(root: Path) -> list[Path]:
    """Every `step_NNNNNNNN` folder under `root` (each was committed by a rename), oldest commit first.

    Commit order, not step order: after resuming from an older checkpoint the run's new saves are
    the newest. Checkpoints of an h3train without commit records sort before any that have one,
    by step. Whether one is still readable is `validate_checkpoint`'s question.
    """
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=_commit_key)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints that still have their state file and metadata, oldest commit first."""
    return [p for p in committed_checkpoints(root) if is_complete(p)]


# `trainer_state.json`'s record of every file's digest at commit: `{"algorithm": ..., "files": {name: hex}}`.
DIGESTS_FIELD = "digests"


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())


def validate_checkpoint(path: Path) -> str | None:
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
        metadata = FileSystemReader(str(path)).read_metadata()
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


def file_digest_problem(path: Path, rank: int = 0, world: int = 1) -> str | None:
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


def verify_file_digests(path: Path) -> None:
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


def resume_candidates(root: Path, resume: str) -> list[Path]:
    """The checkpoints a resume tries, newest first: `auto` all committed ones, `none` none, or a path.

    An explicit path must be a committed checkpoint folder (ConfigError otherwise); whether its
    files are readable is checked later, by rank 0, with `validate_checkpoint`.
    """
    if resume == "none":
        return []
    if resume == "auto":
        return list(reversed(committed_checkpoints(root)))
    path = Path(resume)
    if not (path.is_dir() and STEP_DIR.match(path.name)):
        raise ConfigError(
            f"config key 'checkpoint.resume': '{resume}' is not a checkpoint folder "
            f"(expected step_NNNNNNNN with {STATE_FILE} and {METADATA_FILE}); use auto, none or such a folder"
        )
    return [path]


def check_same_model(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """A checkpoint resumes only into the architecture it was saved from (JSON-normalised compare)."""

    def norm(d: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps({k: v for k, v in d.items() if not k.startswith("_")}))

    a, b = norm(saved), norm(current)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            raise ConfigError(
                f"config key 'model.config.{key}' is {b.get(key)!r} but checkpoint '{path}' was saved with "
                f"{a.get(key)!r}; resume with the same model or set checkpoint.resume=none"
            )


# What the LR schedule is made of: changed on resume, the schedule is rebuilt from the new values.
SCHEDULE_KEYS = (
    ("optim", "lr"),
    ("optim", "schedule"),
    ("optim", "warmup_steps"),
    ("optim", "min_lr_ratio"),
    ("train", "steps"),
)


def schedule_changes(saved_yaml: str, cfg: Any) -> list[str]:
    """`['optim.lr 0.001 -> 0.01', ...]`: the schedule settings of `cfg` that differ from a saved config."""
    try:
        saved = yaml.safe_load(saved_yaml) or {}
    except yaml.YAMLError:
        return []
    changes = []
    for section, key in SCHEDULE_KEYS:
        old = (saved.get(section) or {}).get(key) if isinstance(saved, dict) else None
        new = getattr(getattr(cfg, section), key)
        if old is not None and old != new:
            changes.append(f"{section}.{key} {old} -> {new}")
    return changes


# -- the stateful components ----------------------------------------------------------------------


class ModelState:
    """The model's weights (sharded DTensors; DCP reshards them on load).

    `trainable_only` (LoRA runs): the parameters that train (adapters, `lora.train_modules`) and
    nothing of the frozen base, which a resume rebuilds from where a fresh start gets it (the
    pretrained folder or the seeded init; `h3train/lora/base.py`). Keys stay the live FQNs
    (`transformer.<module>.lora_A.default.weight`), so DCP reshards them like any other.
    """

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False) -> None:
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=True) if trainable_only else None
        self.trainable_only = trainable_only

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.trainable_only:
            set_model_state_dict(self.model, state)
            return
        wanted = set(self.state_dict())
        missing = sorted(wanted - set(state))
        if missing:
            raise KeyError(f"no value for trainable parameter {missing[0]} (and {len(missing) - 1} more)")
        # strict=False: the frozen base is deliberately absent; every trainable key was checked above.
        set_model_state_dict(self.model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


class OptimizerState:
    """The optimizer's moments and step counts, keyed by parameter FQN.

    Loading keeps the hyperparameters (lr, betas, eps, weight decay) as this run's config set them,
    so a changed `optim.*` on resume runs what `config.yaml` records. The LR itself is the schedule's.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(values)


class ScheduleState:
    """The LR schedule as a position (optimizer updates taken), rebuilt from this run's config on load.

    The schedule is a function of the config and the position, so a resume with a changed
    `optim.lr`, schedule, warmup or `train.steps` continues the new schedule at the same position;
    with an unchanged config the rebuilt learning rates equal the saved ones bit for bit.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"position": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = int(state["position"])
        sched = self.scheduler
        lrs = [base * fn(position) for fn, base in zip(sched.lr_lambdas, sched.base_lrs, strict=True)]
        restored = sched.state_dict()
        restored.update(last_epoch=position, _last_lr=lrs)
        sched.load_state_dict(restored)
        for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


class AttributeState:
    """Named attributes of an object (plain numbers) as a component: e.g. the trainer's step counters."""

    def __init__(self, owner: object, names: Iterable[str]) -> None:
        self.owner = owner
        self.names = tuple(names)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.owner, name) for name in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.names:
            setattr(self.owner, name, state[name])


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (as opposed to one that does not fit this run)."""


class UnreadableFile(Exception):
    """A checkpoint file that failed to load, named (raised inside DCP's read on the failing rank)."""


class _RecordingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        self.current = str(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class NamingReader(FileSystemReader):
    """DCP's file reader, naming the file a read failed on (DCP's own error names none)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _RecordingFileSystem()

    def read_data(self, plan, planner):  # noqa: ANN001, ANN201 - FileSystemReader's signature
        try:
            return super().read_data(plan, planner)
        except ValueError:
            # DCP's size checks: a tensor that does not fit this run's, not a damaged file.
            raise
        except Exception as exc:
            name = Path(self.fs.current).name if self.fs.current else "a .distcp file"
            raise UnreadableFile(f"{name} cannot be read ({_first_line(exc)})") from exc


def check_components(path: Path, components: dict[str, Stateful]) -> dict[str, Stateful]:
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


def read_components(path: Path, components: dict[str, Stateful]) -> dict[str, Any]:
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


# -- writing checkpoints --------------------------------------------------------------------------


@dataclass
class _PendingSave:
    """A background save in flight."""

    staged: Future  # the snapshot of the state is taken (host copy done)
    committed: Future  # rank 0: written and renamed into place; the other ranks: written
    final: Path


def staging_options(device: torch.device) -> StagingOptions:
    """DCP's staging for `device`: in the background; pinned buffers and non-blocking copies on CUDA.

    Shared memory is for a staging process; the writes here run on a thread of this process.
    """
    cuda = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
    )


class HeldStager(DefaultStager or object):
    """DCP's `DefaultStager`, whose copy starts when `release()` is called and after queued device work.

    Held: the copy is Python-heavy (a deep copy of the state dicts) and, started at once, would take
    the GIL from the training thread while `dcp.async_save` still sets up its writer thread; the
    checkpointer releases it as `save()` returns. Ordered: DefaultStager copies on a stream of its
    own, which does not wait for the training thread's stream, where the step's optimizer and EMA
    updates may still run when the save starts; the copy stream now waits for that work.
    """

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self._non_blocking = options.use_non_blocking_copy
        self._released = threading.Event()

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """On the training thread (inside `dcp.async_save`): queue the copy, held until `release()`."""
        self._released.clear()
        if self._non_blocking:
            # DefaultStager's copy stream (it has one whenever its copies are non-blocking); a
            # version without it gets a plain device sync, once per save.
            stream = getattr(self, "_staging_stream", None)
            if stream is not None:
                stream.wait_stream(torch.accelerator.current_stream())
            else:
                torch.accelerator.synchronize()
        return super().stage(state_dict, **kwargs)

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self._released.wait()
        return super()._stage(state_dict, **kwargs)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        super().close()


class Checkpointer:
    """Saves commit by rename; prunes only what this run's lineage holds (see `_prune`).

    With `async_save` a save runs in three parts: on the training thread, each component's
    `state_dict()` (plain values such as the step counters, the sampler and schedule positions are
    read here, so they are already a snapshot) and rank 0's creation of the temporary folder; on a
    staging thread, started as `save()` returns, the copy of every tensor to host memory
    (`HeldStager`); on a writer thread, DCP's planning (over this checkpointer's own gloo group)
    and the writes. Rank 0 commits on the writer thread as soon as the writes are complete
    (`_commit_when_written`); `wait()` waits for all of it and lines the ranks up after it.

    The invariant the caller keeps: until `wait_staged()` has returned, nothing changes a tensor of
    the checkpoint state in place, or the checkpoint would hold part of a later state. The trainer
    calls it right before `optimizer.step()`, the first write after a save (weights, AdamW moments;
    the LR schedule, the EMA shadows and LoRA weights change after that point), and `EmaHook.swapped_in`
    calls it before writing the EMA into the parameters (validation or rendering after a step that
    was skipped runs before the next update). The next step's forward and backward normally outlast
    the copy, so the wait is over before it starts (`scripts/step_report.py` measures it).

    One stager serves every save of a checkpointer: it owns the staging thread and the host buffers
    (pinned on CUDA; one copy of this rank's shard of the state, kept between saves), which the next
    save copies into again; that is safe because a save first waits for the previous one's writes.
    `close()` releases them.
    """

    def __init__(
        self,
        root: Path,
        keep_last: int,
        is_main: bool,
        async_save: bool = False,
        device: torch.device | None = None,
        owner: str = "",
        planned_bytes: int = 0,
    ) -> None:
        self.root = root
        # One checkpoint's planned size (`assemble.planned_checkpoint_bytes`), for a disk-full message.
        self.planned_bytes = planned_bytes
        # The token of the run lock this writer holds (`runlock.py`): its temporary folders carry it.
        self.owner = owner
        self.keep_last = keep_last
        self.is_main = is_main
        self.async_save = async_save
        self._pending: _PendingSave | None = None
        # Background writes plan over a gloo group of their own, so their collectives never
        # interleave with the training loop's on the default group (and work beside NCCL).
        self._group = dist.new_group(backend="gloo") if async_save else None
        background_copy = async_save and DefaultStager is not None
        self._stager = HeldStager(staging_options(device or torch.device("cpu"))) if background_copy else None
        # Checkpoints newer than the resume point that this run did not write are never pruned.
        # Resuming sets such later ones aside under another name, so this is a second guard.
        self.protected_after: int | None = None
        self.written: set[str] = set()
        # The step of the best checkpoint so far (`checkpoint.keep_best`), never pruned; None: none.
        self.best_step: Callable[[], int | None] = lambda: None

    def clean_incomplete(self) -> None:
        """Remove the `.tmp-*` leftovers of saves that never committed (rank 0; others wait).

        Only folders that carry an h3train writer's marker, of a writer other than this one, go:
        this run holds the folder's lock, so that writer has stopped. Anything else stays.
        """
        if self.is_main and self.root.is_dir():
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
    ) -> Path:
        """Write every rank's shards to a temporary folder, then commit it by an atomic rename.

        `info` goes to `trainer_state.json` with the step and the commit number. With `async_save`
        the call returns once the components' `state_dict()` are taken; the copy to host memory and
        the writes run in the background (see the class docstring for what must wait for the copy),
        and rank 0 commits as soon as they are complete; `wait()` (the next save, the end of training,
        a stop) waits for that. `before_commit` (fault injection) then runs while the background work
        is in flight. Returns the checkpoint's final name (committed, or committed once written).
        """
        self.wait()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        if self.is_main:
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
        if self.async_save:
            if self._stager is None:
                # Staged before `async_save` returns: the snapshot is taken already.
                written = dcp.async_save(dict(components), checkpoint_id=str(tmp), process_group=self._group)
                staged: Future = Future()
                staged.set_result(None)
            else:
                try:
                    response = dcp.async_save(
                        dict(components), checkpoint_id=str(tmp), process_group=self._group, async_stager=self._stager
                    )
                finally:
                    self._stager.release()
                staged, written = response.staging_completion, response.upload_completion
            committed = self._commit_when_written(written, tmp, final, step, dict(info))
            self._pending = _PendingSave(staged, committed, final)
            if before_commit is not None:
                before_commit()
            return final
        try:
            dcp.save(dict(components), checkpoint_id=str(tmp))
            self._commit(tmp, final, step, info, before_commit)
        except BaseException as exc:
            self._raise_if_full(exc, tmp, step)
            raise
        return final

    def wait_staged(self) -> None:
        """Block until the save in flight has its snapshot of the state; after it, the state may change.

        Cheap when there is no save in flight or its copy is done; raises what the copy raised.
        """
        pending = self._pending
        if pending is not None:
            pending.staged.result()

    def wait(self) -> Path | None:
        """Finish the background save in flight, if any, and commit it (collective). Returns its path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        # The writes wait for the snapshot, so `committed` also raises what the copy raised.
        try:
            pending.committed.result()
        except BaseException as exc:
            self._raise_if_full(exc, pending.final.with_name(f".tmp-{pending.final.name}"), step_of(pending.final))
            raise
        self.written.add(pending.final.name)
        # Every rank returns once rank 0 has committed.
        dist.barrier()
        return pending.final

    def _raise_if_full(self, exc: BaseException, tmp: Path, step: int) -> None:
        """A save that ran out of space becomes one `DiskFullError` line; other failures pass through.

        Out of space: an ENOSPC / EDQUOT `OSError` behind `exc`, or a folder left with less free space
        than the checkpoint needs and than `_FULL_BELOW` (torch's zip writer turns a short write into a
        RuntimeError that does not name the errno). Rank 0 then removes the partial save (its own
        marked temporary folder: no rank writes to it once DCP has raised), so the space is free
        again, and names what is needed and free; earlier checkpoints stay as they are. DCP raises a
        failure on every rank alike, so rank 0 alone reports it; a failure of rank 0's commit is its own.
        """
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

    def _commit_when_written(self, written: Future, tmp: Path, final: Path, step: int, info: dict[str, Any]) -> Future:
        """Rank 0 commits a background save as soon as it is written, on the writer thread.

        DCP's future completes on every rank only after the coordinator (rank 0 of the group) has
        gathered every rank's write results and written the metadata, so rank 0's completion means
        the whole checkpoint is on disk and no collective is needed. Committing then, not at the next
        save, means a crash any time after the write finds this checkpoint.
        """
        if not self.is_main:
            return written
        committed: Future = Future()

        def commit(done: Future) -> None:
            try:
                done.result()
                self._rename_into_place(tmp, final, step, info)
                committed.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the training thread
                committed.set_exception(exc)

        written.add_done_callback(commit)
        return committed

    def close(self) -> None:
        """Release the stager (its thread, its host buffers); no collective, so also after a failure.

        A save still in flight commits on its own once written (rank 0's writer thread); `wait()`
        waits for that.
        """
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _commit(
        self, tmp: Path, final: Path, step: int, info: dict[str, Any], before_commit: Callable[[], None] | None
    ) -> None:
        """Every rank's shards are in `tmp` once all ranks have gathered their digests: rank 0 commits it.

        Each rank digests the shard files it wrote itself (`__<rank>_*.distcp`), in parallel.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {p.name: digest_file(p) for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}
        gathered: list[dict[str, str]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, mine)
        if before_commit is not None:
            before_commit()
        if self.is_main:
            self._rename_into_place(tmp, final, step, info, {k: v for part in gathered for k, v in part.items()})
        self.written.add(final.name)
        dist.barrier()

    def _rename_into_place(
        self, tmp: Path, final: Path, step: int, info: dict[str, Any], digests: dict[str, str] | None = None
    ) -> None:
        """Rank 0, no collective: write the record into the complete `tmp`, rename it to `final`, prune.

        The record holds a digest of every file (`digests` gives those the ranks computed; rank 0
        reads the rest, all of them for a background save, on the writer thread).
        """
        files = dict(digests or {})
        for file in sorted(tmp.iterdir()):
            if file.is_file() and file.name not in files and file.name not in (STATE_FILE, OWNER_NAME):
                files[file.name] = digest_file(file)
        record = {
            "step": step,
            "commit": self._next_commit(),
            **info,
            DIGESTS_FIELD: {"algorithm": ALGORITHM, "files": files},
        }
        atomic_write_text(tmp / STATE_FILE, json.dumps(record, indent=2, default=str))
        for file in tmp.iterdir():
            apply_file_mode(file)
        if final.exists():
            # Only a checkpoint of this very lineage can be here (later ones were set aside at
            # resume); it is still kept, under another name, rather than deleted.
            set_aside(final, "replaced")
        os.replace(tmp, final)
        fsync_path(self.root)
        self._prune(keep=final)

    def _prune(self, keep: Path) -> None:
        """Retire all but the newest `keep_last` checkpoints and the best; delete them in the background.

        A checkpoint newer than the resume point that this run did not write is never retired. A
        retired checkpoint is first renamed to `.tmp-*` (atomic), so an interrupted deletion never
        leaves a half checkpoint under a valid name; deleting hundreds of GB must not hold up training.
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
            target = old.with_name(f".tmp-retired-{old.name}")
            mark_owned(old, self.owner)  # before the rename: a retired folder always carries it
            os.replace(old, target)
            retired.append(target)
        if retired:
            threading.Thread(
                target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in retired],
                name="checkpoint-prune",
                daemon=False,
            ).start()
