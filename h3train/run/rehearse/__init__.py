"""A run's build and one optimizer step at its configured world size, in one CPU process: `h3train check --rehearse`.

No GPU, no weights, no memory: a fake process group of N ranks (this process is rank 0) and torch's
`FakeTensorMode`, whose tensors have shapes, dtypes and storages of the real sizes but no data.
What runs is the trainer's own code, on rank 0's share of the work, as a CUDA run at the plan's default
card decides it (its `run.blueprint.Blueprint`: tables, memory plan, each block's recompute), built here:

- the model as `assemble.build_sharded_model` builds it from a pretrained folder: the transformer on
  `meta` with its transforms (adapters, quantized base), the Ulysses wrapper with its checkpointing,
  FSDP2's plan (`wrap_and_shard`), then `materialize`, the allocation `load_pretrained_shards`
  makes before it reads (no file is read), and the transforms' `after_load`. The architecture is
  the pretrained folder's `config.json`, or away from it the released one (`planned_model_dims`);
- the rest of the run's parts (`run.parts.TrainingParts`) by the composition root's builders: the
  optimizer `optim.name` builds, the LR schedule, the step hooks (the EMA, `EmaHook`, when
  configured), the checkpointer, and a `Trainer` over them;
- the trainer's own step, `Trainer.run_step` (`forward_backward`, `update` and the hooks around
  them), in the state of every step after the first (optimizer state and EMA resident):
  `min(grad_accum, 2)` micro-batches of the longest planned sample, each `objective.compute_loss`
  (with the CFG forward) and its backward, then the grad norm and clip, the optimizer step, the
  schedule step and the EMA update. Micro-batches after the second repeat its memory exactly
  (the same sample, gradients already accumulated), so they are not run. The step's all-reduce,
  whose values fake tensors cannot bring to the host, is the one part given in its place
  (`_unread_reduction`);
- the checkpoint: the trainer's components (`run.parts.checkpoint_components`) through DCP's own
  `DefaultSavePlanner`, nothing written (`SavePlanSummary`).

Memory is counted by `memtrack.StorageTracker` from the moment the model is built: per category
(`CATEGORIES`), each category's peak over the step and the split at the step's overall peak, set
beside the rows of `plan.estimate` (`compare`). `rehearse_resume` plans DCP's load of a checkpoint
saved at one world size into a run at another.

What fake tensors cannot run is done another way and named in `Rehearsal.notes`; nothing is
skipped silently. Run it in a process of its own (the CLI does): it creates and destroys the
default process group.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...config import Config
from ...data.step_composition import StepStats
from ...errors import ConfigError, UsageError
from ...optim.kinds import optimizer_kind
from ...parallel.dims import ParallelContext, ParallelDims
from ...parallel.shards import local_tensor
from ...plan import MemoryPlan, config_sample_rows, estimate
from ...tasks.released import CANVAS, LONGEST_PIXEL_FRAMES, LONGEST_ROWS, TEXT_ROWS, VISION_TOKENS
from ...tasks.synthetic import Clip, SyntheticSource, clip_data, clip_sample
from ...train.hooks import MicroBatchEvent, TrainerHook, TrainerView
from ...train.reduction import ReducedStep, StepTotals
from ...train.trainer import Trainer
from ..blueprint import Blueprint
from .cuda_kernels import cuda_norm_kernels
from .memtrack import TRANSIENT, StorageTracker
from .save_plans import LoadPlanSummary, SavePlanSummary, plan_load, plan_save

# The longest released clip the plan falls back to away from the data (`tasks.released`, `LONGEST_ROWS` as
# FL2VA), first and last keyframes.
RELEASED_CLIP = Clip(LONGEST_PIXEL_FRAMES, *CANVAS, text_len=TEXT_ROWS, vision_tokens=VISION_TOKENS)
# What the tracker counts, in the order printed, with the plan's row(s) each stands beside.
WEIGHTS, GRADS, OPTIM, EMA, UNSHARDED, BATCH, OTHER = (
    "weights",
    "gradients",
    "optimizer state",
    "EMA",
    "unsharded params",
    "micro-batch",
    "buffers",
)
CATEGORIES = (WEIGHTS, GRADS, OPTIM, EMA, UNSHARDED, TRANSIENT, BATCH, OTHER)


# The plan and the rehearsal agree when the plan's total (reserve aside) is within this of the peak.
TOLERANCE = 0.10


# Micro-batches rehearsed at most: the second shows the accumulated gradients' peak, later ones repeat it.
MICRO_BATCHES = 2


@dataclass
class Rehearsal:
    """What one rehearsal found, beside the plan of the same configuration (byte counts per rank)."""

    world_size: int
    mesh: ParallelDims
    num_layers: int
    rows: int
    text_rows: int
    rows_origin: str
    micro_batches: int
    grad_accum: int
    plan: MemoryPlan
    category_peaks: dict[str, int]
    at_peak: dict[str, int]
    peak_bytes: int
    peak_phase: str
    # Live bytes per category as the update begins, its gradients complete: the sharded state of every step
    # (weights, optimizer state, EMA) and the gradients, which the update frees.
    at_update: dict[str, int]
    save: SavePlanSummary | None
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def planned_bytes(self) -> int:
        """The plan's device total without its fixed reserve: what the rehearsal can see."""
        return self.plan.total_bytes - self.plan.reserve_bytes

    @property
    def device_peak_bytes(self) -> int:
        """The step's peak on the device: with `cpu_offload` the sharded state lives in host memory."""
        if not self.plan.cpu_offload:
            return self.peak_bytes
        return self.peak_bytes - sum(self.at_peak.get(c, 0) for c in (WEIGHTS, GRADS, OPTIM, EMA))

    @property
    def plan_error(self) -> float:
        """(plan - rehearsed) / rehearsed, of the device totals without the reserve."""
        return self.planned_bytes / self.device_peak_bytes - 1.0

    @property
    def agrees(self) -> bool:
        return abs(self.plan_error) <= TOLERANCE

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())


