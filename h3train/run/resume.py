"""Resume policy: which checkpoint a run continues from, and restoring it on every rank alike.

`Resume` is made before any process group (`checkpoint.resume` and the run folders are checked
there, so a bad value is one line before heavy work), `choose()` agrees on a checkpoint once the
group exists (the model build depends on it: a resumed run reads every value from the checkpoint
and never builds a full model), and `restore(parts)` loads it into the run's parts once the trainer
has attached its hooks (`assemble.build_trainer`): validate, fall back to an older checkpoint, load
every component, report what changed.

- `checkpoint.resume=auto`: the newest complete checkpoint of `checkpoint.dir`. One that cannot be
  loaded is reported in one line, renamed `step_N.corrupt` (never deleted) and the next older one
  is tried; when none is left the run starts afresh under the fresh-run policy (`rundir.py`).
- `checkpoint.resume=PATH`: exactly that checkpoint; any failure is a `CheckpointError`.
- `none`, or `--overwrite`: a fresh start (`--overwrite` first moves the earlier run aside).
- Nothing to resume in a folder that holds this run's own earlier attempt, cut short before its first
  checkpoint: a restart from step 0; rank 0 sets the attempt's rows aside first (`rundir.py`).

Rank 0 decides and broadcasts: nodes can list a shared folder differently for a moment (directory
caches on network filesystems), and ranks loading different steps would mix shards silently. The
collective read ends in an all-reduce of its outcome, so a file that fails on any rank fails on all.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.stateful import Stateful

from ..checkpoint import (
    METADATA_FILE,
    STATE_FILE,
    STEP_DIR,
    Checkpointer,
    CorruptCheckpoint,
    check_components,
    committed_checkpoints,
    is_complete,
    read_components,
    read_trainer_state,
    step_of,
    validate_checkpoint,
    verify_file_digests,
)
from ..config import Config, to_yaml
from ..data.step_composition import batch_layout, global_batch_change
from ..errors import CheckpointError, ConfigError, H3TrainError, UsageError
from ..infra.atomic import set_aside
from ..infra.objects import Folder, location
from ..lora.base import read_record
from ..model.adapter import ModelAdapter
from ..parallel.dims import ParallelContext
from ..train.events import Progress
from ..train.metrics import set_aside_later_lines
from .rundir import check_fresh_run, move_run_aside, set_aside_for_restart, set_aside_later_checkpoints


class Restorable(Protocol):
    """The run's parts as `restore` sees them (`parts.TrainingParts`)."""

    progress: Progress
    scheduler: torch.optim.lr_scheduler.LambdaLR
    checkpoint_state: dict[str, Stateful]
    checkpointer: Checkpointer

    @property
    def event_logs(self) -> list[Path | None]: ...


def check_full_checkpoint(saved: dict[str, Any], path: Path) -> None:
    """A full fine-tune resumes only a checkpoint of the whole model, not an adapter checkpoint."""
    if read_record(saved) is not None:
        raise CheckpointError(
            f"checkpoint '{path}' is a LoRA checkpoint (adapters only) and this run fine-tunes the "
            "whole model; resume it with its lora settings or set checkpoint.resume=none"
        )


def check_same_optimizer(saved: dict[str, Any], cfg: Config, path: Path) -> None:
    """A checkpoint's optimizer states load only into the `optim.name` that wrote them."""
    try:
        saved_cfg = yaml.safe_load(saved.get("config_yaml", "")) or {}
    except yaml.YAMLError:
        return
    optim = saved_cfg.get("optim") if isinstance(saved_cfg, dict) else None
    name = (optim or {}).get("name", "adamw") if isinstance(optim, dict) else "adamw"
    if name != cfg.optim.name:
        raise CheckpointError(
            f"checkpoint '{path}' holds {name} optimizer states and this run sets optim.name={cfg.optim.name}: "
            f"resume with optim.name={name}, or start a new run from its weights (h3train export, then "
            "model.pretrained for a full fine-tune, lora.init_from for adapters)"
        )


