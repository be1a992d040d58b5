"""What a run may do with the run folder it is given: nothing a user wrote is destroyed or shadowed.

The policy, checked at the start of `Trainer.__init__`, before any process group or model:

- `logging.dir` and `checkpoint.dir` must be creatable and writable (a temporary file of 4 KiB is
  written and removed in each), and `checkpoint.dir` must have room for one checkpoint of the run
  (`diskspace.check_room`), else exit 2 naming the key: not a failed save after hours of training.
- A fresh run (`checkpoint.resume=none`, or `auto` with nothing to resume) into a folder that holds
  an earlier run (a non-empty `metrics.jsonl` or a committed checkpoint) is refused (exit 2), naming
  the folder and the ways out: `checkpoint.resume=auto`, another `logging.dir`, or `--overwrite`.
- Except a restart of the same run cut short before its first checkpoint (a requeue, `torchrun
  --max-restarts`): no committed checkpoint, its `config.yaml` is this run's, its rows stop before
  `train.steps`. Its rows (`metrics.jsonl`, the held-out evaluations among them, the event logs,
  TensorBoard's events) move to `<name>.abandoned-0`, one line says so, and the run trains from step
  0. A changed config is refused as above, naming what changed; so is a run that finished.
- `--overwrite` moves the earlier run aside, into `<logging.dir>/previous-<n>/` (its checkpoints
  into `previous-<n>/checkpoints`, or `<checkpoint.dir>/previous-<n>/` when that is elsewhere), and
  starts afresh. Nothing is deleted; remove the `previous-*` folders yourself.
- A resume from an older step keeps the abandoned later history: the later checkpoints are renamed
  `step_N.abandoned-<resume step>` (no resume or prune picks them up), the later metrics lines move
  to `metrics.jsonl.abandoned-<resume step>` (`MetricsLogger`), and an earlier `config.yaml` that
  differs from this run's is kept as `config.yaml.previous-<n>` (`write_resolved_config`).

Every rank reaches the same decision from the same (shared) folder; only rank 0 moves anything, and
only once it holds both folders' lock (`h3train/infra/runlock.py`, taken in `assemble`): a second run
into either folder stops before it changes anything.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import STATE_FILE, committed_checkpoints, step_of
from ..checkpoint.run_config import CONFIG_FILE
from ..errors import ConfigError, UsageError
from ..infra.atomic import is_taken, set_aside
from ..infra.objects import Folder, RemoteDir
from ..train.metrics import METRICS_FILE, iter_rows

# What h3train writes into `logging.dir` (besides checkpoints); `--overwrite` moves these aside.
RUN_FILES = (
    "metrics.jsonl",
    "config.yaml",
    "data_errors.jsonl",
    "loss_spikes.jsonl",
    "trained_samples",
    "dump",
    "wandb",
    "tensorboard",
)
RUN_FILE_PREFIXES = ("metrics.jsonl.", "config.yaml.", "data_errors.jsonl.", "loss_spikes.jsonl.", "tensorboard.")
ASIDE_PREFIX = "previous-"
# What a restart from step 0 writes again, set aside as `<name>.abandoned-0`. `trained_samples` records
# each start as an attempt of its own (`data/trained_samples.py`); `config.yaml` is the same.
RESTART_FILES = (METRICS_FILE, "data_errors.jsonl", "loss_spikes.jsonl", "tensorboard")
RESTART_TAG = "abandoned-0"
# How many changed keys a refused restart names.
_NAMED_CHANGES = 3


_PROBE_BYTES = 4096


def probe_writable(path: Folder, key: str) -> None:
    """Create folder `path` and a temporary file in it; ConfigError naming `key` if either fails. On object
    storage: write and delete a small object under the prefix (a refused credential, a missing bucket, an
    unreachable endpoint: one line before any work)."""
    if isinstance(path, RemoteDir):
        probe = path / f".h3train-probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(bytes(_PROBE_BYTES))
            probe.unlink()
        except Exception as exc:  # noqa: BLE001 - each fsspec backend raises its own kinds
            said = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__
            raise ConfigError(
                f"config key '{key}': cannot write to '{path}' ({reason}); check the bucket and the credentials "
                "the object store reads from the environment or its config files"
            ) from None
        return
    if path.exists() and not path.is_dir():
        raise ConfigError(f"config key '{key}': '{path}' is a file, not a folder; choose a folder path")
    probe = path / f".h3train-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Some bytes, not an empty file: a full disk still makes an empty file.
        probe.write_bytes(bytes(_PROBE_BYTES))
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"config key '{key}': cannot write to '{path}' ({reason}); choose a folder this job can write"
        ) from exc


def earlier_run(log_dir: Path, ckpt_dir: Folder) -> list[str]:
    """What of an earlier run the folders hold: e.g. ['metrics.jsonl', '2 checkpoints']; [] if none."""
    found = []
    metrics = log_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    count = len(committed_checkpoints(ckpt_dir))
    if count:
        found.append(f"{count} checkpoint{'s' if count > 1 else ''} in {ckpt_dir}")
    return found


def check_fresh_run(log_dir: Path, ckpt_dir: Folder, config_yaml: str, steps: int) -> bool:
    """Refuse a fresh run over an earlier one (UsageError, one line with the ways out), unless the earlier
    run is this one (`config_yaml`, `train.steps` = `steps`) cut short before its first checkpoint: then
    True, and rank 0 sets its rows aside (`set_aside_for_restart`) before anything is written."""
    found = earlier_run(log_dir, ckpt_dir)
    if not found:
        return False
    resumable = any("checkpoint" in item for item in found)
    continue_it = "continue it with checkpoint.resume=auto, " if resumable else ""
    held = f"logging.dir '{log_dir}' already holds a run ({', '.join(found)})"
    if not resumable:
        recorded = recorded_config(log_dir)
        changes = None if recorded is None else config_changes(recorded, config_yaml)
        if recorded is None:
            held += f" without a readable {CONFIG_FILE}"
        elif changes is not None:
            held += f" that stopped before its first checkpoint under another config ({changes})"
            continue_it = f"restart it with its own config ('h3train train {log_dir / CONFIG_FILE}'), "
        elif last_trained_step(log_dir) < steps:
            return True
    raise UsageError(
        f"{held}; {continue_it}choose a new logging.dir, or pass --overwrite to move it aside into "
        f"{log_dir}/{ASIDE_PREFIX}<n> and start afresh"
    )


def recorded_config(log_dir: Path) -> dict[str, Any] | None:
    """The config a run recorded in `<log_dir>/config.yaml` (None: missing or unreadable)."""
    try:
        recorded = yaml.safe_load((log_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return recorded if isinstance(recorded, dict) else None


def config_changes(recorded: dict[str, Any], config_yaml: str) -> str | None:
    """How `config_yaml` differs from the `recorded` config: `'optim.lr 0.001 -> 0.01'` (the first few
    keys that differ), or None when they are the same."""
    before, after = _flat(recorded), _flat(yaml.safe_load(config_yaml))
    changed = [key for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    if not changed:
        return None
    named = ", ".join(f"{key} {before.get(key)} -> {after.get(key)}" for key in changed[:_NAMED_CHANGES])
    more = len(changed) - _NAMED_CHANGES
    return named + (f" and {more} more" if more > 0 else "")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A config's mapping as dotted keys -> leaf values (a list is a leaf)."""
    if not isinstance(value, dict):
        return {prefix.removesuffix("."): value}
    out: dict[str, Any] = {}
    for key, inner in value.items():
        out.update(_flat(inner, f"{prefix}{key}."))
    return out