def plan_rows(plan: MemoryPlan) -> dict[str, int]:
    """The plan's bytes for each tracked category (`CATEGORIES`)."""
    return {
        WEIGHTS: plan.master_weights_bytes,
        GRADS: plan.grads_bytes,
        OPTIM: plan.optimizer_bytes,
        EMA: plan.ema_bytes,
        UNSHARDED: plan.unsharded_params_bytes,
        TRANSIENT: plan.activation_bytes + plan.unsharded_grads_bytes,
        BATCH: 0,
        OTHER: 0,
    }


# -- the process group and the sample --------------------------------------------------------------


@contextmanager
def fake_process_group(world_size: int) -> Iterator[list[str]]:
    """The default process group as a fake one of `world_size` ranks, this process rank 0; yields notes.

    torch releases without meta kernels for the c10d collectives (2.8) get them from
    `torch.distributed._tools.fake_collectives`, which registers them when imported.
    """
    if dist.is_initialized():
        raise UsageError("a rehearsal needs a process of its own: a process group already exists here")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    notes = []
    if not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::_allgather_base_", "Meta"):
        importlib.import_module("torch.distributed._tools.fake_collectives")  # registers the meta kernels

        notes.append(
            "c10d collectives: no meta kernels in this torch; torch.distributed._tools.fake_collectives registers them"
        )
    # A fake group has no peers to check collectives against: TORCH_DISTRIBUTED_DEBUG=DETAIL's
    # wrapper would open a gloo group on the fake store, which cannot hold one.
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield notes
        finally:
            dist.destroy_process_group()
    finally:
        dist.set_debug_level(level)
        # torch 2.8 keeps flattened meshes by their layout across process groups: a later rehearsal
        # of the same layout would find the groups destroyed here.
        from torch.distributed import device_mesh

        env = getattr(device_mesh, "_mesh_resources", None)
        for name in ("root_to_flatten_mapping", "flatten_name_to_root_dims", "child_to_root_mapping"):
            cache = getattr(env, name, None)
            if isinstance(cache, dict):
                cache.clear()


