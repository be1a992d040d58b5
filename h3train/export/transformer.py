"""Export a training checkpoint as a diffusers transformer folder (or, for LoRA, a LoRA file).

`config.json` plus sharded safetensors with an index (`diffusion_pytorch_model-0000k-of-0000n`),
loadable by `MiniMaxH3Transformer3DModel.from_pretrained`. Runs in one process without a process
group. Tensors are read from the DCP checkpoint one output shard at a time, so host memory holds one
shard (plus DCP's read buffers), never the whole model. With `--dtype bfloat16` the
`_keep_in_fp32_modules` islands stay float32, as in the released checkpoints.

The folder is written under a temporary sibling name (`.<name>.tmp-<id>`, marked as this process's)
and renamed into place only once complete, so `--out` never holds a mix of two exports and a failed
export leaves nothing behind; one killed midway leaves its sibling, which the next export of the same
`--out` removes once its writer's process is gone. A non-empty `--out` is refused unless `overwrite`,
which replaces the folder whole: the old one is removed only after the new one is complete and in
place. LoRA checkpoints take the same path (`h3train/export/adapter_formats.py` writes into the
temporary folder), and so does `--ema`, which writes the EMA weights in place of the trained ones.

`h3train export` also takes a run folder (its `logging.dir`): `checkpoint_to_export` picks the newest
complete checkpoint of the run's checkpoint folder (`<run>/checkpoints`, or the `checkpoint.dir` its
`config.yaml` names). `export_checkpoint` returns an `ExportSummary` of what it wrote.

The export is of the partition the run trained (`export/adapter.trained_partition`: its
`model.subfolder`, else its `task.name`'s in the task table, `transformer` for t2va / fl2va and
`transformer_ref` for ref2va): a transformer folder goes in the pipeline's folder of that name, a
diffusers LoRA file holds its keys under that name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from diffusers import MiniMaxH3Transformer3DModel
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint import (
    METADATA_FILE,
    MODEL_PREFIX,
    STATE_FILE,
    STEP_DIR,
    NamingReader,
    checkpoint_root,
    complete_checkpoints,
    file_digest_problem,
    is_complete,
    read_failure_reason,
    read_trainer_state,
    validate_checkpoint,
)
from ..checkpoint.run_config import CONFIG_FILE
from ..errors import CheckpointError, ConfigError, UsageError
from ..infra.atomic import apply_file_mode, atomic_save_file, atomic_write_text
from ..infra.diskspace import human_bytes
from ..infra.objects import Folder, location
from ..infra.runlock import OWNER_NAME, left_behind, mark_owned
from ..model.build import meta_transformer

WEIGHTS_NAME = "diffusion_pytorch_model"
# DCP key prefix of the EMA of the transformer's weights (`ema.py`): `ema.<fqn>` beside `model.<fqn>`.
EMA_PREFIX = "ema.transformer."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}


# Entries of a folder named in a message before the rest are counted.
_LISTED = 6


@dataclass(frozen=True)
class ExportSummary:
    """What one export wrote: the lines `h3train export` prints after it."""

    checkpoint: Path
    out: Path
    # The LoRA file, or the folder of a transformer export.
    path: Path
    # e.g. `diffusers LoRA file`, `diffusers transformer folder`.
    kind: str
    # `transformer` or `transformer_ref`: the pipeline's folder the weights belong to.
    partition: str
    tensors: int
    # Every file of `out`, config and index included.
    bytes: int
    # (rank, alpha) of a LoRA checkpoint's adapters; None for a full fine-tune.
    lora: tuple[int, float] | None

    def lines(self) -> list[str]:
        p = self.partition
        out = [
            f"exported {self.checkpoint} to {self.out} (partition '{p}': the pipeline's {p}/ folder)",
            f"  format:  {self.kind}",
            f"  tensors: {self.tensors}",
        ]
        if self.lora is not None:
            out.append(f"  lora:    rank {self.lora[0]}, alpha {self.lora[1]:g}")
        out.append(f"  bytes:   {self.bytes} ({human_bytes(self.bytes)})")
        out.append(f"  path:    {self.path}")
        return out


def _listing(folder: Folder) -> str:
    """The entries of `folder` for a message: `a, b/, c and 4 more`, folders with a slash; `nothing`."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    except OSError as exc:
        return f"nothing readable ({exc.strerror or type(exc).__name__})"
    if not names:
        return "nothing"
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def run_checkpoint_dir(run: Folder) -> Folder:
    """The checkpoint folder of run folder `run`: its `config.yaml`'s `checkpoint.dir`, else `run/checkpoints`.

    A `checkpoint.dir` that is relative is taken as the run took it, from the working directory.
    """
    try:
        saved = yaml.safe_load((run / CONFIG_FILE).read_text(encoding="utf-8")) or {}
        named = (saved.get("checkpoint") or {}).get("dir")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        # No readable record of another folder: the default one, which the message names if empty.
        named = None
    return checkpoint_root(named if isinstance(named, str) else None, run)