class Resume:
    """The resume decision of one run (see the module docstring)."""

    def __init__(self, cfg: Config, log_dir: Path, ckpt_dir: Folder, overwrite: bool) -> None:
        """Before any process group: the candidates, and the fresh-run policy when there are none."""
        self.cfg = cfg
        self.log_dir, self.ckpt_dir = log_dir, ckpt_dir
        self.overwrite = overwrite
        self.explicit = cfg.checkpoint.resume not in ("auto", "none")
        if overwrite and self.explicit:
            raise UsageError(
                f"--overwrite starts afresh and cannot resume checkpoint.resume='{cfg.checkpoint.resume}'; "
                "drop one of them"
            )
        self._candidates = [] if overwrite else resume_candidates(ckpt_dir, cfg.checkpoint.resume)
        self._config_yaml = to_yaml(cfg)
        # This run restarts its own earlier attempt, cut short before its first checkpoint (`rundir.py`).
        self._restart = False
        if not self._candidates and not overwrite:
            self._restart = check_fresh_run(log_dir, ckpt_dir, self._config_yaml, cfg.train.steps)
        self.ctx: ParallelContext | None = None
        self.adapter: ModelAdapter | None = None
        self.model_dims: dict[str, Any] = {}
        self.path: Folder | None = None

    def choose(self, ctx: ParallelContext, model_dims: dict[str, Any], adapter: ModelAdapter | None) -> Folder | None:
        """The checkpoint every rank resumes from (None: a fresh start); collective.

        Rank 0 validates the candidates newest first; all ranks then check that they see it and
        that it fits this run (the model's architecture, the adapter or its absence).
        """
        self.ctx, self.model_dims, self.adapter = ctx, model_dims, adapter
        self.path = self._agree(first=True)
        return self.path

    def restore(self, parts: Restorable) -> Folder | None:
        """Load every component of `parts.checkpoint_state` from the chosen checkpoint, if any.

        Falls back to older checkpoints as `choose` does when the read fails; components the
        checkpoint lacks start afresh (`start_fresh`); later checkpoints and event-log lines of
        the steps about to be redone are kept aside; schedule changes since the checkpoint are said.
        """
        path = self.path
        if path is None:
            return None
        ctx = self._context()
        while True:
            # The ranks read the files' digests in parallel first: flipped bytes are a damaged checkpoint.
            code, failure, _ = self._agreed_attempt(verify_file_digests, path)
            if code == 0:
                code, failure, components = self._agreed_attempt(check_components, path, parts.checkpoint_state)
            if code == 0:
                code, failure, saved = self._agreed_attempt(read_components, path, components)
            if code == 0:
                break
            if failure is None:
                failure = CheckpointError(f"checkpoint '{path}' cannot be read on another rank")
            if self.explicit or code == 2:
                self._agreed_error(failure)
            if ctx.is_main:
                self._report_corrupt(path, str(failure).split(": ", 1)[-1])
            dist.barrier()
            older = self._agree(first=False)
            if older is None:
                self._agreed_error(
                    CheckpointError(
                        f"no checkpoint in '{self.ckpt_dir}' could be loaded (the failing ones are set aside "
                        "as step_N.corrupt); run again to start afresh, or set checkpoint.resume to a good one"
                    )
                )
            path = older

        def apply() -> None:
            for name, component in components.items():
                try:
                    component.load_state_dict(saved[name])
                except (ValueError, KeyError) as exc:
                    message = f"checkpoint '{path}': its {name} state does not fit this run: {exc}"
                    raise CheckpointError(message) from exc

        # Every rank meets a misfit alike (the same config, the same checkpoint): one of them says it.
        code, failure, _ = self._agreed_attempt(apply)
        if code:
            self._agreed_error(failure or CheckpointError(f"checkpoint '{path}' does not fit this run on another rank"))
        for name, component in parts.checkpoint_state.items():
            if name not in components:
                component.start_fresh()
                if ctx.is_main:
                    fresh = getattr(component, "fresh_start", "it starts from the resumed weights")
                    print(f"resume: {path.name} holds no {name}; {fresh}", flush=True)
        self.path = path
        self._report(parts, path)
        dist.barrier()
        return path

    # -- the decision --------------------------------------------------------------------------

    def _context(self) -> ParallelContext:
        assert self.ctx is not None, "Resume.choose runs before restore"
        return self.ctx

    def _agree(self, first: bool) -> Folder | None:
        """Rank 0 picks the next loadable candidate and broadcasts it; every rank checks it fits."""
        ctx = self._context()
        decision: list = [None]
        if ctx.is_main:
            decision[0] = self._decide(self.overwrite and first)
        dist.broadcast_object_list(decision, src=0)
        chosen, error, remaining = decision[0]
        self._candidates = [location(p) for p in remaining]
        if error is not None:
            kind, message = error
            self._agreed_error({"usage": UsageError, "checkpoint": CheckpointError}[kind](message))
        if chosen is None:
            return None
        agreed = location(chosen)
        if not is_complete(agreed):
            raise CheckpointError(
                f"config key 'checkpoint.resume': rank {ctx.rank} cannot see the complete "
                f"checkpoint '{agreed}' that rank 0 resumes from; check the shared filesystem"
            )
        try:
            saved = read_trainer_state(agreed)
            check_same_model(saved["model_config"], self.model_dims, agreed)
            check_same_optimizer(saved, self.cfg, agreed)
            if self.adapter is not None:
                self.adapter.check_checkpoint(saved, agreed)
            else:
                check_full_checkpoint(saved, agreed)
        except (ConfigError, CheckpointError) as exc:
            self._agreed_error(exc)
        return agreed

    def _decide(self, overwrite: bool) -> tuple[str | None, tuple[str, str] | None, list[str]]:
        """Rank 0: (checkpoint to resume or None, (error kind, message) or None, candidates left)."""
        if overwrite:
            aside = move_run_aside(self.log_dir, self.ckpt_dir)
            if aside is not None:
                print(f"--overwrite: moved the earlier run to {aside}", flush=True)
            return None, None, []
        had_candidates = bool(self._candidates)
        candidates = list(self._candidates)
        while candidates:
            path = candidates.pop(0)
            problem = validate_checkpoint(path)
            if problem is None:
                return str(path), None, [str(p) for p in candidates]
            if self.explicit:
                return None, ("checkpoint", f"checkpoint.resume '{path}' cannot be loaded: {problem}"), []
            self._report_corrupt(path, problem)
        if had_candidates:
            # Every checkpoint failed: this is now a fresh run, under the same policy as any other.
            try:
                self._restart = check_fresh_run(self.log_dir, self.ckpt_dir, self._config_yaml, self.cfg.train.steps)
            except UsageError as exc:
                return None, ("usage", str(exc)), []
        if self._restart:
            self._restart = False
            print(set_aside_for_restart(self.log_dir), flush=True)
        return None, None, []

    def _report_corrupt(self, path: Folder, problem: str) -> None:
        """Rank 0: set a checkpoint that cannot be loaded aside (never deleted) and say so in one line."""
        moved = set_aside(path, "corrupt", first=STATE_FILE)
        print(
            f"h3train: warning: skipped checkpoint {path} (step {step_of(path)}): {problem}; "
            f"renamed it {moved.name} and trying the next older one",
            file=sys.stderr,
            flush=True,
        )

    def _agreed_error(self, exc: H3TrainError) -> NoReturn:
        """Raise an error every rank reached alike (`H3TrainError.agreed`): rank 0 alone reports it.

        Raised after the process group exists, it would otherwise be printed once per rank.
        """
        exc.agreed = True
        raise exc

    def _agreed_attempt(self, attempt: Callable[..., Any], *args: Any) -> tuple[int, CheckpointError | None, Any]:
        """Run `attempt(*args)` on every rank; all agree on the worst outcome (MAX all-reduce).

        Codes: 0 it worked; 1 the checkpoint's files are damaged (an older one may serve); 2 the
        checkpoint does not fit this run. Returns (agreed code, this rank's error or None, result).
        """
        result, failure, code = None, None, 0
        try:
            result = attempt(*args)
        except CorruptCheckpoint as exc:
            failure, code = exc, 1
        except CheckpointError as exc:
            failure, code = exc, 2
        flag = torch.tensor([code], device=self._context().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()), failure, result

    # -- after the load ------------------------------------------------------------------------

    def _report(self, parts: Restorable, path: Folder) -> None:
        state = read_trainer_state(path)
        changes = schedule_changes(state.get("config_yaml", ""), self.cfg)
        cfg, dp = self.cfg, self._context().dims.dp
        now = batch_layout(dp, cfg.train.grad_accum, cfg.data.pack, cfg.train.global_batch)
        batch = global_batch_change(state["batch"], now) if isinstance(state.get("batch"), dict) else None
        step = parts.progress.step
        # Later history is kept, under names that no resume or prune picks up.
        parts.checkpointer.protected_after = step
        if not self._context().is_main:
            return
        for moved in set_aside_later_checkpoints(self.ckpt_dir, step):
            print(f"kept the abandoned later checkpoint as {moved}", flush=True)
        # The event logs of the steps about to be redone are kept beside them, as metrics.jsonl's.
        for log in parts.event_logs:
            if log is not None:
                set_aside_later_lines(log, step)
        print(f"resumed from {path} at step {step}", flush=True)
        if batch is not None:
            print(f"resume: {batch} (since {path.name})", flush=True)
        if changes:
            sched = parts.scheduler
            print(
                f"resume: {', '.join(changes)} since {path.name}: the LR schedule is rebuilt from this "
                f"config at update {sched.last_epoch} (next lr {sched.get_last_lr()[0]:.3e})",
                flush=True,
            )


# -- which checkpoints, and what may change across a resume ----------------------------------------
def resume_candidates(root: Folder, resume: str) -> list[Folder]:
    """The checkpoints a resume tries, newest first: `auto` all committed ones, `none` none, or a path.

    An explicit path must be a committed checkpoint folder (ConfigError otherwise); whether its
    files are readable is checked later, by rank 0, with `validate_checkpoint`.
    """
    if resume == "none":
        return []
    if resume == "auto":
        return list(reversed(committed_checkpoints(root)))
    path = location(resume)
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
