"""One trainer per attention backend: which backends run, each case's config, its steps, the report's data."""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import plan
from ...config import Config, LossWeights, TimestepConfig
from ...errors import ConfigError, did_you_mean
from ...model.architecture import model_kwargs
from ...objective import make_training_inputs
from ...ops.attention import ATTENTION_BACKENDS, unavailable
from ...plan.printout import checkpointing_line, summary
from ...tasks.sample import TrainingSample
from ...tasks.synthetic import Clip, clip_sample
from .case_setup import (
    CHECKPOINTING,
    FULL_CLIP,
    REDUCED_CLIP,
    REDUCED_DIMS,
    Rows,
    _parameter_count,
    rows_of,
    set_backend,
    trainer_config,
)
from .flops import peak_tflops_for, step_flops
from .parity import PARITY_GATE, REFERENCE_BACKEND, Parity, bench_parity
from .timing import Clock, SyncError, timed_step

GIB = 1024**3
DEFAULT_CUDA_BACKENDS = ("flash", "cudnn", "native")
DEFAULT_CPU_BACKENDS = ("native", "math")
DEFAULT_REPEATS = 3


@dataclass
class BackendResult:
    """One attention backend's trainer step. Times are medians over the timed steps; `step_time_s`
    is `forward_backward_s + update_s`; `loss` and `grad_norm` are step 1's (the same start for every backend)."""

    name: str
    backend: str
    status: str = "ok"  # ok | error | skipped
    error: str | None = None
    step_time_s: float | None = None
    forward_backward_s: float | None = None
    update_s: float | None = None
    tokens_per_s: float | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    # ok | sync (a sync outside the step's one read-back; timing from the steps after it) | n/a (CPU)
    sync_check: str = "n/a"
    sync_error: SyncError | None = None
    # Syncs `update` made under the check: its one designed read-back is 1.
    read_back_syncs: int | None = None