def planned_sample(cfg: Config, text_dim: int) -> tuple[Any, int, str]:
    """(sample, text rows, where it comes from): the sample `plan.config_sample_rows` plans for.

    The data source's longest sample (`DataSource.longest_sample`); away from the data, the released
    15 s FL2VA clip (`RELEASED_CLIP`), synthetic latents of its geometry.
    """
    from ...data.source import data_source

    if cfg.data.pack:
        # The samples a pack holds: planned alone, packed by `rehearse`.
        return planned_sample(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=0)), text_dim)
    rows, text_rows, source = config_sample_rows(cfg)
    released = source.startswith("longest released")
    if rows == LONGEST_ROWS and released:
        sample = clip_sample(RELEASED_CLIP, text_dim, cfg.train.seed)
        source = "longest released clip (15 s 768x1344 FL2VA, synthetic latents); data.path is not readable here"
    elif released:
        # A task of prompt-only clips (t2va): the same clip without its keyframes (`plan.released_rows`).
        sample = SyntheticSource(clip_data(RELEASED_CLIP), text_dim, cfg.train.seed, cfg.task.name)[0]
        source = "longest released clip (15 s 768x1344 T2VA, synthetic latents); data.path is not readable here"
    elif source.startswith("data.max_rows"):
        # Away from the data the plan takes the bound; the rehearsal runs the longest clip of the released
        # canvas within it, and `rehearse` plans that clip's rows.
        sample, frames = _released_within(rows, text_dim, cfg.train.seed)
        source = (
            f"longest {frames}-frame 768x1344 FL2VA clip within data.max_rows={rows} (synthetic latents); "
            "data.path is not readable here"
        )
        return sample, TEXT_ROWS, source
    else:
        sample = data_source(cfg).longest_sample(cfg, text_dim)
    if sample.layout.seq_len != rows:
        raise RuntimeError(f"the rehearsed sample packs {sample.layout.seq_len} rows, the plan {rows}")
    return sample, text_rows, source


def _filler(cfg: Config, rows: int, text_dim: int, slot: int) -> tuple[Any, Any] | None:
    """(sample, its inputs): the longest released-canvas clip within `rows`, to fill a rehearsed pack;
    None when no clip fits or the run's inputs need what a synthetic clip lacks (its own negatives)."""
    from ...objective import micro_batch_inputs

    try:
        sample, _ = _released_within(rows, text_dim, cfg.train.seed)
        return sample, micro_batch_inputs(cfg, sample, step=1, slot=slot)
    except (ConfigError, ValueError):
        return None


def _released_within(bound: int, text_dim: int, seed: int) -> tuple[Any, int]:
    """(sample, frames): the longest clip of the released canvas and prompt (`RELEASED_CLIP`, 17 n + 5
    frames) that packs to at most `bound` rows."""
    for frames in range(RELEASED_CLIP.frames, 4, -17):
        sample = clip_sample(dataclasses.replace(RELEASED_CLIP, frames=frames), text_dim, seed)
        if sample.layout.seq_len <= bound:
            return sample, frames
    raise ConfigError(f"config key 'data.max_rows' = {bound} holds no clip of the released canvas to rehearse")


def rehearsal_config(cfg: Config, dims: dict[str, Any]) -> Config:
    """`cfg` with the architecture `dims` stated (`model.config`) and no pretrained folder to read, and without
    what runs beside the step rather than in it: no held-out loss, rendered samples or profiler among its
    hooks, no background save (none is written: the plan is DCP's, `plan_save`)."""
    model = dataclasses.replace(cfg.model, pretrained=None, config={k: v for k, v in dims.items() if k[:1] != "_"})
    validation = dataclasses.replace(cfg.validation, dataset=None, samples=[])
    checkpoint = dataclasses.replace(cfg.checkpoint, async_save=False)
    debug = dataclasses.replace(cfg.debug, profile_steps=[])
    return dataclasses.replace(cfg, model=model, validation=validation, checkpoint=checkpoint, debug=debug)


