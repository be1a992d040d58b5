"""The composition root: a `Config` becomes the parts a `Trainer` wires together.

Every choice a config makes about *which* part to use is taken here and nowhere else: the model and
its transforms (adapters; `transforms.py` names them, so that the memory plan can ask as well),
the optimizer and schedule, the sample source and its micro-batch stream, the step hooks (the
debug ones too: fault injection, the step dump), the metrics logger, the checkpointer and the
resume decision. What the start decides for those parts (compile, attention backend, AdaLN tables, the
memory plan, each block's recompute) is drawn once into a `Blueprint` (`blueprint.py`), which the builders
read. `build_trainer` runs them in the order the start-up needs (checks before any process group, the
blueprint once every rank agreed on its device, the resume decision before the model is built, FSDP2
before the optimizer), hands the parts (`parts.py`) to `Trainer`, which only wires them into the loop,
and restores the chosen checkpoint into them.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import Checkpointer, checkpoint_root, room_needed
from ..config import Config, dataset_specs
from ..data.location import INDEX_NAME
from ..data.mixture import DatasetMixture
from ..data.source import MicroBatchStream, SampleSource, build_sampler, build_source, load_shared_negative
from ..debug.faults import FaultInjector
from ..infra.diskspace import check_room
from ..infra.objects import Folder, RemoteDir
from ..infra.quiet import known_notices
from ..infra.runlock import RunLock
from ..lora.names import pretrained_key
from ..lora.transforms import model_transforms
from ..model.adapter import ModelAdapter, ModelTransform
from ..model.architecture import model_dims
from ..model.build import (
    apply_transforms,
    build_meta_model,
    build_model,
    load_pretrained_shards,
    materialize,
    pretrained_folder,
)
from ..model.fsdp import apply_fsdp, shards_nothing
from ..model.quant import check_base_quant
from ..model.sp_forward import SequenceParallelH3
from ..objective import micro_batch_inputs
from ..optim.kinds import build_optimizer, build_scheduler
from ..parallel.dims import ParallelContext, ParallelDims, init_distributed
from ..parallel.ulysses import SequenceParallel
from ..plan import checkpoint_bytes, samples_lines
from ..train.adapter_files import AdapterFiles
from ..train.dump import StepDump
from ..train.events import EventLog, Progress, SpikeDetector
from ..train.fault_hook import FaultHook
from ..train.guard import ValidationWatch
from ..train.hooks import TrainerHook
from ..train.metrics import MetricsLogger
from ..train.preemption import SAME_KEYPRESS_S, Preemption
from ..train.trainer import Trainer
from .blueprint import Blueprint, draw
from .checks import Checked
from .parts import TrainingParts
from .preflight import agree_job_device, preflight
from .resume import Resume
from .rundir import probe_writable


def build_trainer(
    cfg: Config,
    transforms: Sequence[ModelTransform] | None = None,
    hooks: Sequence[TrainerHook] | None = None,
    overwrite: bool = False,
) -> Trainer:
    """The `Trainer` of `cfg`, resumed where the config says (`resume.py`).

    `transforms` / `hooks` default to what the config asks for (`model_transforms`, `step_hooks`).
    `overwrite`: start afresh, moving an earlier run in the run folders aside (`rundir.py`).
    The resume restores the checkpoint state once the trainer has attached its hooks: a hook's
    state (the EMA's shadows) exists from then on, and the checkpoint is read into it.
    """
    parts = assemble(cfg, transforms, hooks, overwrite)
    try:
        trainer = Trainer(parts)
        if parts.resume is not None:
            parts.resume.restore(parts)
        return trainer
    except BaseException:
        if parts.lock is not None:
            parts.lock.release()
        raise


def assemble(
    cfg: Config,
    transforms: Sequence[ModelTransform] | None = None,
    hooks: Sequence[TrainerHook] | None = None,
    overwrite: bool = False,
) -> TrainingParts:
    """Build every part of a run from `cfg` (see `build_trainer`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    checked = preflight(cfg, world_size=world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    log_dir = Path(cfg.logging.dir)
    ckpt_dir = checkpoint_root(cfg.checkpoint.dir, log_dir)
    # The run-folder policy (rundir.py), decided the same way on every rank from the shared folders.
    ckpt_key = "checkpoint.dir" if cfg.checkpoint.dir else "logging.dir"
    probe_writable(log_dir, "logging.dir")
    probe_writable(ckpt_dir, ckpt_key)
    planned = planned_checkpoint_bytes(cfg, ckpt_dir)
    # An object store has no free space to check.
    note = None if isinstance(ckpt_dir, RemoteDir) else check_room(ckpt_dir, ckpt_key, planned)
    if note is not None and int(os.environ.get("RANK", "0")) == 0:
        print(note, file=sys.stderr, flush=True)
    lock = take_run_lock(log_dir, ckpt_dir)
    try:
        return _assemble(checked, dims, log_dir, ckpt_dir, lock, planned, transforms, hooks, overwrite)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def planned_checkpoint_bytes(cfg: Config, ckpt_dir: Folder) -> int:
    """Bytes one checkpoint of this run needs: the plan's (`plan.checkpoint_bytes`), or the newest
    checkpoint's size on disk when that is more (a resume: DCP's framing included)."""
    planned = checkpoint_bytes(model_dims(cfg), cfg)
    return room_needed(planned, ckpt_dir) if cfg.checkpoint.resume != "none" else planned


def take_run_lock(log_dir: Path, ckpt_dir: Folder) -> RunLock | None:
    """Rank 0 (the only writer before the process group exists) locks both run folders; None elsewhere.

    Before anything is written: a second run into either folder stops here (exit 2, naming the holder).
    A checkpoint folder on object storage has no lock of its own (a store offers no exclusive create to
    every client): it belongs to the run of its `logging.dir`, which is locked (docs/cluster.md).
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    folders = [(log_dir, f"logging.dir '{log_dir}'")]
    if not isinstance(ckpt_dir, RemoteDir):
        folders.append((ckpt_dir, f"checkpoint.dir '{ckpt_dir}'"))
    lock = RunLock(folders)
    for note in lock.acquire():
        print(note, file=sys.stderr, flush=True)
    return lock


def _assemble(
    checked: Checked,
    dims: ParallelDims,
    log_dir: Path,
    ckpt_dir: Folder,
    lock: RunLock | None,
    planned_bytes: int,
    transforms: Sequence[ModelTransform] | None,
    hooks: Sequence[TrainerHook] | None,
    overwrite: bool,
) -> TrainingParts:
    # The run folders are judged before the process group (an error there is said once a node), on the
    # config as given: `config.yaml` records `parallel.adaln_tables` as configured, as it does `auto` policies.
    cfg = checked.cfg
    resume = Resume(cfg, log_dir, ckpt_dir, overwrite)
    _, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, cfg.parallel.cpu_offload)
    # The start's one agreement: what follows decides from the same memory and card on every rank.
    blueprint = draw(checked, dims, agree_job_device(device))
    cfg = blueprint.cfg
    blueprint.announce()
    ctx = ParallelContext(dims, device)
    if ctx.is_main and ctx.averaging.force_sum:
        print(ctx.averaging.describe(dims.world_size), flush=True)
    _warn_cross_node_sp(ctx)
    # Before anything reads the data folder (the plan's longest sample on CUDA, the source): a rank that
    # read it while rank 0 writes it could see another dataset than its peers.
    _create_synthetic_dataset(cfg, ctx, blueprint.model_dims["text_dim"])
    transforms = list(model_transforms(cfg) if transforms is None else transforms)
    adapter = next((t for t in transforms if isinstance(t, ModelAdapter)), None)
    resumed = resume.choose(ctx, dict(blueprint.model_dims), adapter) is not None
    model = build_sharded_model(blueprint, ctx, transforms, resumed, trainable_only=adapter is not None)
    model_config = model_config_of(model)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.seed)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)

    shared_negative = load_shared_negative(cfg)
    # Every rank of an SP group skips the same samples; one of them writes the record. The step
    # recorded is the one being trained when the sample was read, up to data.prefetch samples early.
    lead = ctx.sp_rank == 0
    data_errors = EventLog(log_dir / "data_errors.jsonl" if lead else None)
    spike_log = EventLog(log_dir / "loss_spikes.jsonl" if lead else None)
    progress = Progress()
    source, batches = _micro_batches(blueprint, ctx, model_config, shared_negative, data_errors, progress)
    watch = validation_watch(cfg)
    adapter_files = export_files(cfg, adapter)
    owner = lock.token if lock is not None else ""
    checkpointer = build_checkpointer(cfg, ckpt_dir, ctx, watch, adapter_files, owner, planned_bytes)
    checkpointer.clean_incomplete()
    faults = FaultInjector(cfg.debug.fault, ctx.rank, keypress_gap_s=SAME_KEYPRESS_S)
    if hooks is None:
        hooks = step_hooks(cfg, ctx.rank, shared_negative=shared_negative)
    return TrainingParts(
        blueprint=blueprint,
        ctx=ctx,
        log_dir=log_dir,
        model=model,
        model_config=model_config,
        adapter=adapter,
        optimizer=optimizer,
        scheduler=scheduler,
        source=source,
        batches=batches,
        shared_negative=shared_negative,
        hooks=[*debug_hooks(cfg, faults, log_dir, model_config), *hooks],
        checkpointer=checkpointer,
        faults=faults,
        data_errors=data_errors,
        spike_log=spike_log,
        progress=progress,
        spikes=SpikeDetector(cfg.train.spike_factor, cfg.train.spike_window),
        watch=watch,
        preemption=Preemption(),
        metrics=metrics_logger(cfg, log_dir, ctx.is_main),
        adapter_files=adapter_files,
        resume=resume,
        lock=lock,
    )


def _micro_batches(
    blueprint: Blueprint,
    ctx: ParallelContext,
    model_config: dict[str, Any],
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None,
    data_errors: EventLog,
    progress: Progress,
) -> tuple[SampleSource, MicroBatchStream]:
    """The run's sample source and the stream of its micro-batches for this DP rank, each skipped sample
    recorded in `data_errors` at the step being trained, composed as `blueprint` says; rank 0 says what the
    source and its steps hold."""
    cfg = blueprint.cfg
    source = build_source(
        cfg,
        model_config["text_dim"],
        on_skip=lambda sample_id, reason: data_errors.write(step=progress.step + 1, sample_id=sample_id, reason=reason),
    )
    if ctx.is_main and isinstance(source, DatasetMixture):
        print(source.describe(), flush=True)
    dp = ctx.dims.dp
    batches = MicroBatchStream(
        source,
        build_sampler(source, cfg, ctx.dp_rank, dp),
        lambda sample, step, slot: micro_batch_inputs(cfg, sample, step, slot, shared_negative),
        blueprint.composer,
        cfg.data.prefetch,
    )
    if ctx.is_main:
        for line in samples_lines(cfg, blueprint.composer, model_config, source):
            print(line, flush=True)
    return source, batches


def metrics_logger(cfg: Config, log_dir: Path, is_main: bool) -> MetricsLogger:
    """The run's metrics logger (`logging.wandb`, `logging.tensorboard`, the progress line); rank 0 writes."""
    return MetricsLogger(
        log_dir,
        is_main,
        cfg.logging.wandb,
        asdict(cfg),
        cfg.train.steps,
        progress=cfg.logging.progress,
        tensorboard=cfg.logging.tensorboard,
    )


def model_config_of(model: SequenceParallelH3) -> dict[str, Any]:
    """The transformer's constructor arguments (its diffusers config without the `_` entries)."""
    return {k: v for k, v in dict(model.transformer.config).items() if not k.startswith("_")}


def validation_watch(cfg: Config) -> ValidationWatch:
    """The judge of the validation rows: `checkpoint.keep_best` and `validation.guard`."""
    return ValidationWatch(cfg.checkpoint.keep_best, cfg.checkpoint.keep_best_mode, cfg.validation.guard)


def export_files(cfg: Config, adapter: ModelAdapter | None) -> AdapterFiles | None:
    """`checkpoint.export`: the writer of a LoRA run's adapter files into each committed checkpoint (None: none)."""
    if adapter is None or cfg.checkpoint.export == "none":
        return None
    return AdapterFiles(cfg.checkpoint.export)


def build_checkpointer(
    cfg: Config,
    ckpt_dir: Folder,
    ctx: ParallelContext,
    watch: ValidationWatch,
    adapter_files: AdapterFiles | None,
    owner: str = "",
    planned_bytes: int = 0,
) -> Checkpointer:
    """The run's checkpointer with its callbacks: it never prunes the best checkpoint (`watch`, when
    `checkpoint.keep_best` names a metric) and rank 0 writes `adapter_files` into each it commits."""
    return Checkpointer(
        ckpt_dir,
        cfg.checkpoint.keep_last,
        ctx.is_main,
        async_save=cfg.checkpoint.async_save,
        device=ctx.device,
        owner=owner,
        planned_bytes=planned_bytes,
        best_step=(lambda: watch.best_checkpoint) if watch.metric is not None else None,
        after_commit=adapter_files,
    )


def build_sharded_model(
    blueprint: Blueprint,
    ctx: ParallelContext,
    transforms: Sequence[ModelTransform],
    resumed: bool,
    trainable_only: bool,
) -> SequenceParallelH3:
    """The transformer of `blueprint` with its transforms, wrapped for sequence parallelism and sharded by
    FSDP2 (`wrap_and_shard`).

    A resumed run gets every value from its checkpoint: no rank builds or reads a full model. A
    checkpoint of the trainable state only (an adapter's) needs its base built as on a fresh start.
    """
    cfg, device = blueprint.cfg, ctx.device
    pretrained = pretrained_folder(cfg) if cfg.model.pretrained else None
    restores_all = resumed and not trainable_only
    from_meta = pretrained is not None or restores_all
    model = wrap_and_shard(blueprint, ctx, transforms, from_meta)
    if restores_all:
        materialize(model, device)
    elif pretrained:
        load_pretrained_shards(model, pretrained, device, pretrained_key)
    if not resumed:
        after_load(transforms, model)
    return model


def wrap_and_shard(
    blueprint: Blueprint,
    ctx: ParallelContext,
    transforms: Sequence[ModelTransform],
    from_meta: bool,
) -> SequenceParallelH3:
    """`build_sharded_model` up to its values: the transformer (on `meta` when `from_meta`, else seeded)
    with its transforms, wrapped for sequence parallelism and sharded by FSDP2, as `blueprint` decided
    (its attention backend, each block's policy, the compile, the tables). A model from `meta` holds no
    values until `materialize` or `load_pretrained_shards` gives them."""
    cfg, device = blueprint.cfg, ctx.device
    if cfg.lora.rank:
        # FSDP2 on this torch may refuse the codes: refused before any model, for a trainer built in
        # code as for one the command line checked first.
        check_base_quant(cfg.lora.base_quant)
    transformer = build_meta_model(cfg) if from_meta else build_model(cfg, cfg.train.seed)
    with known_notices():
        transformer.set_attention_backend(blueprint.attention_backend)
    apply_transforms(transformer, cfg, transforms, blueprint.trainable_dtype)
    model = SequenceParallelH3(
        transformer,
        SequenceParallel(ctx.sp_group),
        activation_checkpointing=_block_policies(blueprint.policies, transformer.config.num_layers),
        compile_blocks=blueprint.compile_blocks,
        compile_backend=cfg.model.compile_backend,
        packed=cfg.data.pack > 0,
    )
    if shards_nothing(model, ctx, cfg.model.dtype, cfg.parallel.cpu_offload):
        if not from_meta:
            model.to(device)
    else:
        # fully_shard moves the (CPU-initialised) shards to the mesh's device.
        apply_fsdp(
            model, ctx, cfg.model.dtype, cpu_offload=cfg.parallel.cpu_offload, adaln_tables=cfg.parallel.adaln_tables
        )
    return model


def _block_policies(policies: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """`policies`, one per block of the built transformer."""
    if len(policies) != num_layers:
        raise ValueError(f"{len(policies)} block policies for a model of {num_layers} blocks")
    return tuple(policies)


def _warn_cross_node_sp(ctx: ParallelContext) -> None:
    dims = ctx.dims
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    if ctx.is_main and dims.sp > 1 and per_node % dims.sp:
        warnings.warn(
            f"parallel.sp={dims.sp} does not divide the {per_node} ranks per node: Ulysses all-to-alls "
            "will cross nodes, which is far slower than NVLink; prefer an sp that divides the GPUs per node",
            stacklevel=3,
        )


def _create_synthetic_dataset(cfg: Config, ctx: ParallelContext, text_dim: int) -> None:
    """`data.create_synthetic`: rank 0 writes a synthetic dataset where `data.path` holds none yet; every
    rank waits for it (collective, whether or not there was one to write)."""
    data = cfg.data
    if data.source != "cached" or not data.create_synthetic:
        return
    (spec,) = dataset_specs(data)
    # Rank 0 alone looks: a rank that looked after rank 0 had written the index would skip the barrier
    # its peers wait in. Whether there is a barrier is the config's to say, the same on every rank.
    if ctx.is_main and not (Path(spec.path) / INDEX_NAME).is_file():
        from ..data.synthetic_dataset import write_synthetic_dataset

        write_synthetic_dataset(
            spec.path,
            task=cfg.task.name,
            num_samples=data.synthetic.num_samples,
            seed=cfg.train.seed,
            text_dim=text_dim,
        )
    dist.barrier()


def after_load(transforms: Sequence[ModelTransform], model: nn.Module) -> None:
    """Call each transform's `after_load(model)`, where it has one (see the module docstring)."""
    for transform in transforms:
        finish = getattr(transform, "after_load", None)
        if callable(finish):
            finish(model)


def debug_hooks(cfg: Config, faults: FaultInjector, log_dir: Path, model_config: dict[str, Any]) -> list[TrainerHook]:
    """The hooks of `debug`, which run before every other hook whatever hooks a caller gives:
    fault injection (`debug.fault`), then the dump of `debug.dump_step` (it sees injected faults)."""
    hooks: list[TrainerHook] = []
    if faults.faults:
        hooks.append(FaultHook(faults))
    if cfg.debug.dump_step is not None:
        hooks.append(StepDump(cfg.debug.dump_step, log_dir, model_config))
    return hooks


def step_hooks(
    cfg: Config, rank: int, *, shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None
) -> list[TrainerHook]:
    """The step hooks a config asks for, in the order they run.

    `shared_negative` is the loaded `cfg.negative=shared` text negative (`load_shared_negative`), which
    the held-out loss needs to build the same inputs as training.
    """
    hooks: list[TrainerHook] = []
    if cfg.debug.profile_steps:
        first, last = cfg.debug.profile_steps
        from ..train.profile import ProfilerHook

        hooks.append(ProfilerHook(first, last, Path(cfg.logging.dir) / "profile", rank))
    if cfg.train.ema.decay:
        from ..train.ema import EmaHook

        hooks.append(EmaHook(cfg.train.ema.decay))
    if cfg.validation.dataset and (cfg.validation.every or cfg.validation.at_start):
        from ..train.validation import HeldOutLoss

        hooks.append(HeldOutLoss(cfg, shared_negative=shared_negative))
    if cfg.validation.samples:
        from ..train.render_hook import SampleRenderer

        hooks.append(SampleRenderer(cfg))
    if cfg.logging.sample_ids:
        from ..train.sample_log import TrainedSamples

        hooks.append(TrainedSamples(cfg.logging.dir))
    return hooks
