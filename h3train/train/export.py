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
place. LoRA checkpoints take the same path (`h3train/lora/checkpoint_export.py` writes into the
temporary folder), and so does `--ema`, which writes the EMA weights in place of the trained ones.

The export is of the partition the run trained (`lora.checkpoint_export.trained_partition`: its
`model.subfolder`, else its `task.name`'s in the task table, `transformer` for t2va / fl2va and
`transformer_ref` for ref2va): a transformer folder goes in the pipeline's folder of that name, a
diffusers LoRA file holds its keys under that name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from diffusers import MiniMaxH3Transformer3DModel
from torch.distributed.checkpoint.api import CheckpointException

from ..atomic import apply_file_mode, atomic_save_file, atomic_write_text
from ..errors import CheckpointError, ConfigError, UsageError
from ..model.build import meta_transformer
from ..runlock import OWNER_NAME, left_behind, mark_owned
from .checkpoint import (
    MODEL_PREFIX,
    NamingReader,
    file_digest_problem,
    is_complete,
    read_failure_reason,
    read_trainer_state,
    validate_checkpoint,
)

# One process reads the checkpoint on purpose (no_dist=True); DCP warns about it on every read.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

WEIGHTS_NAME = "diffusion_pytorch_model"
# DCP key prefix of the EMA of the transformer's weights (`ema.py`): `ema.<fqn>` beside `model.<fqn>`.
EMA_PREFIX = "ema.transformer."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}


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
    checkpoint: Path,
    out: Path,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    fmt: str | None = None,
    merge: bool = False,
    ema: bool = False,
    base: Path | None = None,
) -> Path:
    """Export `checkpoint` into the folder `out` (see the module docstring); returns `out`.

    A full checkpoint becomes a diffusers transformer folder. A LoRA checkpoint becomes a LoRA file
    in `fmt` (`diffusers`, the default, or `comfyui`), or with `merge` a transformer folder with the
    adapters folded in (`h3train/lora/checkpoint_export.py`; `base` points at a moved pretrained base).
    `ema`: the EMA weights (component `ema`, same FQNs as `model`) in place of the trained ones.
    """
    from ..lora.checkpoint_export import FORMATS, is_lora_checkpoint

    checkpoint, out = Path(checkpoint), Path(out)
    if not is_complete(checkpoint):
        raise CheckpointError(f"checkpoint '{checkpoint}' is not a complete h3train checkpoint folder")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: choose {' or '.join(FORMATS)}")
    if fmt is not None and merge:
        raise UsageError("--merge writes a full transformer folder, not a LoRA file; drop --format or --merge")
    _check_out(out, overwrite)
    if checkpoint.resolve().is_relative_to(out.resolve()):
        raise UsageError(f"--out '{out}' holds the checkpoint being exported; choose a folder outside it")
    problem = validate_checkpoint(checkpoint) or file_digest_problem(checkpoint)
    if problem is not None:
        raise CheckpointError(f"checkpoint '{checkpoint}' cannot be exported: {problem}")
    lora = is_lora_checkpoint(read_trainer_state(checkpoint))
    if not lora and (fmt is not None or merge or base is not None):
        raise UsageError(
            f"checkpoint '{checkpoint}' is a full fine-tune: --format, --merge and --base are for LoRA checkpoints; "
            "it exports as a diffusers transformer folder without them"
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
        if lora:
            _write_lora_export(checkpoint, tmp, fmt or "diffusers", merge, ema, DTYPES[dtype], base)
        else:
            _write_export(checkpoint, tmp, DTYPES[dtype], max_shard_bytes, ema)
        (tmp / OWNER_NAME).unlink()
        for file in tmp.iterdir():
            apply_file_mode(file)
        _replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_lora_export(
    checkpoint: Path, out: Path, fmt: str, merge: bool, ema: bool, dtype: torch.dtype, base: Path | None
) -> None:
    from ..lora.checkpoint_export import read_trained, write_lora_export

    reader = NamingReader(checkpoint)
    metadata = reader.read_metadata().state_dict_metadata
    trained = read_trained(checkpoint, reader, metadata, "ema" if ema else "model")
    write_lora_export(checkpoint, out, read_trainer_state(checkpoint), trained, fmt, merge, dtype, base)


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