# -- building -------------------------------------------------------------------------------------


class _PlannedMicroBatch:
    """The step's micro-batches as a rehearsal has them: each is the planned sample and its inputs (built on
    the host before the fake mode, since the layout builders call nonzero); no position to keep."""

    def __init__(self, sample: Any = None, inputs: Any = None, per_step: int = 1) -> None:
        self.sample, self.inputs, self.per_step = sample, inputs, per_step

    def next(self, step: int, slot: int) -> tuple[Any, Any]:
        if self.inputs is None:
            raise RuntimeError("this rehearsal builds the run's state only and has no micro-batch to step on")
        return self.sample, self.inputs

    def step_stats(self) -> StepStats:
        return StepStats(self.per_step, None, 0.0)

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _unread_reduction(
    device_sums: torch.Tensor,
    counts: Any,
    scalars: list[torch.Tensor],
    losses: list[torch.Tensor],
) -> ReducedStep:
    """The step's reduction on a fake group, whose values cannot be read on the host: a finite step of zero
    losses whose clip coefficient is under 1, so the update scales the gradients (in place: no memory)
    and takes the step, as a clipped step does."""
    totals = StepTotals.unpack([0.0] * len(StepTotals.names()))
    return ReducedStep(totals, [1.0, 0.5][: len(scalars)], [0.0] * len(losses))


class _Phases(TrainerHook):
    """Names where the step is for the tracker (what a peak is recorded during), from the trainer's hook points,
    the model's forward and the optimizer's step; takes the tracker's classification after each backward."""

    def __init__(self, tracker: StorageTracker, ema: bool) -> None:
        self.tracker = tracker
        self.ema = ema
        self.micro = 0
        self.backward_done = False
        # Live bytes per category as the update begins (`Rehearsal.at_update`).
        self.at_update: dict[str, int] = {}

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        optimizer.register_step_pre_hook(lambda *_: setattr(self.tracker, "phase", "optimizer step"))

    def _after_backward(self) -> None:
        if self.backward_done:
            self.tracker.refresh()
            self.backward_done = False

    def _forward(self, module: Any, args: Any, kwargs: Any) -> None:
        self._after_backward()
        what = "forward" if torch.is_grad_enabled() else "forward of the CFG negative (no grad)"
        self.tracker.phase = f"{what}, micro-batch {self.micro + 1}"

    def before_step(self, trainer: TrainerView, step: int) -> None:
        self.micro = 0

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        self.micro = batch.index + 1
        self.tracker.phase = f"backward, micro-batch {self.micro}"
        self.backward_done = True

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        self._after_backward()
        self.at_update = {c: self.tracker.live.get(c, 0) for c in CATEGORIES}
        self.tracker.phase = "grad norm and clip"

    def after_step(self, trainer: TrainerView, step: int, stats: Any) -> None:
        # The hooks after this one update what they keep (the EMA).
        self.tracker.phase = "EMA update" if self.ema else "after the step"


def _build(
    blueprint: Blueprint,
    ctx: Any,
    tracker: StorageTracker | None,
    notes: list[str],
    mode: Any,
    batches: _PlannedMicroBatch,
    hooks: list[TrainerHook],
) -> Trainer:
    """The run's trainer on `ctx`'s fake group, its parts built by the composition root's own builders from
    `blueprint`, their values fake tensors of `mode`, the optimizer state allocated; `hooks` run before the
    config's.

    The transformer is built, transformed and sharded on `meta` outside the fake mode (module dtype
    conversions swap tensors, which fake tensors refuse), then materialized inside it.
    """
    from ...lora.transforms import model_transforms
    from ..assemble import wrap_and_shard

    transforms = model_transforms(blueprint.cfg)
    model = wrap_and_shard(blueprint, ctx, transforms, from_meta=True)
    with mode, tracker if tracker is not None else _nothing():
        return _materialized(blueprint, ctx, model, transforms, tracker, notes, batches, hooks)


