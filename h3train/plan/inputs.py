"""What the plan reads from a loaded config and its data: the longest sample's rows, the checkpointed
blocks, the adapter's counts, then `estimate` (the arithmetic on them) and a checkpoint's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import Config
from ..model.adapter import AdapterCounts
from .arithmetic import (
    _FP32,
    DEFAULT_DEVICE_MEMORY_GIB,
    RELEASED_MAX_ROWS,
    RELEASED_TEXT_ROWS,
    MemoryPlan,
    MeshSizes,
    _dim,
    lora_fit_lines,
    parameter_counts,
    plan_memory,
    trainable_state_bytes,
)
from .report import _gib


def config_rows(cfg: Config) -> tuple[int, str]:
    """Rows of the longest packed sample `cfg` trains on, and where that number comes from.

    Synthetic data: its one geometry, built with the layout builders. Cached data: the longest
    entry of the dataset's `index.jsonl` when `data.path` exists here; planning away from the data
    (a laptop, a login node) falls back to the longest released clip, `released_rows`.
    """
    rows, _, source = config_sample_rows(cfg)
    return rows, source


# The longest released clip in latent units: 15 s (362 frames -> 107 latent frames) at 768x1344
# (48 x 84 latents), 603 audio latents per channel; `RELEASED_MAX_ROWS` is its FL2VA layout.
RELEASED_GEOMETRY = (107, 48, 84, 603)


def released_rows(task_name: str) -> int:
    """Packed rows of the longest released clip as `task.name=task_name` trains it: with first and last
    keyframes (`RELEASED_MAX_ROWS`) unless the task trains only prompt-only clips (t2va), which have no
    keyframe rows. Its `RELEASED_TEXT_ROWS` text prefix either way (an upper bound for a prompt alone)."""
    import torch

    from ..tasks.layout import Geometry, build_layout
    from ..tasks.table import TRAINING_TASKS, sample_task_of

    prompt_only = sample_task_of(None)
    if TRAINING_TASKS[task_name].sample_tasks != (prompt_only,):
        return RELEASED_MAX_ROWS
    tags = torch.ones(RELEASED_TEXT_ROWS, dtype=torch.long)
    return build_layout(prompt_only, tags, Geometry(*RELEASED_GEOMETRY)).seq_len


def config_sample_rows(cfg: Config) -> tuple[int, int, str]:
    """`config_rows`, with the text rows of that sample between: the rows the text refiner runs over.

    The data source's longest sample (`DataSource.longest`); away from the data, the longest released
    clip in the task's layout (`released_rows`) and its `RELEASED_TEXT_ROWS`.
    """
    from ..data.source import data_source

    found = data_source(cfg).longest(cfg)
    if found is None:
        rows = released_rows(cfg.task.name)
        return rows, RELEASED_TEXT_ROWS, "longest released clip; data.path is not readable here"
    rows, text_rows, where = found
    return rows, min(RELEASED_TEXT_ROWS, rows) if text_rows is None else text_rows, where


def checkpointed_layers(cfg: Config, num_layers: int) -> int:
    """Transformer blocks `model.activation_checkpointing` recomputes (`SequenceParallelH3.checkpointed`)."""
    mode = cfg.model.activation_checkpointing
    if mode == "full":
        return num_layers
    if mode == "selective":
        return len(range(0, num_layers, cfg.model.checkpoint_every))
    return 0


def estimate(
    dims: Mapping[str, Any],
    mesh: MeshSizes,
    cfg: Config,
    rows: int | None = None,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    text_rows: int | None = None,
) -> MemoryPlan:
    """`plan_memory` for a loaded config on a resolved mesh; `rows` defaults to `config_rows(cfg)`,
    `text_rows` to the text rows of the config's longest sample (`config_sample_rows`), at most `rows`."""
    rows_source = "given"
    if rows is None:
        rows, found_text, rows_source = config_sample_rows(cfg)
        text_rows = found_text if text_rows is None else text_rows
    elif text_rows is None:
        text_rows = config_sample_rows(cfg)[1]
    lora = adapter_counts(dims, cfg)
    plan = plan_memory(
        dims,
        dp_replicate=mesh.dp_replicate,
        dp_shard=mesh.dp_shard,
        sp=mesh.sp,
        dtype=cfg.model.dtype,
        activation_checkpointing=cfg.model.activation_checkpointing,
        rows=rows,
        device_memory_gib=device_memory_gib,
        rows_source=rows_source,
        lora=lora,
        cpu_offload=cfg.parallel.cpu_offload,
        checkpointed_layers=checkpointed_layers(cfg, _dim(dims, "num_layers")),
        ema=cfg.train.ema.decay > 0,
        text_rows=text_rows,
        optimizer=cfg.optim.name,
        base_quant=cfg.lora.base_quant,
        grad_accum=cfg.train.grad_accum,
    )
    plan = replace(plan, checkpoint_bytes=checkpoint_bytes(dims, cfg, lora))
    if lora is not None:
        plan = replace(plan, fit_lines=lora_fit_lines(dims, plan))
    from ..config import measures_held_out_loss

    if cfg.validation.retention and measures_held_out_loss(cfg.validation):
        plan = replace(plan, retention_line=base_predictions_line(cfg))
    return replace(plan, render_line=render_components_line(cfg)) if cfg.validation.samples else plan


