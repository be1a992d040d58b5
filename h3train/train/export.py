"""Export a training checkpoint as a diffusers transformer folder.

`config.json` plus sharded safetensors with an index (`diffusion_pytorch_model-0000k-of-0000n`),
loadable by `MiniMaxH3Transformer3DModel.from_pretrained`. Runs in one process without a process
group. Tensors are read from the DCP checkpoint one output shard at a time, so host memory holds one
shard (plus DCP's read buffers), never the whole model. With `--dtype bfloat16` the
`_keep_in_fp32_modules` islands stay float32, as in the released checkpoints.

The folder is written under a temporary sibling name (`.<name>.tmp-<id>`) and renamed into place only
once complete, so `--out` never holds a mix of two exports and a failed export leaves nothing
behind. A non-empty `--out` is refused unless `overwrite`, which replaces the folder whole: the old
one is removed only after the new one is complete and in place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from diffusers import MiniMaxH3Transformer3DModel
from torch.distributed.checkpoint.api import CheckpointException

from ..atomic import apply_file_mode, atomic_save_file, atomic_write_text
from ..errors import CheckpointError, ConfigError, UsageError
from .checkpoint import (
    MODEL_PREFIX,
    NamingReader,
    is_complete,
    read_failure_reason,
    read_trainer_state,
    validate_checkpoint,
)

WEIGHTS_NAME = "diffusion_pytorch_model"
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
) -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    if not is_complete(checkpoint):
        raise CheckpointError(f"checkpoint '{checkpoint}' is not a complete h3train checkpoint folder")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    _check_out(out, overwrite)
    if checkpoint.resolve().is_relative_to(out.resolve()):
        raise UsageError(f"--out '{out}' holds the checkpoint being exported; choose a folder outside it")
    problem = validate_checkpoint(checkpoint)
    if problem is not None:
        raise CheckpointError(f"checkpoint '{checkpoint}' cannot be exported: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _write_export(checkpoint, tmp, DTYPES[dtype], max_shard_bytes)
        _replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_folder(new: Path, out: Path) -> None:
    """Put the complete folder `new` at `out`; an existing `out` is removed only once `new` is there."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old)


def _write_export(checkpoint: Path, out: Path, target: torch.dtype, max_shard_bytes: int) -> None:
    state = read_trainer_state(checkpoint)
    reader = NamingReader(checkpoint)
    metadata = reader.read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith(MODEL_PREFIX)]

    def out_dtype(key: str) -> torch.dtype:
        return torch.float32 if keeps_fp32(key) else target

    sizes = {k: metadata[k].size.numel() * out_dtype(k).itemsize for k in keys}
    shards = _shard_plan(sizes, max_shard_bytes)
    out.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, group in enumerate(shards, start=1):
        name = (
            f"{WEIGHTS_NAME}-{i:05d}-of-{len(shards):05d}.safetensors"
            if len(shards) > 1
            else f"{WEIGHTS_NAME}.safetensors"
        )
        buffers = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in group}
        try:
            dcp.load(buffers, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any read failure: unreadable
            raise CheckpointError(f"checkpoint '{checkpoint}' cannot be read: {read_failure_reason(exc)}") from exc
        tensors = {k.removeprefix(MODEL_PREFIX): v.to(out_dtype(k)).contiguous() for k, v in buffers.items()}
        atomic_save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(sizes[k] for k in group)
        del buffers, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out / f"{WEIGHTS_NAME}.safetensors.index.json", json.dumps(index, indent=2))
    with torch.device("meta"):
        MiniMaxH3Transformer3DModel(**state["model_config"]).save_config(out)
    apply_file_mode(out / "config.json")