def checkpoint_to_export(path: Folder | str) -> tuple[Folder, str | None]:
    """The checkpoint `h3train export PATH` reads, and how it was chosen (None: PATH is that checkpoint).

    PATH is a checkpoint folder (also one that is not complete: `export_checkpoint` says what it
    lacks), a checkpoint folder's parent (`checkpoint.dir`), or a run folder (`logging.dir`), whose
    newest complete checkpoint, in commit order, is taken. A folder without one is a one-line
    `CheckpointError` naming the folder and what it holds. PATH may be a URL on object storage.
    """
    path = location(path)
    if STEP_DIR.match(path.name) or (path / STATE_FILE).exists() or (path / METADATA_FILE).exists():
        return path, None
    if not path.exists():
        raise UsageError(f"'{path}' does not exist; pass a run folder (logging.dir) or a checkpoint folder")
    if not path.is_dir():
        raise UsageError(f"'{path}' is a file; pass a run folder (logging.dir) or a checkpoint folder")
    root, found = path, complete_checkpoints(path)
    if not found:
        root = run_checkpoint_dir(path)
        found = complete_checkpoints(root)
    if found:
        return found[-1], f"the newest complete checkpoint in {root}"
    held = f"'{path}' holds {_listing(path)}"
    if root != path:
        held += f"; '{root}' holds {_listing(root)}" if root.is_dir() else f"; there is no '{root}'"
    raise CheckpointError(
        f"no complete checkpoint in run folder '{path}' ({held}); a run saves one every checkpoint.every steps "
        "and at its last step (checkpoint.every=0: only when stopped by a signal)"
    )


def keeps_fp32(name: str) -> bool:
    return any(island in name for island in MiniMaxH3Transformer3DModel._keep_in_fp32_modules)


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    return shards


def _remove_left_behind(out: Path) -> None:
    """Remove the temporary siblings of `out` (`.<name>.tmp-*`) that earlier exports killed midway left:
    only folders with an h3train writer's marker whose process has stopped (`runlock.left_behind`)."""
    for sibling in out.parent.glob(f".{out.name}.tmp-*"):
        if sibling.is_dir() and left_behind(sibling):
            shutil.rmtree(sibling, ignore_errors=True)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out '{out}' is a file; give the path of a folder to write")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"--out '{out}' is not empty; pass --overwrite to replace it whole, or choose another folder")