def base_predictions_line(cfg: Config) -> str:
    """The plan's line for `<logging.dir>/base_predictions/`: bytes per held-out pair and in all, from
    the held-out samples' headers, beside a released clip's for scale."""
    from ..data.dataset import CachedDataset
    from ..data.format import read_header
    from ..train.base_predictions import FOLDER, RELEASED_PAIR_BYTES, pair_bytes

    v = cfg.validation
    heldout = CachedDataset(v.dataset, cfg.task.name)
    n = len(heldout) if not v.num_samples else min(v.num_samples, len(heldout))
    per_sample = [pair_bytes(read_header(heldout.path(i)).geometry) for i in range(n)]
    total = sum(per_sample) * len(v.sigmas)
    five, fifteen = RELEASED_PAIR_BYTES
    return (
        f"base preds    {_gib(total).strip()} in {Path(cfg.logging.dir) / FOLDER} for {n * len(v.sigmas)} held-out "
        f"pairs ({n} samples x {len(v.sigmas)} sigmas, at most {_gib(max(per_sample)).strip()} a pair; a released "
        f"5 s clip {_gib(five).strip()}, a 15 s one {_gib(fifteen).strip()})"
    )


def adapter_counts(dims: Mapping[str, Any], cfg: Config) -> AdapterCounts | None:
    """What the adapter `cfg` asks for adds (`ModelAdapter.plan_counts`: its own arithmetic); None without one."""
    from ..model.adapter import ModelAdapter
    from ..train.transforms import model_transforms

    adapter = next((t for t in model_transforms(cfg) if isinstance(t, ModelAdapter)), None)
    return adapter.plan_counts(dims) if adapter is not None else None


def checkpoint_bytes(dims: Mapping[str, Any], cfg: Config, lora: AdapterCounts | None = None) -> int:
    """Tensor bytes one checkpoint of `cfg`'s run holds on disk, all ranks together, whatever the mesh.

    What trains: the weights (a LoRA checkpoint holds no frozen base; bfloat16 under `adamw_bf16`
    but for a full fine-tune's float32 islands), AdamW's `exp_avg` and `exp_avg_sq` as `optim.name`
    keeps them (DCP writes torchao's quantized moments as codes and scales), and the EMA's float32
    shadows when `train.ema.decay > 0`. DCP's framing of each tensor and the metadata come on top
    (kilobytes per tensor: a few MB for the released model, next to hundreds of GB). `lora`: the
    adapter's counts, found from `cfg` when not given.
    """
    if lora is None:
        lora = adapter_counts(dims, cfg)
    counts = parameter_counts(dims)
    trainable = counts.total if lora is None else lora.trainable
    weights, moments = trainable_state_bytes(counts, trainable, cfg.optim.name, lora is None)
    return weights + moments + (trainable * _FP32 if cfg.train.ema.decay > 0 else 0)


def render_components_line(cfg: Config) -> str:
    """The plan's line for the VAEs and text encoder of `validation.samples` (`h3train/render/memory.py`)."""
    from ..render.memory import component_bytes
    from ..render.requests import text_encoder_dtype

    found = component_bytes(cfg.validation.components, text_encoder_dtype(cfg).itemsize)
    if found is None:
        return f"  validation.samples (host)     components in '{cfg.validation.components}' not readable here"
    parts = ", ".join(f"{name} {_gib(n).strip()}" for name, n in found.items())
    return (
        f"  validation.samples (host)     {_gib(found['vae'] + found['audio_vae'])}  per rank on the CPU "
        f"({parts}; text_encoder on rank 0 only while encoding the requests, VAEs on the device only to decode)"
    )