def _materialized(
    blueprint: Blueprint,
    ctx: Any,
    model: Any,
    transforms: list,
    tracker: StorageTracker | None,
    notes: list[str],
    batches: _PlannedMicroBatch,
    hooks: list[TrainerHook],
) -> Trainer:
    """`_build` inside the fake mode: values, the tracker's categories, optimizer (state), the parts, the trainer."""
    from ...checkpoint import checkpoint_root
    from ...debug.faults import FaultInjector
    from ...model.adapter import ModelAdapter
    from ...model.build import materialize
    from ...optim.kinds import build_optimizer, build_scheduler
    from ...train.events import EventLog, Progress, SpikeDetector
    from ...train.preemption import Preemption
    from ..assemble import build_checkpointer, export_files, model_config_of, step_hooks, validation_watch
    from ..parts import TrainingParts

    cfg = blueprint.cfg
    materialize(model, torch.device("cpu"))
    if any(callable(getattr(t, "after_load", None)) for t in transforms):
        # Values only: each rank's offsets come from its mesh coordinate, read from a tensor.
        notes.append(
            "adapter init (the transforms' after_load) reads this rank's mesh coordinate from a tensor: not run; "
            "it gives values only (its seeded full adapter tensors live on the host while it runs)"
        )
    adapter = next((t for t in transforms if isinstance(t, ModelAdapter)), None)
    if tracker is not None:
        tracker.adopt((local_tensor(p) for p in model.parameters()), WEIGHTS)
        tracker.adopt((local_tensor(b) for b in model.buffers()), OTHER)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.seed)
    with tracker.attributing(OPTIM) if tracker is not None else _nothing():
        _allocate_optimizer_state(model, optimizer, cfg.optim.name, notes)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    log_dir = Path(cfg.logging.dir)
    watch = validation_watch(cfg)
    adapter_files = export_files(cfg, adapter)
    parts = TrainingParts(
        blueprint=blueprint,
        ctx=ctx,
        log_dir=log_dir,
        model=model,
        model_config=model_config_of(model),
        adapter=adapter,
        optimizer=optimizer,
        scheduler=scheduler,
        source=None,
        batches=batches,
        shared_negative=None,
        hooks=[*hooks, *step_hooks(cfg, ctx.rank)],
        checkpointer=build_checkpointer(cfg, checkpoint_root(cfg.checkpoint.dir, log_dir), ctx, watch, adapter_files),
        faults=FaultInjector([], ctx.rank, keypress_gap_s=0.0),
        data_errors=EventLog(None),
        spike_log=EventLog(None),
        progress=Progress(),
        spikes=SpikeDetector(cfg.train.spike_factor, cfg.train.spike_window),
        watch=watch,
        preemption=Preemption(),
        metrics=None,
        adapter_files=adapter_files,
        reduction=_unread_reduction,
    )
    # The hooks attach to the trainer: the EMA's shadows are allocated there.
    with tracker.attributing(EMA) if tracker is not None else _nothing():
        return Trainer(parts)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _update_not_run(self: torch.optim.Optimizer, closure: Any = None) -> None:
    """The optimizer step of a kind whose update fake tensors cannot run (`OptimizerKind.fake_update`)."""