@dataclass
class BenchReport:
    device: str
    mode: str
    dtype: str
    precision: str
    # What the blocks recompute (`plan.printout.checkpointing_line`).
    gradient_checkpointing: str
    model: dict[str, Any]
    parameters: int
    layout: dict[str, Any]
    flops: dict[str, Any]
    peak_tflops: float | None
    peak_tflops_source: str
    plan_memory_bytes: int
    # The plan behind `plan_memory_bytes`: the device it planned for, the blocks' policies, where the peak is.
    plan: dict[str, Any] = field(default_factory=dict)
    backends: list[BackendResult] = field(default_factory=list)
    # Every backend's gradients against a float32 step (`parity.py`), and the model they were measured on.
    parity: list[Parity] = field(default_factory=list)
    parity_model: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # How the trainer's step was set up and timed.
    step_setup: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        ran = [b for b in self.backends if b.status != "skipped"]
        return (
            bool(ran)
            and all(b.status == "ok" and b.sync_check != "sync" and (b.read_back_syncs or 0) <= 1 for b in ran)
            and all(p.ok for p in self.parity)
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        # `steps`: the same rows under the key the whole-step check wrote them (`scripts/gpu_check.sh` readers).
        return {**data, "steps": data["backends"], "ok": self.ok}


def select_backends(requested: str | None, device: torch.device, dtype: str) -> tuple[list[str], list[str]]:
    """The backends to run and notes on skipped defaults. An explicit unavailable one is a `ConfigError`."""
    if requested:
        names = [n.strip() for n in requested.split(",") if n.strip()]
        for n in names:
            if n not in ATTENTION_BACKENDS:
                raise ConfigError(
                    f"bench --backends: unknown backend '{n}'; choose from {', '.join(ATTENTION_BACKENDS)}"
                    f"{did_you_mean(n, ATTENTION_BACKENDS)}"
                )
            why = unavailable(n, device.type, dtype)
            if why:
                raise ConfigError(f"bench --backends: '{n}' cannot run here: {why}")
        return list(dict.fromkeys(names)), []
    defaults = DEFAULT_CUDA_BACKENDS if device.type == "cuda" else DEFAULT_CPU_BACKENDS
    notes = [f"{n} skipped: {why}" for n in defaults if (why := unavailable(n, device.type, dtype))]
    return [n for n in defaults if not unavailable(n, device.type, dtype)], notes


def _check_clip(clip: Clip) -> None:
    from ...tasks.table import FRAME_RULE, is_frame_count

    if not is_frame_count(clip.frames):
        raise ConfigError(f"bench --frames {clip.frames}: must be {FRAME_RULE} (22, 39, ..., 124, ..., 362)")
    for flag, value in (("--height", clip.height), ("--width", clip.width)):
        if value < 32 or value % 32:
            raise ConfigError(f"bench {flag} {value}: must be a positive multiple of 32 (one row is 32x32 pixels)")
    if clip.text_len < 1:
        raise ConfigError(f"bench --text-len {clip.text_len}: must be at least 1")


def run_case(
    cfg: Config,
    res: BackendResult,
    device: torch.device,
    repeats: int,
    seq_len: int,
    total_flops: int,
    peak_tflops: float | None,
) -> None:
    """Build the case's trainer and run it into `res` (module docstring, "Steps" and "Sync check")."""
    from ...run.assemble import build_trainer

    trainer = build_trainer(cfg, hooks=[])
    try:
        if not ATTENTION_BACKENDS[res.name].trains:
            set_backend(trainer.model.transformer, res.backend)
        grads = trainer.forward_backward(1)
        stats = trainer.update(1, grads)
        del grads
        res.loss, res.grad_norm = float(stats["loss"]), float(stats["grad_norm"])
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        clock, halves, step, check = Clock(device), [], 1, cuda
        while len(halves) < repeats:
            step += 1
            timed = timed_step(trainer, step, clock, sync_check=check)
            if check:
                res.sync_check, res.read_back_syncs = "ok", timed.read_back_syncs
                if timed.sync is not None:
                    res.sync_check, res.sync_error = "sync", timed.sync
                check = False
            if timed.stats is not None:
                halves.append((timed.forward_backward_s, timed.update_s))
        res.forward_backward_s = statistics.median(h[0] for h in halves)
        res.update_s = statistics.median(h[1] for h in halves)
        res.step_time_s = res.forward_backward_s + res.update_s
        res.tokens_per_s = seq_len / res.step_time_s
        res.achieved_tflops = total_flops / res.step_time_s / 1e12
        res.mfu = res.achieved_tflops / peak_tflops if peak_tflops else None
        if cuda:
            res.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    finally:
        trainer.close()


def _clear_cuda(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_plan(
    dims: dict[str, Any],
    clip: Clip,
    dtype: str,
    policy: str,
    seed: int,
    memory_gib: float,
    device_kind: str,
    fused_norm: bool | None = None,
) -> plan.MemoryPlan:
    """The memory plan of one bench case, as the trainer it builds plans itself (`run.preflight.run_plan`: its
    config on a one-rank mesh, the kernels of `device_kind`, or `fused_norm` where given); `policy` `auto` is
    the choice its model makes."""
    from ...parallel.dims import ParallelDims
    from ...run.preflight import run_plan

    with tempfile.TemporaryDirectory(prefix="h3train-bench-plan-") as tmp:
        cfg = trainer_config(dims, clip, dtype, policy, "native", seed, Path(tmp))
    return run_plan(cfg, ParallelDims(1, 1, 1, 1), device_kind, memory_gib, fused_norm)


# How a CUDA case holds and computes its weights (FSDP2's mixed-precision policy on one rank).
CUDA_PRECISION = "float32 master weights; blocks compute in bfloat16 (FSDP2 policy), _keep_in_fp32_modules in float32"


def plan_fields(step_plan: plan.MemoryPlan, memory_gib: float) -> dict[str, Any]:
    """The report's `plan`: the device planned for, the blocks' policies, their recompute, where the peak is."""
    return {
        "device_memory_gib": memory_gib,
        "policies": list(step_plan.policies),
        "recompute_share": step_plan.recompute_share,
        "peak_phase": step_plan.peak_phase,
        "fused_norm": step_plan.fused_norm,
        "reserve_bytes": step_plan.reserve_bytes,
        "fits": step_plan.fits,
    }


def _planned_report(
    layers: int | None, checkpointing: str, memory_gib: float | None, clip: Clip, seed: int
) -> BenchReport:
    """`run_bench(plan_only=True)`: the report of a GPU's case with its plan and no backend run."""
    _check_clip(clip)
    dims = model_kwargs({"num_layers": layers or 4})
    memory = memory_gib or plan.DEFAULT_DEVICE_MEMORY_GIB
    step_plan = bench_plan(dims, clip, "bfloat16", CHECKPOINTING[checkpointing], seed, memory, "cuda")
    sample = clip_sample(clip, int(dims["text_dim"]), seed)
    rows = rows_of(make_training_inputs(sample, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights()))
    flops = step_flops(dims, rows)
    return BenchReport(
        device=f"plan only: a {memory:.1f} GiB CUDA device",
        mode="full",
        dtype="bfloat16",
        precision=CUDA_PRECISION,
        gradient_checkpointing=checkpointing_line(step_plan),
        model={k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items()},
        parameters=_parameter_count(dims),
        layout={
            "task": "fl2va",
            "keyframes": ["first", "last"],
            **asdict(clip),
            **asdict(rows),
            "target_video": rows.video - rows.keyframe,
        },
        flops={**asdict(flops), "total": flops.total, "counted": "matmuls; fwd + bwd; recompute not counted"},
        peak_tflops=None,
        peak_tflops_source="not run",
        plan_memory_bytes=step_plan.peak_bytes - step_plan.reserve_bytes,
        plan=plan_fields(step_plan, memory),
        notes=[] if step_plan.fits else [f"the plan does not fit {memory:.1f} GiB: {summary(step_plan)}"],
    )


def _progress(message: str) -> None:
    # stderr, so a run cut short by a time limit still shows how far it got.
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _device_peak(device: torch.device, peak_tflops: float | None) -> tuple[str, float | None, str]:
    """(device name, its bf16 peak TFLOP/s, where the peak comes from): `--peak-tflops`, else the table's
    entry for the CUDA device; none on the CPU."""
    if device.type != "cuda":
        return "cpu", peak_tflops, "--peak-tflops" if peak_tflops else "not applicable on CPU"
    name = torch.cuda.get_device_name(device)
    if peak_tflops:
        return name, peak_tflops, "--peak-tflops"
    table_peak = peak_tflops_for(name)
    return name, table_peak, f"table entry for '{name}'" if table_peak else "unknown device: pass --peak-tflops"


def _run_backend(
    cfg: Config, res: BackendResult, device: torch.device, repeats: int, rows: int, flops: int, peak: float | None
) -> None:
    """`run_case` of one backend into `res`; a backend that cannot run this shape or build is reported
    there (`res.error`), not fatal."""
    _progress(f"{res.name}: building the trainer ({cfg.model.config['num_layers']} blocks, {rows:,} rows, {device})")
    try:
        run_case(cfg, res, device, repeats, rows, flops, peak)
    except torch.cuda.OutOfMemoryError as exc:
        res.status, res.error = "error", f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - reported with the backend's result
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        res.status, res.error = "error", f"{type(exc).__name__}: {first}"
    _clear_cuda(device)
    _progress(f"{res.name}: {res.error or f'{res.step_time_s:.3f} s, sync check {res.sync_check}'}")


def _fitting_case(
    dims: dict[str, Any],
    fit_blocks: bool,
    clip: Clip,
    dtype: str,
    policy: str,
    seed: int,
    memory_gib: float,
    device: torch.device,
    notes: list[str],
) -> tuple[dict[str, Any], plan.MemoryPlan]:
    """The case's dims and memory plan (`bench_plan`) on `device`; on CUDA with `fit_blocks` (no `--layers`),
    the most blocks of the same widths that fit `memory_gib`, said in `notes`."""
    device_kind = device.type if device.type == "cuda" else "cpu"

    def planned(step_dims: dict[str, Any]) -> plan.MemoryPlan:
        return bench_plan(step_dims, clip, dtype, policy, seed, memory_gib, device_kind)

    step_plan = planned(dims)
    if not fit_blocks or device_kind != "cuda":
        return dims, step_plan
    # An 80 GB card cannot hold the optimizer state of 4 full-width blocks: fewer blocks, same widths.
    blocks = int(dims["num_layers"])
    while blocks > 1 and not step_plan.fits:
        blocks -= 1
        step_plan = planned({**dims, "num_layers": blocks})
    if blocks != dims["num_layers"]:
        notes.append(
            f"{blocks} of {dims['num_layers']} blocks, the most whose float32 master weights, gradients and "
            f"AdamW moments fit in {memory_gib:.1f} GiB"
        )
        dims = {**dims, "num_layers": blocks}
    return dims, step_plan


def _layout_fields(clip: Clip, sample: TrainingSample, rows: Rows) -> dict[str, Any]:
    """The benchmarked sample's layout as the report records it: the clip in pixels, its latents, its rows."""
    return {
        "task": "fl2va",
        "keyframes": ["first", "last"],
        **asdict(clip),
        "latent_frames": sample.geometry.num_latent_frames,
        "latent_height": sample.geometry.latent_height,
        "latent_width": sample.geometry.latent_width,
        "audio_latents": sample.geometry.num_audio_latents,
        **asdict(rows),
        "target_video": rows.video - rows.keyframe,
    }


def run_bench(
    *,
    reduced: bool = False,
    layers: int | None = None,
    backends: str | None = None,
    peak_tflops: float | None = None,
    gradient_checkpointing: str = "auto",
    device_memory_gib: float | None = None,
    plan_only: bool = False,
    parity_tolerance: float | None = None,
    clip: Clip | None = None,
    seed: int = 0,
    device: torch.device | None = None,
    repeats: int = DEFAULT_REPEATS,
) -> BenchReport:
    """Plan the model and layout once, then build and run one trainer per backend (`run_case`).

    `plan_only`: the plan of the case a GPU would run (full width, bfloat16, CUDA's kernels, a device of
    `device_memory_gib`, default `plan.DEFAULT_DEVICE_MEMORY_GIB`), on any machine, without building a model.
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    notes: list[str] = []
    if plan_only:
        if reduced:
            raise ConfigError("bench --plan-only plans the full-width model a GPU runs: drop --reduced")
        report = _planned_report(layers, gradient_checkpointing, device_memory_gib, clip or FULL_CLIP, seed)
        return report
    if not cuda and not reduced:
        reduced = True
        notes.append("no CUDA device: reduced mode")
    dtype_name = "bfloat16" if cuda else "float32"
    names, skipped = select_backends(backends, device, dtype_name)
    notes += skipped
    if layers is not None and layers < 1:
        raise ConfigError(f"bench --layers {layers}: must be at least 1")
    if repeats < 1:
        raise ConfigError(f"bench --repeats {repeats}: must be at least 1")
    clip = clip or (REDUCED_CLIP if reduced else FULL_CLIP)
    _check_clip(clip)
    dims = model_kwargs({**(REDUCED_DIMS if reduced else {}), "num_layers": layers or (2 if reduced else 4)})
    gate = parity_tolerance if parity_tolerance is not None else PARITY_GATE

    sample = clip_sample(clip, int(dims["text_dim"]), seed)
    rows = rows_of(make_training_inputs(sample, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights()))

    memory_gib = (
        torch.cuda.get_device_properties(device).total_memory / GIB
        if cuda
        else device_memory_gib or plan.DEFAULT_DEVICE_MEMORY_GIB
    )
    policy = CHECKPOINTING[gradient_checkpointing]
    dims, step_plan = _fitting_case(dims, layers is None, clip, dtype_name, policy, seed, memory_gib, device, notes)
    if not step_plan.fits:
        notes.append(f"the plan does not fit {memory_gib:.1f} GiB: {summary(step_plan)}")
    flops = step_flops(dims, rows)

    device_name, peak, peak_source = _device_peak(device, peak_tflops)

    report = BenchReport(
        device=device_name,
        mode="reduced" if reduced else "full",
        dtype=dtype_name,
        precision=(CUDA_PRECISION if cuda else "float32 weights, gradients and AdamW state (plain tensors)"),
        gradient_checkpointing=checkpointing_line(step_plan),
        model={k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items()},
        parameters=_parameter_count(dims),
        layout=_layout_fields(clip, sample, rows),
        flops={**asdict(flops), "total": flops.total, "counted": "matmuls; fwd + bwd; recompute not counted"},
        peak_tflops=peak,
        peak_tflops_source=peak_source,
        plan_memory_bytes=step_plan.peak_bytes - step_plan.reserve_bytes,
        plan=plan_fields(step_plan, memory_gib),
        notes=notes,
        step_setup={
            "what": "Trainer.forward_backward + Trainer.update (build_trainer: one rank, sp = 1; "
            f"{'FSDP2 on a one-rank mesh' if cuda else 'plain tensors'}, clip_grad_norm, fused AdamW, one all-reduce)",
            "master_weights": "float32",
            "repeats": repeats,
            "timing": f"median over the timed steps ({repeats}) after one warm-up step; "
            + ("CUDA events on the stream" if cuda else "time.perf_counter"),
        },
    )

    results = {n: BackendResult(name=n, backend=ATTENTION_BACKENDS[n].diffusers) for n in names}
    with tempfile.TemporaryDirectory(prefix="h3train-bench-") as tmp:
        for name in names:
            cfg = trainer_config(dims, clip, dtype_name, policy, name, seed, Path(tmp) / name)
            _run_backend(cfg, results[name], device, repeats, rows.seq_len, flops.total, peak)
        if any(n != REFERENCE_BACKEND for n in names):
            parity = bench_parity(reduced, dims, clip, names, device, seed, Path(tmp) / "parity", gate)
            report.parity, report.parity_model = parity.results, parity.model
        else:
            report.notes.append(f"no gradient parity: only the default backend '{REFERENCE_BACKEND}' ran")
    report.backends = [results[n] for n in names]
    return report