def export_checkpoint(
    checkpoint: Folder | str,
    out: Path,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    fmt: str | None = None,
    merge: bool = False,
    ema: bool = False,
    base: Path | None = None,
    name: str | None = None,
) -> ExportSummary:
    """Export `checkpoint` into the folder `out` (see the module docstring); returns what it wrote.

    A full checkpoint becomes a diffusers transformer folder. A LoRA checkpoint becomes a LoRA file
    in `fmt` (`diffusers`, the default, or `comfyui`) named `name` (default: the format's own file
    name), or with `merge` a transformer folder with the adapters folded in
    (`h3train/export/adapter_formats.py`; `base` points at a moved pretrained base).
    `ema`: the EMA weights (component `ema`, same FQNs as `model`) in place of the trained ones.
    """
    from .adapter_formats import FORMATS, is_lora_checkpoint, trained_partition

    checkpoint, out = location(checkpoint), Path(out)
    if not is_complete(checkpoint):
        raise CheckpointError(f"checkpoint '{checkpoint}' is not a complete h3train checkpoint folder")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: choose {' or '.join(FORMATS)}")
    if fmt is not None and merge:
        raise UsageError("--merge writes a full transformer folder, not a LoRA file; drop --format or --merge")
    if name is not None and merge:
        raise UsageError("--name names a LoRA file; --merge writes a transformer folder, whose file names are fixed")
    _check_out(out, overwrite)
    if isinstance(checkpoint, Path) and checkpoint.resolve().is_relative_to(out.resolve()):
        raise UsageError(f"--out '{out}' holds the checkpoint being exported; choose a folder outside it")
    problem = validate_checkpoint(checkpoint) or file_digest_problem(checkpoint)
    if problem is not None:
        raise CheckpointError(f"checkpoint '{checkpoint}' cannot be exported: {problem}")
    state = read_trainer_state(checkpoint)
    lora = is_lora_checkpoint(state)
    if not lora and (fmt is not None or merge or base is not None or name is not None):
        raise UsageError(
            f"checkpoint '{checkpoint}' is a full fine-tune: --format, --merge, --base and --name are for LoRA "
            "checkpoints; it exports as a diffusers transformer folder without them"
        )
    if ema and not any(k.startswith(EMA_PREFIX) for k in NamingReader(checkpoint).read_metadata().state_dict_metadata):
        raise UsageError(
            f"checkpoint '{checkpoint}' holds no EMA (its run had train.ema.decay=0); export it without --ema"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_left_behind(out)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        mark_owned(tmp, tmp.name)
        file = None
        if lora:
            file = _write_lora_export(checkpoint, tmp, fmt or "diffusers", merge, ema, DTYPES[dtype], base, name)
        else:
            _write_export(checkpoint, tmp, DTYPES[dtype], max_shard_bytes, ema)
        (tmp / OWNER_NAME).unlink()
        files = [f for f in tmp.iterdir() if f.is_file()]
        for f in files:
            apply_file_mode(f)
        tensors = sum(_tensor_count(f) for f in files if f.suffix == ".safetensors")
        size = sum(f.stat().st_size for f in files)
        _replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    adapter = state["lora"] if lora else None
    return ExportSummary(
        checkpoint=checkpoint,
        out=out,
        path=out / file if file is not None else out,
        kind=_kind(lora, fmt or "diffusers", merge, ema),
        partition=trained_partition(state),
        tensors=tensors,
        bytes=size,
        lora=(int(adapter["r"]), float(adapter["lora_alpha"])) if adapter is not None else None,
    )


def _kind(lora: bool, fmt: str, merge: bool, ema: bool) -> str:
    """The format line of an export: what it is and, with `ema`, whose weights."""
    if not lora:
        kind = "diffusers transformer folder"
    elif merge:
        kind = "diffusers transformer folder, the LoRA merged into its base"
    else:
        from .adapter_formats import FORMATS

        kind = FORMATS[fmt]
    return kind + (" (EMA weights)" if ema else "")


def _tensor_count(file: Path) -> int:
    # The header alone: no tensor is read.
    with safe_open(file, "pt") as f:
        return len(list(f.keys()))


def _write_lora_export(
    checkpoint: Path,
    out: Path,
    fmt: str,
    merge: bool,
    ema: bool,
    dtype: torch.dtype,
    base: Path | None,
    name: str | None,
) -> str | None:
    """Write a LoRA checkpoint's export into `out`; the LoRA file's name, or None for a merged folder."""
    from .adapter_formats import read_trained, write_lora_export

    reader = NamingReader(checkpoint)
    metadata = reader.read_metadata().state_dict_metadata
    trained = read_trained(checkpoint, reader, metadata, "ema" if ema else "model")
    return write_lora_export(checkpoint, out, read_trainer_state(checkpoint), trained, fmt, merge, dtype, base, name)


def _replace_folder(new: Path, out: Path) -> None:
    """Put the complete folder `new` at `out`; an existing `out` is removed only once `new` is there."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old)


def _write_export(checkpoint: Path, out: Path, target: torch.dtype, max_shard_bytes: int, ema: bool = False) -> None:
    state = read_trainer_state(checkpoint)
    reader = NamingReader(checkpoint)
    metadata = reader.read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith(MODEL_PREFIX)]
    # `--ema`: each weight's EMA where it has one (every trained parameter), read under its `ema.` key.
    source = {k: EMA_PREFIX + k.removeprefix(MODEL_PREFIX) for k in keys} if ema else {}
    source = {k: v if v in metadata else k for k, v in source.items()}

    def out_dtype(key: str) -> torch.dtype:
        return torch.float32 if keeps_fp32(key) else target

    sizes = {k: metadata[k].size.numel() * out_dtype(k).itemsize for k in keys}
    shards = _shard_plan(sizes, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, group in enumerate(shards, start=1):
        name = (
            f"{WEIGHTS_NAME}-{i:05d}-of-{len(shards):05d}.safetensors"
            if len(shards) > 1
            else f"{WEIGHTS_NAME}.safetensors"
        )
        read = {source.get(k, k): k for k in group}
        buffers = {r: torch.empty(metadata[r].size, dtype=metadata[r].properties.dtype) for r in read}
        try:
            dcp.load(buffers, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any read failure: unreadable
            raise CheckpointError(f"checkpoint '{checkpoint}' cannot be read: {read_failure_reason(exc)}") from exc
        tensors = {
            read[r].removeprefix(MODEL_PREFIX): v.to(out_dtype(read[r])).contiguous() for r, v in buffers.items()
        }
        atomic_save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(sizes[k] for k in group)
        del buffers, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out / f"{WEIGHTS_NAME}.safetensors.index.json", json.dumps(index, indent=2))
    meta_transformer(state["model_config"]).save_config(out)
    apply_file_mode(out / "config.json")
