"""Where checkpoints live and what they are called: step folders, commit order, listing, the state file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..infra.objects import Folder, RemoteDir, location

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "trainer_state.json"
METADATA_FILE = ".metadata"
# DCP key prefix of the transformer's weights: component "model", module "transformer".
MODEL_PREFIX = "model.transformer."


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Folder) -> int:
    return int(STEP_DIR.match(path.name).group(1))


# -- reading checkpoints --------------------------------------------------------------------------


def is_complete(path: Folder) -> bool:
    return (
        path.is_dir()
        and STEP_DIR.match(path.name) is not None
        and (path / STATE_FILE).is_file()
        and (path / METADATA_FILE).is_file()
    )


def _commit_key(path: Folder) -> tuple[float, int]:
    try:
        commit = json.loads((path / STATE_FILE).read_text()).get("commit", 0)
        commit = float(commit) if isinstance(commit, int) else float("inf")
    except (OSError, ValueError, AttributeError):
        # Unreadable: ranked newest, so a resume checks it first, reports it and sets it aside.
        commit = float("inf")
    return commit, step_of(path)


# The checkpoint folder of a run whose config leaves `checkpoint.dir` unset.
RUN_CHECKPOINTS = "checkpoints"


def checkpoint_root(checkpoint_dir: str | None, log_dir: Path) -> Folder:
    """Where a run's checkpoints go: `checkpoint.dir` (a folder, or a URL on object storage), else
    `<logging.dir>/checkpoints`."""
    return location(checkpoint_dir) if checkpoint_dir else Path(log_dir) / RUN_CHECKPOINTS


def size_on_disk(path: Folder) -> int:
    """Bytes of the files in checkpoint folder `path` (0 if it cannot be listed)."""
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def committed_checkpoints(root: Folder) -> list[Folder]:
    """Every `step_NNNNNNNN` folder under `root` (each was committed by a rename), oldest commit first.
    On object storage, where a save is written under its final name, only the step prefixes that hold
    their record (`STATE_FILE`, the commit: `writer.py`).

    Commit order, not step order: after resuming from an older checkpoint the run's new saves are
    the newest. Checkpoints of an h3train without commit records sort before any that have one,
    by step. Whether one is still readable is `validate_checkpoint`'s question.
    """
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    if isinstance(root, RemoteDir):
        found = [p for p in found if (p / STATE_FILE).is_file()]
    return sorted(found, key=_commit_key)


# `trainer_state.json`'s record of every file's digest at commit: `{"algorithm": ..., "files": {name: hex}}`.
DIGESTS_FIELD = "digests"


def read_trainer_state(path: Folder) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())