def _allocate_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, name: str, notes: list[str]) -> None:
    """Give every trainable parameter the state a step after the first finds.

    A kind whose update runs on fake tensors runs its first update over zero gradients (the state as
    torch allocates it). The others read values on the host in their update (`OptimizerKind.fake_update`
    says how), so their own `init_state` allocates the state and their `step` is left out (`_update_not_run`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    what = optimizer_kind(name).fake_update
    if what is None:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    for p in params:
        optimizer.init_state(p)
    # Bound before the schedule is built, which wraps the optimizer's `step` as it finds it.
    optimizer.step = types.MethodType(_update_not_run, optimizer)  # type: ignore[method-assign]
    notes.append(
        f"optimizer update: {what}; its state is allocated by its own init_state (as its first step does, "
        "exact) and the update arithmetic is not run: its temporaries (one parameter shard's float32 values "
        "at a time) are not counted"
    )


def _blueprint(
    run_cfg: Config,
    mesh: ParallelDims,
    dims: dict[str, Any],
    device_kind: str,
    plan_of: Callable[[Config], MemoryPlan] | None = None,
) -> Blueprint:
    """The blueprint (`blueprint.draw`) of `run_cfg`'s run on a `device_kind` device at the plan's default card
    (its tables, memory plan and policies; `plan_of` plans a setting), built on this host: attending as the
    CPU does, nothing compiled (fake tensors compile nothing)."""
    from ...ops.attention import resolve_attention_backend
    from ...plan import DEFAULT_DEVICE_MEMORY_GIB
    from ...plan.step_time import DEFAULT_DEVICE
    from ..blueprint import draw
    from ..checks import Checked
    from ..preflight import JobDevice

    backend = resolve_attention_backend(run_cfg.model.attention_backend, "cpu", run_cfg.model.dtype)
    checked = Checked(run_cfg, "cpu", dims, (), backend, compile_blocks=False)
    job = JobDevice(DEFAULT_DEVICE_MEMORY_GIB, DEFAULT_DEVICE)
    return draw(checked, mesh, job, device_kind=device_kind, plan_of=plan_of, compile_blocks=False)


# What every rehearsal runs another way than the run (`Rehearsal.notes`).
_NOTES = (
    "values: the model is built on meta and materialized as the pretrained load allocates it; no weight is read",
    "micro-batch: built on the host before the fake mode (the layout builders call nonzero), real tensors",
    "step all-reduce and its copy to the host (the trainer's StepReduction) read values: not run; the step "
    "is taken as a clipped one (the clip in place: the same memory)",
)


def _rehearsed_micro_batch(cfg: Config, run_cfg: Config, text_dim: int) -> tuple[Any, Any, int, int, str]:
    """(sample or pack, its inputs, samples in it, its text rows, where it comes from): the longest planned
    sample (`planned_sample`); with `data.pack`, a pack of copies of it, as many as the budget holds (at least
    the one), the rows left filled by the longest released-canvas clip that fits them, as a run's packs fill."""
    from ...objective import micro_batch_inputs
    from ...packing import Pack, pack_inputs

    sample, text_rows, rows_origin = planned_sample(cfg, text_dim)
    if not cfg.data.pack:
        return sample, micro_batch_inputs(run_cfg, sample, step=1, slot=0), 1, text_rows, rows_origin
    rows = sample.layout.seq_len
    copies = max(1, cfg.data.pack // rows)
    members = [sample] * copies
    items = [micro_batch_inputs(run_cfg, sample, step=1, slot=i) for i in range(copies)]
    rows_origin = f"data.pack={cfg.data.pack}: {copies} of the {rows_origin}"
    filler = _filler(run_cfg, cfg.data.pack - rows * copies, text_dim, slot=copies)
    if filler is not None:
        members.append(filler[0])
        items.append(filler[1])
        rows_origin += f", and a {filler[0].layout.seq_len:,}-row clip"
    text_rows = text_rows * copies + sum(int(m.text_token_tags.numel()) for m in members[copies:])
    return Pack(tuple(members)), pack_inputs(items), len(members), text_rows, rows_origin


def rehearse(
    cfg: Config,
    world_size: int,
    num_layers: int | None = None,
    save_plan: bool = True,
    fused_norm: bool | None = None,
) -> Rehearsal:
    """Rehearse `cfg`'s build and one step at `world_size` ranks (module docstring).

    `num_layers`: rehearse (and plan) that many transformer blocks instead of the architecture's; every
    block is the same FSDP unit with the same rows, so per block the memory is the same. `fused_norm`: the
    GPU's torch runs CUDA's fused RMSNorm (default: as this torch would, `plan.fused_norm_for`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...infra.quiet import known_notices
    from ...model.architecture import planned_model_dims
    from ...packing import Pack

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    mesh = ParallelDims.from_config(cfg.parallel, world_size)
    dims, _ = planned_model_dims(cfg)
    if num_layers is not None:
        dims = {**dims, "num_layers": num_layers}
    micro_batches = min(cfg.train.grad_accum, MICRO_BATCHES)
    run_cfg = rehearsal_config(cfg, dims)
    # The trainer's step runs `train.grad_accum` micro-batches: those rehearsed.
    run_cfg = dataclasses.replace(run_cfg, train=dataclasses.replace(run_cfg.train, grad_accum=micro_batches))
    notes = list(_NOTES)
    optimizer_kind(cfg.optim.name).before_rehearsal()
    sample, ti, per_micro, text_rows, rows_origin = _rehearsed_micro_batch(cfg, run_cfg, int(dims["text_dim"]))
    rows = sample.seq_len if isinstance(sample, Pack) else sample.layout.seq_len

    def plan_of(setting: Config) -> MemoryPlan:
        # `cfg`'s plan (its evaluation and rendering included) at the rehearsed rows.
        planned = dataclasses.replace(cfg, parallel=setting.parallel)
        return estimate(dims, mesh, planned, rows=rows, text_rows=text_rows, fused_norm=fused_norm)

    blueprint = _blueprint(run_cfg, mesh, dims, "cuda", plan_of)
    plan = blueprint.memory_plan
    seconds["sample"] = time.perf_counter() - start

    if plan.fused_norm:
        notes.append(
            "RMSNorm: CUDA's fused kernel (its saved tensors, `cuda_kernels.FusedRMSNorm`), not the CPU composite"
        )
    with fake_process_group(world_size) as pg_notes, known_notices(), cuda_norm_kernels(plan.fused_norm):
        notes[:0] = pg_notes
        # The mesh computes its coordinates with nonzero: before the fake mode.
        ctx = ParallelContext(mesh, torch.device("cpu"))
        trainer: Trainer | None = None
        fsdp_params: list[Any] = []
        tracker = StorageTracker(reclassify=lambda: _owned(trainer, fsdp_params))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        phases = _Phases(tracker, ema=run_cfg.train.ema.decay > 0)
        t = time.perf_counter()
        batches = _PlannedMicroBatch(sample, ti, per_step=micro_batches * mesh.dp * per_micro)
        trainer = _build(blueprint, ctx, tracker, notes, mode, batches, [phases])
        phases.attach(trainer.model, trainer.parts.optimizer)
        fsdp_params = _fsdp_params(trainer.model)
        seconds["build"] = time.perf_counter() - t
        t = time.perf_counter()
        with mode, tracker:
            tracker.adopt(_tensors(ti), BATCH)
            tracker.reset_peaks()
            # The trainer's own step, as `fit` runs it (its hooks around it), in the state of every step after
            # the first: the optimizer state and the EMA are resident.
            trainer.run_step(1)
            tracker.phase = "after the step"
            tracker.refresh()
            seconds["step"] = time.perf_counter() - t
        summary = _save_plan(trainer, mode, cfg.optim.name, notes, seconds) if save_plan else None
    return Rehearsal(
        world_size=world_size,
        mesh=mesh,
        num_layers=int(dims["num_layers"]),
        rows=rows,
        text_rows=text_rows,
        rows_origin=rows_origin,
        micro_batches=micro_batches,
        grad_accum=cfg.train.grad_accum,
        plan=plan,
        category_peaks={c: tracker.category_peaks.get(c, 0) for c in CATEGORIES},
        at_peak={c: tracker.peak.by_category.get(c, 0) for c in CATEGORIES},
        peak_bytes=tracker.peak.total,
        at_update=phases.at_update,
        peak_phase=tracker.peak.phase,
        save=summary,
        notes=notes,
        seconds=seconds,
    )


def _save_plan(
    trainer: Trainer, mode: Any, optimizer: str, notes: list[str], seconds: dict[str, float]
) -> SavePlanSummary:
    """DCP's save plan of `trainer`'s checkpoint (`plan_save`), its state made in the fake `mode`; its note and
    seconds added to `notes` and `seconds`."""
    t = time.perf_counter()
    with mode:
        state = _checkpoint_state(trainer)
    summary = plan_save(state, optimizer)
    notes.append(
        "checkpoint: the sampler's position (a few numbers) is left out of the save plan; other ranks' "
        "chunks from DTensor placement arithmetic, checked by DCP's global-plan validation"
    )
    seconds["save plan"] = time.perf_counter() - t
    return summary


def _checkpoint_state(trainer: Trainer) -> dict[str, Any]:
    """The state a checkpoint of the run saves (`checkpoint_components`), the sampler's position aside."""
    return {name: c.state_dict() for name, c in trainer.parts.checkpoint_state.items() if name != "sampler"}


def _built_state(cfg: Config, world_size: int, num_layers: int | None, use: Any) -> Any:
    """`use(state)` of the checkpoint state of `cfg`'s run built at `world_size` ranks (no step taken)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...infra.quiet import known_notices
    from ...model.architecture import planned_model_dims

    mesh = ParallelDims.from_config(cfg.parallel, world_size)
    dims, _ = planned_model_dims(cfg)
    if num_layers is not None:
        dims = {**dims, "num_layers": num_layers}
    optimizer_kind(cfg.optim.name).before_rehearsal()
    with fake_process_group(world_size), known_notices():
        ctx = ParallelContext(mesh, torch.device("cpu"))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        blueprint = _blueprint(rehearsal_config(cfg, dims), mesh, dims, "cpu")
        trainer = _build(blueprint, ctx, None, [], mode, _PlannedMicroBatch(), [])
        with mode:
            state = _checkpoint_state(trainer)
        return use(state)


def rehearse_resume(
    saved: Config, saved_world: int, loading: Config, world_size: int, num_layers: int | None = None
) -> LoadPlanSummary:
    """DCP's load plan of a checkpoint of `saved`'s run at `saved_world` ranks into `loading`'s at `world_size`.

    The checkpoint's metadata is the one `plan_save` makes at `saved_world`; the loading run's state
    is built at `world_size` and every rank's reads planned against it (`plan_load`).
    """
    save = _built_state(saved, saved_world, num_layers, lambda state: plan_save(state, saved.optim.name))
    load = _built_state(
        loading,
        world_size,
        num_layers,
        lambda state: plan_load(state, save, loading.optim.name),
    )
    return dataclasses.replace(load, saved_bytes=save.total_bytes)


def _tensors(ti: Any) -> list[torch.Tensor]:
    values = [getattr(ti, f.name) for f in dataclasses.fields(ti)]
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(t for t in v.values() if isinstance(t, torch.Tensor))
    return out


def _fsdp_params(model: Any) -> list[Any]:
    """Every `FSDPParam` of `model`'s FSDP2 units (FSDP2's own bookkeeping of each sharded parameter)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                found.extend(group.fsdp_params)
    return found


def _owned(trainer: Trainer | None, fsdp_params: list[Any]) -> dict[str, list[torch.Tensor]]:
    """What belongs to a category by its owner now: each parameter's gradient (FSDP2 sets it after its
    reduce-scatter) and each unit's all-gathered parameters (FSDP2's `all_gather_outputs`)."""
    if trainer is None:
        return {}
    return {
        GRADS: [p.grad for p in trainer.model.parameters() if p.grad is not None],
        UNSHARDED: [t for fp in fsdp_params for t in getattr(fp, "all_gather_outputs", None) or ()],
    }


# -- the checkpoint's plans -----------------------------------------------------------------------