def last_trained_step(log_dir: Path) -> int:
    """The last step whose training row `<log_dir>/metrics.jsonl` holds (0: none)."""
    path = log_dir / METRICS_FILE
    if not path.is_file():
        return 0
    return max((row["step"] for row in iter_rows(path) if row.get("kind") is None), default=0)


def set_aside_for_restart(log_dir: Path) -> str:
    """Rank 0, restarting from step 0 a run cut short before its first checkpoint: move what the
    restart writes again (`RESTART_FILES`) to `<name>.abandoned-0` (never deleted); return the line
    that says so."""
    stopped = last_trained_step(log_dir)
    moved = [set_aside(path, RESTART_TAG).name for name in RESTART_FILES if os.path.lexists(path := log_dir / name)]
    return (
        f"restart: the earlier attempt of this run stopped after step {stopped}, before its first checkpoint; "
        f"its rows are kept in {log_dir} as {', '.join(moved)}, and this one trains from step 0"
    )


def _aside_folder(log_dir: Path, ckpt_dir: Folder) -> tuple[Path, Folder]:
    inside = _is_within(ckpt_dir, log_dir)
    n = 1
    while True:
        logs = log_dir / f"{ASIDE_PREFIX}{n}"
        ckpts = logs / ckpt_dir.resolve().relative_to(log_dir.resolve()) if inside else ckpt_dir / logs.name
        if not os.path.lexists(logs) and not is_taken(ckpts):
            return logs, ckpts
        n += 1


def _is_within(path: Folder, folder: Path) -> bool:
    if isinstance(path, RemoteDir):
        return False
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def move_run_aside(log_dir: Path, ckpt_dir: Folder) -> Path | None:
    """`--overwrite`: move an earlier run's files into `previous-<n>/`; return that folder (None: nothing)."""
    if not earlier_run(log_dir, ckpt_dir) and not (log_dir / "config.yaml").exists():
        return None
    logs, ckpts = _aside_folder(log_dir, ckpt_dir)
    moved = False
    if log_dir.is_dir():
        for path in sorted(log_dir.iterdir()):
            if path.name in RUN_FILES or path.name.startswith(RUN_FILE_PREFIXES):
                logs.mkdir(parents=True, exist_ok=True)
                os.replace(path, logs / path.name)
                moved = True
    if ckpt_dir.is_dir():
        for path in sorted(ckpt_dir.iterdir()):
            # Committed, corrupt and abandoned checkpoints all start with step_; .tmp-* are unfinished.
            if path.name.startswith("step_"):
                ckpts.mkdir(parents=True, exist_ok=True)
                if isinstance(path, RemoteDir):
                    path.rename(ckpts / path.name, first=STATE_FILE)
                else:
                    os.replace(path, ckpts / path.name)
                moved = True
    return logs if moved else None


def set_aside_later_checkpoints(ckpt_dir: Folder, step: int) -> list[Folder]:
    """Rename committed checkpoints after `step` to `step_N.abandoned-<step>`; return the new paths."""
    later = [p for p in committed_checkpoints(ckpt_dir) if step_of(p) > step]
    return [set_aside(p, f"abandoned-{step}", first=STATE_FILE) for p in later]
