"""Checkpoints of the whole training state with `torch.distributed.checkpoint`, committed atomically.

Layout of `checkpoint.dir`:

    step_00000012/           a complete checkpoint (only complete ones carry this name)
      .metadata, *.distcp    DCP: model and optimizer, sharded, every rank writes its part
      trainer_state.json     step, LR scheduler, sampler position, model config, resolved config
      rng_rank{r}.safetensors  per-rank torch RNG states
    .tmp-step_00000013/      being written; renamed to step_00000013 once every rank is done

A checkpoint is valid only once it has its final name: the rename is the commit, done by rank 0 after
a barrier that follows every rank's write. `.tmp-*` folders are never read and are removed at start.
Parameters are keyed by their FQN, so DCP reshards on load: a run resumes under another
`dp_shard` / `sp` / `dp_replicate`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..atomic import atomic_write_text, fsync_path
from ..errors import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (
        path.is_dir()
        and STEP_DIR.match(path.name) is not None
        and (path / STATE_FILE).is_file()
        and (path / ".metadata").is_file()
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, in commit order (oldest first).

    Commit order, not step order: after resuming from an older checkpoint, the run's new saves are
    the newest, and the abandoned later steps are the first to be pruned.
    """
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if is_complete(p)), key=lambda p: ((p / STATE_FILE).stat().st_mtime, p.name)
    )


def resolve_resume(root: Path, resume: str) -> Path | None:
    """`auto`: the newest complete checkpoint (None when there is none); `none`; or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(
            f"config key 'checkpoint.resume': '{resume}' is not a complete checkpoint folder "
            f"(expected {step_dir_name(0)[:5]}NNNNNNNN with {STATE_FILE} and .metadata)"
        )
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())


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


@dataclass
class TrainingState:
    """What a checkpoint holds besides the DCP tensors."""

    step: int
    scheduler: dict[str, Any]
    sampler: dict[str, Any]
    model_config: dict[str, Any]
    config_yaml: str
    extra: dict[str, Any] = field(default_factory=dict)


class Checkpointer:
    def __init__(self, root: Path, keep_last: int, is_main: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.is_main = is_main

    def clean_incomplete(self) -> None:
        """Remove `.tmp-*` leftovers of a save that never committed (rank 0; others wait)."""
        if self.is_main and self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(".tmp-"):
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def save(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState, before_commit=None
    ) -> Path:
        """Write every rank's shards to a temporary folder, then commit it by an atomic rename."""
        final = self.root / step_dir_name(state.step)
        tmp = self.root / f".tmp-{final.name}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        rank = dist.get_rank()
        save_file({"cpu": torch.get_rng_state()}, str(tmp / f"rng_rank{rank}.safetensors"))
        if self.is_main:
            atomic_write_text(tmp / STATE_FILE, json.dumps(state.__dict__, indent=2, default=str))
        dist.barrier()
        if before_commit is not None:
            before_commit()
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(self.root)
        dist.barrier()
        if self.is_main:
            self._prune(keep=final)
        return final

    def _prune(self, keep: Path) -> None:
        """Retire all but the newest `keep_last` checkpoints; delete them in the background.

        A retired checkpoint is first renamed to `.tmp-*` (atomic), so an interrupted deletion never
        leaves a half checkpoint under a valid name; deleting hundreds of GB must not hold up training.
        """
        if self.keep_last <= 0:
            return
        retired = []
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            if old != keep:
                target = old.with_name(f".tmp-retired-{old.name}")
                os.replace(old, target)
                retired.append(target)
        if retired:
            threading.Thread(
                target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in retired],
                name="checkpoint-prune",
                daemon=False,
            ).start()

    @staticmethod
    def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState:
        """Load model and optimizer (resharding as needed) and return the rest of the state."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng = path / f"rng_rank{dist.get_rank()}.safetensors"
        if rng.is_file():
            # The layout may have changed (more ranks than saved ones): then the default RNG keeps its seed.
            torch.set_rng_state(load_file(str(rng))["cpu"])
        return TrainingState(**read_trainer_state(path))
