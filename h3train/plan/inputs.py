"""What the plan reads from a loaded config and its data: the longest sample's rows, the checkpointed
blocks, the adapter's counts, then `estimate` (the arithmetic on them) and a checkpoint's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import Config, dataset_specs
from ..data.location import INDEX_NAME
from ..data.step_composition import StepComposer
from ..data.storage import has_index, is_dataset_dir
from ..model.adapter import AdapterCounts
from ..tasks.released import LONGEST_GEOMETRY, LONGEST_ROWS, TEXT_ROWS
from .activations import _FP32, evaluation_activation_bytes, fused_norm_for
from .arithmetic import (
    DEFAULT_DEVICE_MEMORY_GIB,
    GIB,
    EvaluationPlan,
    MemoryPlan,
    MeshSizes,
    fit_kwargs,
    longest_fit_rows,
    lora_fit_lines,
    parameter_counts,
    plan_memory,
    trainable_state_bytes,
)
from .printout import _gib


def config_rows(cfg: Config) -> tuple[int, str]:
    """Rows of the longest packed sample `cfg` trains on, and where that number comes from.

    Synthetic data: its one geometry, built with the layout builders. Cached data: the longest
    entry of the dataset's `index.jsonl` when `data.path` exists here (of those `data.max_rows` keeps);
    planning away from the data (a laptop, a login node) takes `data.max_rows` when set, else the
    longest released clip, `released_rows`.
    """
    rows, _, source = config_sample_rows(cfg)
    return rows, source


def prompt_only_task(task_name: str) -> bool:
    """Whether `task.name=task_name` trains only prompt-only clips (t2va): no keyframe rows."""
    from ..tasks.table import TRAINING_TASKS, sample_task_of

    return TRAINING_TASKS[task_name].sample_tasks == (sample_task_of(None),)


def released_rows(task_name: str) -> int:
    """Packed rows of the longest released clip as `task.name=task_name` trains it: with first and last
    keyframes (`LONGEST_ROWS`) unless the task trains only prompt-only clips (t2va), which have no
    keyframe rows. Its `TEXT_ROWS` text prefix either way (an upper bound for a prompt alone)."""
    import torch

    from ..tasks.layout import Geometry
    from ..tasks.sample import build_layout
    from ..tasks.table import sample_task_of

    if not prompt_only_task(task_name):
        return LONGEST_ROWS
    tags = torch.ones(TEXT_ROWS, dtype=torch.long)
    return build_layout(sample_task_of(None), tags, Geometry(*LONGEST_GEOMETRY)).seq_len


def released_clip(task_name: str) -> str:
    """The longest released clip as `task_name` packs it, in words (`released_rows`)."""
    if prompt_only_task(task_name):
        return f"longest released {task_name} clip: 15 s at 768x1344, no keyframes"
    if task_name == "fl2va":
        return "longest released fl2va clip: 15 s at 768x1344, first and last keyframes"
    return f"longest released clip: 15 s at 768x1344, two keyframes' rows standing in for {task_name}'s conditioning"


def clip_name(task_name: str) -> str:
    """The clip the plan's seconds are of: T2VA for a prompt-only task, else FL2VA (`rows_to_seconds`)."""
    return "T2VA" if prompt_only_task(task_name) else "FL2VA"


def config_sample_rows(cfg: Config) -> tuple[int, int, str]:
    """`config_rows`, with the text rows of that sample between: the rows the text refiner runs over.

    The data source's longest sample (`DataSource.longest`); away from the data, the longest released
    clip in the task's layout (`released_rows`) and its `TEXT_ROWS`. With `data.pack`, a
    micro-batch is a pack of up to that many rows: the budget, or a longer sample trained alone.
    """
    rows, text_rows, where = _longest_sample_rows(cfg)
    budget = cfg.data.pack
    if budget and (rows <= budget or cfg.data.pack_oversize == "refuse"):
        # A pack holds up to `budget` rows of samples, their prompts together in proportion.
        text = min(budget, -(-text_rows * budget // rows))
        longest = where if where.startswith("longest ") else f"longest sample: {where}"
        return budget, text, f"data.pack={budget} rows per micro-batch; {longest}"
    return rows, text_rows, where


def _longest_sample_rows(cfg: Config) -> tuple[int, int, str]:
    from ..data.source import data_source

    found = data_source(cfg).longest(cfg)
    if found is None:
        bound = cfg.data.max_rows
        if bound:
            return bound, min(TEXT_ROWS, bound), "data.max_rows; data.path is not readable here"
        rows = released_rows(cfg.task.name)
        return rows, TEXT_ROWS, f"{released_clip(cfg.task.name)}; data.path is not readable here"
    rows, text_rows, where = found
    return rows, min(TEXT_ROWS, rows) if text_rows is None else text_rows, where


def estimate(
    dims: Mapping[str, Any],
    mesh: MeshSizes,
    cfg: Config,
    rows: int | None = None,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    text_rows: int | None = None,
    ranks_per_node: int = 0,
    device: str = "cuda",
    fused_norm: bool | None = None,
) -> MemoryPlan:
    """`plan_memory` for a loaded config on a resolved mesh; `rows` defaults to `config_rows(cfg)`,
    `text_rows` to the text rows of the config's longest sample (`config_sample_rows`), at most `rows`.

    Also planned: the validation and rendering forwards between steps (`evaluation`), the host copy
    `checkpoint.async_save` stages each save in (`staging_bytes`) and, with `ranks_per_node` (at most
    the world size), the host memory of a node. `device`: where the run trains, whose kernels the plan
    models (`fused_norm_for`); `model.activation_checkpointing: auto` chooses its blocks' policies for
    `device_memory_gib` (`choose_policies`). `fused_norm` overrides the norm kernel `device` implies.
    """
    rows_origin = "given"
    if rows is None:
        rows, found_text, rows_origin = config_sample_rows(cfg)
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
        rows_origin=rows_origin,
        lora=lora,
        cpu_offload=cfg.parallel.cpu_offload,
        ema=cfg.train.ema.decay > 0,
        text_rows=text_rows,
        optimizer=cfg.optim.name,
        base_quant=cfg.lora.base_quant,
        grad_accum=cfg.train.grad_accum,
        fused_norm=fused_norm_for(device) if fused_norm is None else fused_norm,
        adaln_tables=cfg.parallel.adaln_tables,
    )
    ckpt = checkpoint_bytes(dims, cfg, lora)
    plan = replace(
        plan,
        checkpoint_bytes=ckpt,
        staging_bytes=-(-ckpt // plan.shard_size) if cfg.checkpoint.async_save else 0,
        ranks_per_node=min(ranks_per_node, plan.world_size),
        grad_accum=cfg.train.grad_accum,
    )
    if lora is not None:
        plan = replace(plan, fit_lines=lora_fit_lines(dims, plan, clip_name(cfg.task.name)))
    from ..config import measures_held_out_loss

    if cfg.validation.retention and measures_held_out_loss(cfg.validation):
        plan = replace(plan, retention_line=base_predictions_line(cfg))
    plan = replace(
        plan,
        evaluation=evaluation_plan(dims, plan, cfg),
        packed=cfg.data.pack > 0,
        longest_sample_rows=_longest_sample_rows(cfg)[0],
    )
    if not plan.fits:
        mesh_kw = {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "sp": plan.sp}
        plan = replace(plan, longest_fit=longest_fit_rows(dims, **mesh_kw, **fit_kwargs(plan)))
    if not cfg.validation.samples:
        return plan
    return replace(plan, render_line=render_components_line(cfg), render_host_bytes=_vae_bytes(cfg))


def _vae_bytes(cfg: Config) -> int:
    """Bytes of the two VAEs that render `validation.samples` (float32), 0 when their folder is not readable here."""
    from ..render.footprint import component_bytes
    from ..render.requests import text_encoder_dtype

    found = component_bytes(cfg.validation.components, text_encoder_dtype(cfg).itemsize)
    return 0 if found is None else found["vae"] + found["audio_vae"]


def request_rows(cfg: Config) -> int:
    """Packed rows of the longest request of `validation.samples`: its clip in the prompt-only layout with a
    `TEXT_ROWS` text prefix, plus one latent frame's rows per keyframe or reference (a video
    reference's further frames are not counted). 0 when there is none."""
    import torch
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    from ..render.requests import parse_requests
    from ..tasks.layout import Geometry
    from ..tasks.sample import build_layout
    from ..tasks.table import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK, sample_task_of

    tags = torch.ones(TEXT_ROWS, dtype=torch.long)
    longest = 0
    for request in parse_requests(cfg):
        frames = video_latent_num_frames(request.num_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
        # The video VAE's 16x spatial factor: the latent canvas.
        audio = audio_latent_num_frames(request.num_frames)
        geometry = Geometry(frames, request.height // 16, request.width // 16, audio)
        rows = build_layout(sample_task_of(None), tags, geometry).seq_len
        extra = len(request.keyframes) + len(request.references)
        longest = max(longest, rows + extra * geometry.video_rows() // geometry.num_latent_frames)
    return longest


def evaluation_plan(dims: Mapping[str, Any], plan: MemoryPlan, cfg: Config) -> EvaluationPlan | None:
    """The forwards between steps (`EvaluationPlan`): over the longest held-out sample (its index, or the
    training rows where `validation.dataset` is not readable here) and the longest rendered request, with
    the VAEs on the device while a clip decodes. None when the run neither validates nor renders."""
    from ..config import measures_held_out_loss

    v = cfg.validation
    held_out, rendered = measures_held_out_loss(v), bool(v.samples)
    if not (held_out or rendered):
        return None
    rows = plan.rows
    if held_out and (Path(v.dataset) / INDEX_NAME).is_file():
        from ..data.dataset import CachedDataset

        rows = max(rows, max(CachedDataset(v.dataset, cfg.task.name).lengths))
    if rendered:
        rows = max(rows, request_rows(cfg))
    local = -(-rows // plan.sp)
    what = " and ".join(name for name, on in (("held-out loss", held_out), ("rendering", rendered)) if on)
    return EvaluationPlan(
        rows=rows,
        local_rows=local,
        activation_bytes=evaluation_activation_bytes(dims, local, plan.dtype, plan.sp, plan.text_rows),
        components_bytes=_vae_bytes(cfg) if rendered else 0,
        what=what,
    )


def base_predictions_line(cfg: Config) -> str:
    """The plan's line for `<logging.dir>/base_predictions/`: bytes per held-out pair and in all, from
    the held-out samples' headers, beside a released clip's for scale."""
    from ..data.base_predictions import FOLDER, RELEASED_PAIR_BYTES, pair_bytes
    from ..data.dataset import CachedDataset
    from ..data.sample_file import read_header

    v = cfg.validation
    if not (Path(v.dataset) / INDEX_NAME).is_file():
        where = Path(cfg.logging.dir) / FOLDER
        return f"base preds    held-out samples' predictions in {where}; '{v.dataset}' is not readable here"
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
    from ..lora.transforms import model_transforms
    from ..model.adapter import ModelAdapter

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
    """The plan's line for the VAEs and text encoder of `validation.samples` (`h3train/render/footprint.py`)."""
    from ..render.footprint import component_bytes
    from ..render.requests import text_encoder_dtype

    found = component_bytes(cfg.validation.components, text_encoder_dtype(cfg).itemsize)
    if found is None:
        return f"  validation.samples (host)     components in '{cfg.validation.components}' not readable here"
    parts = ", ".join(f"{name} {_gib(n).strip()}" for name, n in found.items())
    return (
        f"  validation.samples (host)     {_gib(found['vae'] + found['audio_vae'])}  per rank on the CPU "
        f"({parts}; text_encoder on rank 0 only while encoding the requests, VAEs on the device only to decode)"
    )


def dropped_line(cfg: Config) -> str | None:
    """The summary of the cached samples `data.max_rows` drops, None when it drops none or the data is not here."""
    from ..data.source import data_source

    bound = cfg.data.max_rows
    if not bound or not data_source(cfg).reads_folders:
        return None
    from ..config import dataset_specs

    specs = dataset_specs(cfg.data)
    if not specs or not all(has_index(spec.path) for spec in specs):
        return None
    source = data_source(cfg).build(cfg, None, None)
    dropped = [pair for dataset in getattr(source, "datasets", [source]) for pair in dataset.dropped]
    if not dropped:
        return None
    longest = max(dropped, key=lambda pair: pair[1])
    return (
        f"data.max_rows={bound:,} drops {len(dropped):,} samples that pack to more rows "
        f"(the longest '{longest[0]}', {longest[1]:,} rows)"
    )


def refuse_over_plan(plan: MemoryPlan, device_type: str, ignored: bool) -> None:
    """Raise `ConfigError` when a run on `device_type` would not fit its plan: only on a GPU (`cuda`), whose
    memory the plan is of, and unless `train.ignore_memory_plan` (`ignored`). The message names the fix.
    `h3train check` plans for a GPU wherever it runs, so it passes `cuda`."""
    if plan.fits or device_type != "cuda" or ignored:
        return
    from ..errors import ConfigError
    from .printout import fixes

    fix = fixes(plan)
    raise ConfigError(
        f"the memory plan needs {plan.peak_bytes / GIB:.2f} GiB per rank of the device's "
        f"{plan.device_gib} GiB for {plan.rows:,} rows ({plan.rows_origin}): {fix}; "
        "or set train.ignore_memory_plan=true to start anyway"
    )


def samples_lines(
    cfg: Config, composer: StepComposer, dims: Mapping[str, Any], source: Any = None, steps: int = 100
) -> list[str]:
    """What the run's steps train, composed by the start's `composer` (its blueprint's) over the data as
    indexed: `h3train check`'s and the start's lines.

    `samples`: samples per step (the mean and range over the first `steps` steps of the sampler's order
    for a packed run) and steps per epoch. `balance` (two or more DP ranks): the mean per-step imbalance of
    the config as set (`data/step_composition.py`: the costliest rank's compute over the ranks' mean, less 1),
    and, when the run does not pack and balance, what `data.pack` + `data.balance` would give. `source` is
    the run's (built here from `cfg` when None); no lines for a source whose data is not here.
    """
    import numpy as np

    from ..data.source import build_sampler, build_source, data_source
    from ..data.step_composition import outlook

    dp = composer.dp
    if source is None:
        if data_source(cfg).reads_folders and not all(is_dataset_dir(s.path) for s in dataset_specs(cfg.data)):
            return []
        source = build_source(cfg, int(dims["text_dim"]))
    lengths = np.asarray(source.lengths)
    sampler = build_sampler(source, cfg, 0, dp)
    rows_at = lambda p: int(lengths[sampler.global_index(p)])  # noqa: E731
    accum, budget = cfg.train.grad_accum, cfg.data.pack
    seen = outlook(composer, rows_at, sampler.global_index, sampler.epoch_length, steps)
    # Past the planned steps the count is the epoch over the mean samples per step: still a count of steps.
    steps_per_epoch = round(seen.steps_per_epoch)
    per_epoch = f"{steps_per_epoch:,}" if seen.exact else f"about {steps_per_epoch:,}"
    plural = "" if seen.exact and steps_per_epoch == 1 else "s"
    epoch = f"{per_epoch} step{plural} per epoch of {seen.epoch_length:,} samples"
    if not budget:
        lines = [f"samples       {dp * accum} per step (dp {dp} x train.grad_accum {accum}), {epoch}"]
    else:
        if seen.samples_min == seen.samples_max:
            count = f"{seen.samples_min:,} per step"
        else:
            count = (
                f"{seen.samples_mean:,.1f} per step on average ({seen.samples_min:,} to {seen.samples_max:,} "
                f"over the first {seen.steps} steps)"
            )
        goal = f"train.global_batch={cfg.train.global_batch}" if cfg.train.global_batch else "train.global_batch unset"
        lines = [
            f"samples       {count} ({goal}), "
            f"{epoch}; dp {dp} x train.grad_accum {accum} packs of up to {budget:,} rows, "
            f"{100 * (seen.fill or 0.0):.0f} % filled; a step holds each sample at most once"
        ]
    if dp > 1:
        line = (
            f"balance       imbalance {100 * seen.imbalance:.1f} % as configured (data.pack={budget}, "
            f"data.balance={str(cfg.data.balance).lower()}; mean over {seen.steps} steps; docs/training.md)"
        )
        if not (budget and cfg.data.balance):
            advice_budget = budget or int(np.max(lengths))
            advised = replace(
                composer, budget=advice_budget, balance=True, global_batch=composer.global_batch if budget else 0
            )
            other = outlook(advised, rows_at, sampler.global_index, sampler.epoch_length, steps)
            line += f"; data.pack={advice_budget} + data.balance=true would give {100 * other.imbalance:.1f} %"
        lines.append(line)
    return lines
