"""`h3train bench`: one training step of H3 per attention backend, measured.

Per backend it reports the step time and packed rows per second, model FLOPs utilisation against
the device's bf16 peak, peak memory, the loss, and whether the step made a host-device sync; the
gradients of every backend are held against those of the `native` backend (relative L2 error per
parameter, max over parameters).

What runs. A `MiniMaxH3Transformer3DModel` at full width (the diffusers defaults: hidden 5376,
56 heads x 128, SwiGLU 14336, text_dim 5120, 2 refiner blocks) with `--layers` transformer blocks,
randomly initialised, on one FL2VA sample laid out by diffusers' own builder
(`tasks.layout.build_layout`): by default 768x1344 x 124 frames -> 37 latent frames of 24 x 42
rows (37,296 video rows), first and last keyframes (2 x 1,008 rows), stereo audio (2 x 207 rows)
and a 2,048-row text prefix: 41,774 packed rows. One step is `compute_loss` through
`SequenceParallelH3` at sp = 1, then `loss.backward()`; no optimizer step.

Precision. On CUDA the model is bfloat16 with the `_keep_in_fp32_modules` (`proj_in`,
`audio_proj_in`, `time_embedder`, `proj_out`, `audio_proj_out`, `rope`) kept float32: the compute
dtypes of the trainer's FSDP2 bf16 policy and of `from_pretrained(torch_dtype=bfloat16)`. No float32
master copy is kept (no optimizer step is taken), so gradients are in the parameter dtype.

Memory. Without gradient checkpointing the 4-block default keeps about 78 GiB of activations
(`plan.activation_bytes`); `--gradient-checkpointing auto` turns checkpointing on when parameters,
gradients, those activations and `plan.DEFAULT_RESERVE_GIB` exceed the device (80 GB cards), off
on an H200. The plan's figure is printed next to the measured peak.

The timed step runs under `torch.cuda.set_sync_debug_mode("error")`, after a warm-up step, with
every input already on the device. Exit status: 0 when every backend ran, made no sync and held
gradient parity; 1 otherwise; 2 for a bad option.

Whole step (`--whole-step`, what `scripts/gpu_check.sh` runs): afterwards, with the bench model
freed, `Trainer.train_step` itself per backend on the same layout: the trainer's FSDP2 policy on a
one-rank mesh (bf16 compute, float32 master weights), gradient clipping, AdamW and the step's one
all-reduce. On CUDA the whole step runs under `set_sync_debug_mode("error")` except
`Trainer._reduce_step`, the step's one designed device->host copy, which runs under "warn" with its
syncs counted (`read_back_syncs`, at most 1 passes). Where 16 bytes per parameter of optimizer state
for `--layers` blocks do not fit the device, the whole step runs fewer blocks (a note says how many).

Reduced mode (`--reduced`, and always on CPU): hidden 64, 4 heads x 16, 2 blocks, a 22-frame
128x192 clip (a few hundred rows), float32 on CPU; the CPU stand-in for the flash-vs-native
parity is `_native_math` vs `native`. It finishes in seconds so the test suite runs it.

Model FLOPs of one step (matmuls only; norms, rotary, modulation and softmax are not counted).
S packed rows, of which L text, N_v video (keyframes included), N_a audio; T distinct timesteps;
h hidden, a = heads * head_dim, f ffn, n blocks, n_r refiner blocks, e time_embed_dim,
d time_embed_hidden_dim, q freq_dim, P_v = 96 / P_a = 32 the patch widths, D text_dim.
Forward:

    blocks        n   * (2 S (4 h a + 3 h f) + 4 S^2 a)    q/k/v/out, SwiGLU; QK^T and PV
    refiner       n_r * (2 L (4 h a + 3 h f) + 4 L^2 a)    over the text rows only
    output heads  2 S h (P_v + P_a)                        both heads run on every row
    inputs        2 h (N_v P_v + N_a P_a + L D)            proj_in, audio_proj_in, context_embedder
    timesteps     2 T (q d + d e + n 18 e h + 2 e h)       time MLP, AdaLN tables, norm_out table

The AdaLN projections run once per distinct timestep, not per row. Training counts each matmul
three times (forward, input gradient, weight gradient), except the four that read data, not
activations (`proj_in`, `audio_proj_in`, `context_embedder`, `time_embedder.linear_1`), which have
no input gradient and count twice. `tests/test_bench.py` holds this count equal to
`torch.utils.flop_counter` on the reduced model. Recompute under gradient checkpointing is not
model FLOPs and is not counted. MFU = FLOPs / step time / peak.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames, video_latent_num_frames

from . import plan
from .atomic import atomic_write_text
from .config import LossWeights, SyntheticDataConfig, TimestepConfig
from .data.format import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK
from .errors import ConfigError
from .model.sp_forward import SequenceParallelH3
from .objective import TrainingInputs, compute_loss, make_training_inputs
from .parallel.ulysses import SequenceParallel
from .preflight import flash_attn_available
from .tasks.layout import PackedSample
from .tasks.synthetic import SyntheticSource

GIB = 1024**3

# Bench name -> diffusers `dispatch_attention_fn` backend. `math` is the CPU stand-in for a second
# kernel: it materialises the S x S scores, so it is only for short sequences.
BACKENDS = {"flash": "flash", "cudnn": "_native_cudnn", "native": "native", "math": "_native_math"}
REFERENCE_BACKEND = "native"
DEFAULT_CUDA_BACKENDS = ("flash", "cudnn", "native")
DEFAULT_CPU_BACKENDS = ("native", "math")

# Dense bf16 tensor-core peak in TFLOP/s, first substring match of `torch.cuda.get_device_name()`.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
)

# Relative L2 gradient error allowed between two attention kernels: bf16 rounds every stored
# activation and gradient at 2^-8 relative, float32 at 2^-24.
PARITY_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}

REDUCED_DIMS: dict[str, Any] = {
    "num_attention_heads": 4,
    "attention_head_dim": 16,  # >= 2 * 3 * rope_freq_dim rotated channels
    "rope_freq_dim": 2,
    "hidden_size": 64,
    "num_refiner_layers": 1,
    "ffn_dim": 128,
    "text_dim": 32,
    "freq_dim": 16,
    "time_embed_hidden_dim": 64,
    "time_embed_dim": 32,
}


@dataclass(frozen=True)
class Clip:
    """The benchmarked FL2VA sample in pixels: `frames` (17 n + 5) of `height` x `width` (multiples of 32).

    `text_len` rows of text prefix, the first `vision_tokens` after the first token tagged video, as
    the keyframes' vision blocks are; the split only decides which AdaLN rows are read.
    """

    frames: int
    height: int
    width: int
    text_len: int
    vision_tokens: int


FULL_CLIP = Clip(frames=124, height=768, width=1344, text_len=2048, vision_tokens=1024)
REDUCED_CLIP = Clip(frames=22, height=128, width=192, text_len=32, vision_tokens=16)


def model_dims(overrides: dict[str, Any]) -> dict[str, Any]:
    """Constructor kwargs of `MiniMaxH3Transformer3DModel`: the diffusers defaults, then `overrides`."""
    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    dims = {name: p.default for name, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    dims.update(overrides)
    return dims


def bench_sample(clip: Clip, text_dim: int, seed: int) -> PackedSample:
    """One random FL2VA sample (first + last keyframes, stereo audio) of `clip`'s geometry."""
    latent_frames = video_latent_num_frames(clip.frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    syn = SyntheticDataConfig(
        num_samples=1,
        text_len=clip.text_len,
        vision_tokens=clip.vision_tokens,
        num_latent_frames=latent_frames,
        latent_height=clip.height // 16,
        latent_width=clip.width // 16,
        num_audio_latents=audio_latent_num_frames(clip.frames),
        keyframe_anchors=["first", "last"],
    )
    return SyntheticSource(syn, text_dim, seed)[0]


@dataclass(frozen=True)
class Rows:
    """Row counts of one packed sequence: `seq_len = text + video + audio`; video includes keyframes."""

    seq_len: int
    text: int
    video: int
    keyframe: int
    audio: int
    timesteps: int


def rows_of(ti: TrainingInputs) -> Rows:
    inputs = ti.model_inputs
    return Rows(
        seq_len=int(inputs["position_ids"].shape[0]),
        text=int(inputs["text_indices"].numel()),
        video=int(inputs["video_indices"].numel()),
        keyframe=int((ti.loss_mask_video == 0).sum()),
        audio=int(inputs["audio_indices"].numel()),
        timesteps=int(inputs["timestep"].numel()),
    )


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one training step (forward + backward), term by term; see the module docstring."""

    blocks_linear: int
    blocks_attention: int
    refiner: int
    output_heads: int
    inputs: int
    timesteps: int

    @property
    def total(self) -> int:
        return (
            self.blocks_linear + self.blocks_attention + self.refiner + self.output_heads + self.inputs + self.timesteps
        )


def step_flops(dims: dict[str, Any], rows: Rows) -> StepFlops:
    """Analytic model FLOPs of `loss.backward()` after one forward over `rows` (module docstring formula)."""
    h, f = int(dims["hidden_size"]), int(dims["ffn_dim"])
    a = int(dims["num_attention_heads"]) * int(dims["attention_head_dim"])
    n, n_r = int(dims["num_layers"]), int(dims["num_refiner_layers"])
    e, d, q = int(dims["time_embed_dim"]), int(dims["time_embed_hidden_dim"]), int(dims["freq_dim"])
    p_v = int(dims["in_channels"]) * math.prod(int(p) for p in dims["patch_size"])
    p_a, text_dim = int(dims["audio_in_channels"]), int(dims["text_dim"])
    s, L, T = rows.seq_len, rows.text, rows.timesteps
    block_weights = 4 * h * a + 3 * h * f
    # Forward matmul FLOPs are 2 per weight per row; training triples them except where noted.
    fwd_inputs = 2 * h * (rows.video * p_v + rows.audio * p_a + L * text_dim)
    fwd_time_in = 2 * T * q * d
    fwd_time_rest = 2 * T * (d * e + n * 18 * e * h + 2 * e * h)
    return StepFlops(
        blocks_linear=3 * n * 2 * s * block_weights,
        blocks_attention=3 * n * 4 * s * s * a,
        refiner=3 * n_r * (2 * L * block_weights + 4 * L * L * a),
        output_heads=3 * 2 * s * h * (p_v + p_a),
        # Data-reading matmuls: forward plus weight gradient only.
        inputs=2 * fwd_inputs,
        timesteps=2 * fwd_time_in + 3 * fwd_time_rest,
    )


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak of a known device (`PEAK_BF16_TFLOPS`), None when the name matches no entry."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def build_bench_model(dims: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    """A seeded random model built on `device`, cast to `dtype` except the `_keep_in_fp32_modules`."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**dims)
    keep = model._keep_in_fp32_modules or []
    for name, child in model.named_children():
        # Substring match, as diffusers applies the list (`proj_in` also covers `audio_proj_in`).
        child.to(torch.float32 if any(k in name for k in keep) else dtype)
    return model


def set_backend(model: MiniMaxH3Transformer3DModel, backend: str) -> None:
    """`model.set_attention_backend` without diffusers' per-call "experimental feature" warning."""
    from diffusers.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        model.set_attention_backend(backend)
    finally:
        dlogging.set_verbosity(level)


@dataclass
class SyncError:
    """Where the step made a host-device sync: the phase and the innermost Python frames."""

    phase: str
    message: str
    frames: list[str]


@dataclass
class _BackendRun:
    """What every per-backend measurement starts with (its fields lead in the JSON)."""

    name: str
    backend: str
    status: str = "ok"  # ok | error | skipped
    error: str | None = None
    step_time_s: float | None = None


@dataclass
class BackendResult(_BackendRun):
    tokens_per_s: float | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    loss: float | None = None
    # ok | sync (a sync was caught; timing comes from a rerun without the check) | n/a (CPU)
    sync_check: str = "n/a"
    sync_error: SyncError | None = None


@dataclass
class Parity:
    """Gradients of `backend` against the reference: `||g - g_ref|| / ||g_ref||` per parameter."""

    backend: str
    reference: str
    max_rel_l2: float
    worst_parameter: str
    global_rel_l2: float
    parameters: int
    tolerance: float
    ok: bool


@dataclass
class StepCheck(_BackendRun):
    """One whole training step, `Trainer.train_step`, with one attention backend (`--whole-step`)."""

    achieved_tflops: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    # ok | sync (a sync outside the step's one read-back; timing from a rerun without the check) | n/a (CPU)
    sync_check: str = "n/a"
    sync_error: SyncError | None = None
    # Syncs inside `Trainer._reduce_step`, the step's one designed read-back (counted, not an error).
    read_back_syncs: int | None = None


@dataclass
class BenchReport:
    device: str
    mode: str
    dtype: str
    precision: str
    gradient_checkpointing: bool
    model: dict[str, Any]
    parameters: int
    layout: dict[str, Any]
    flops: dict[str, Any]
    peak_tflops: float | None
    peak_tflops_source: str
    plan_memory_bytes: int
    backends: list[BackendResult] = field(default_factory=list)
    parity: list[Parity] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # `--whole-step`: the trainer's step per backend, and how it was set up.
    steps: list[StepCheck] = field(default_factory=list)
    step_setup: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        ran = [b for b in self.backends if b.status != "skipped"]
        return (
            bool(ran)
            and all(b.status == "ok" and b.sync_check != "sync" for b in ran)
            and all(p.ok for p in self.parity)
            and all(s.status == "ok" and s.sync_check != "sync" and (s.read_back_syncs or 0) <= 1 for s in self.steps)
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _train_step(forward: SequenceParallelH3, ti: TrainingInputs, phase: list[str]) -> torch.Tensor:
    """Loss and `backward()` of one micro-batch; `phase[0]` names the part running, for sync reports."""
    phase[0] = "forward and loss (compute_loss)"
    parts = compute_loss(forward, ti)
    phase[0] = "backward"
    parts.loss.backward()
    return parts.loss.detach()


def _clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _sync_frames(exc: BaseException) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]


def _timed_step(
    forward: SequenceParallelH3, ti: TrainingInputs, device: torch.device, sync_check: bool
) -> tuple[torch.Tensor | None, float, SyncError | None]:
    """Run one step: `(loss, seconds, None)`, seconds from CUDA events (the wall clock on CPU).

    With `sync_check` the step runs under `torch.cuda.set_sync_debug_mode("error")`: any operation
    that would block the host on the device (`.item()`, a device-to-host copy, a synchronising
    allocator call) raises instead, and the step returns `(None, 0.0, where)`. The events are
    recorded on the stream, so the timing itself adds no sync.
    """
    phase = ["setup"]
    if device.type != "cuda":
        start = time.perf_counter()
        loss = _train_step(forward, ti, phase)
        return loss, time.perf_counter() - start, None
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    previous = torch.cuda.get_sync_debug_mode()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    sync = None
    try:
        loss = _train_step(forward, ti, phase)
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        # Only strings leave this block: the traceback holds the step's frames and with them its
        # activations, which must be freed before the step is run again.
        sync = SyncError(phase[0], str(exc).strip().splitlines()[0], _sync_frames(exc))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    if sync is not None:
        torch.cuda.synchronize(device)
        return None, 0.0, sync
    end.record()
    torch.cuda.synchronize(device)
    return loss, start.elapsed_time(end) / 1000.0, None


def grad_parity(model: torch.nn.Module, reference: dict[str, torch.Tensor], backend: str, tolerance: float) -> Parity:
    """Per-parameter relative L2 error of `model`'s gradients against `reference` (kept on the CPU)."""
    worst, worst_name = 0.0, ""
    diff_sq = ref_sq = 0.0
    for name, p in model.named_parameters():
        ref = reference.get(name)
        if p.grad is None or ref is None:
            if p.grad is None and ref is None:
                continue
            worst, worst_name = math.inf, name
            continue
        g, r = p.grad.float(), ref.to(p.grad.device).float()
        d2, r2 = float((g - r).square().sum()), float(r.square().sum())
        diff_sq, ref_sq = diff_sq + d2, ref_sq + r2
        rel = math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    global_rel = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0
    return Parity(
        backend=backend,
        reference=REFERENCE_BACKEND,
        max_rel_l2=worst,
        worst_parameter=worst_name,
        global_rel_l2=global_rel,
        parameters=len(reference),
        tolerance=tolerance,
        ok=worst <= tolerance,
    )


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why bench backend `name` cannot run on `device`, or None."""
    if name in ("flash", "cudnn") and device.type != "cuda":
        return "needs a CUDA device"
    if name == "flash" and not flash_attn_available():
        return "flash-attn is not installed (the 'flash' extra)"
    return None


def select_backends(requested: str | None, device: torch.device) -> tuple[list[str], list[str]]:
    """The backends to run and notes on skipped defaults. An explicit unavailable one is a `ConfigError`."""
    if requested:
        names = [n.strip() for n in requested.split(",") if n.strip()]
        for n in names:
            if n not in BACKENDS:
                raise ConfigError(f"bench --backends: unknown backend '{n}'; choose from {', '.join(BACKENDS)}")
            why = _unavailable(n, device)
            if why:
                raise ConfigError(f"bench --backends: '{n}' {why}")
        return list(dict.fromkeys(names)), []
    defaults = DEFAULT_CUDA_BACKENDS if device.type == "cuda" else DEFAULT_CPU_BACKENDS
    notes = [f"{n} skipped: {why}" for n in defaults if (why := _unavailable(n, device))]
    return [n for n in defaults if not _unavailable(n, device)], notes


def _check_clip(clip: Clip) -> None:
    if clip.frames < VAE_LATENTS_PER_CHUNK or clip.frames % VAE_FRAMES_PER_CHUNK != VAE_LATENTS_PER_CHUNK:
        raise ConfigError(f"bench --frames {clip.frames}: must be 17 n + 5 (22, 39, ..., 124, ..., 362)")
    for flag, value in (("--height", clip.height), ("--width", clip.width)):
        if value < 32 or value % 32:
            raise ConfigError(f"bench {flag} {value}: must be a positive multiple of 32 (one row is 32x32 pixels)")
    if clip.text_len < 1:
        raise ConfigError(f"bench --text-len {clip.text_len}: must be at least 1")


def run_bench(
    *,
    reduced: bool = False,
    layers: int | None = None,
    backends: str | None = None,
    peak_tflops: float | None = None,
    gradient_checkpointing: str = "auto",
    parity_tolerance: float | None = None,
    clip: Clip | None = None,
    seed: int = 0,
    device: torch.device | None = None,
    whole_step: bool = False,
) -> BenchReport:
    """Build the model and the sample once, then warm-up and time one step per backend.

    `whole_step`: afterwards, with the bench model freed, time `Trainer.train_step` per backend too
    (`run_whole_steps`).
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    notes: list[str] = []
    if device.type != "cuda" and not reduced:
        reduced = True
        notes.append("no CUDA device: reduced mode")
    names, skipped = select_backends(backends, device)
    notes += skipped
    if layers is not None and layers < 1:
        raise ConfigError(f"bench --layers {layers}: must be at least 1")
    clip = clip or (REDUCED_CLIP if reduced else FULL_CLIP)
    _check_clip(clip)
    dims = model_dims({**(REDUCED_DIMS if reduced else {}), "num_layers": layers or (2 if reduced else 4)})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    tolerance = parity_tolerance if parity_tolerance is not None else PARITY_TOLERANCE[dtype]

    sample = bench_sample(clip, int(dims["text_dim"]), seed)
    ti = make_training_inputs(sample, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights())
    rows = rows_of(ti)
    ti = ti.to(device)
    flops = step_flops(dims, rows)

    _progress(f"building a {dims['num_layers']}-block model on {device} for {rows.seq_len:,} rows")
    model = build_bench_model(dims, device, dtype, seed)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def planned(ckpt: bool) -> int:
        # Parameters, their gradients, and plan.py's activation model for the block stack.
        return 2 * param_bytes + plan.activation_bytes(dims, rows.seq_len, dtype_name, ckpt)

    if gradient_checkpointing == "auto":
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        ckpt = total is not None and planned(False) + int(plan.DEFAULT_RESERVE_GIB * GIB) > total
        if ckpt:
            notes.append(
                f"gradient checkpointing on: the step without it plans {planned(False) / GIB:.1f} GiB "
                f"of {total / GIB:.1f} GiB"
            )
    else:
        ckpt = gradient_checkpointing == "on"

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        table_peak = peak_tflops_for(device_name)
        peak, peak_source = (
            (peak_tflops, "--peak-tflops")
            if peak_tflops
            else (
                table_peak,
                f"table entry for '{device_name}'" if table_peak else "unknown device: pass --peak-tflops",
            )
        )
    else:
        device_name, peak, peak_source = "cpu", peak_tflops, "--peak-tflops" if peak_tflops else "not applicable on CPU"

    report = BenchReport(
        device=device_name,
        mode="reduced" if reduced else "full",
        dtype=dtype_name,
        precision=(
            f"parameters {dtype_name}, _keep_in_fp32_modules float32; gradients in the parameter dtype; "
            "no master copy or optimizer step"
        ),
        gradient_checkpointing=ckpt,
        model={k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items()},
        parameters=n_params,
        layout={
            "task": "fl2va",
            "keyframes": ["first", "last"],
            **asdict(clip),
            "latent_frames": sample.geometry.num_latent_frames,
            "latent_height": sample.geometry.latent_height,
            "latent_width": sample.geometry.latent_width,
            "audio_latents": sample.geometry.num_audio_latents,
            **asdict(rows),
            "target_video": rows.video - rows.keyframe,
        },
        flops={**asdict(flops), "total": flops.total, "counted": "matmuls; fwd + bwd; recompute not counted"},
        peak_tflops=peak,
        peak_tflops_source=peak_source,
        plan_memory_bytes=planned(ckpt),
        notes=notes,
    )

    results = {n: BackendResult(name=n, backend=BACKENDS[n]) for n in names}
    # The reference runs first so every other backend can be compared as soon as it has run.
    order = sorted(names, key=lambda n: n != REFERENCE_BACKEND)
    reference: dict[str, torch.Tensor] | None = None
    for name in order:
        res = results[name]
        try:
            grads = _run_backend(model, ti, device, ckpt, res, flops.total, rows.seq_len, peak)
        except torch.cuda.OutOfMemoryError as exc:
            res.status, res.error = "error", f"out of memory: {str(exc).splitlines()[0]}"
        except Exception as exc:  # a backend that cannot run this shape or build is reported, not fatal
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            res.status, res.error = "error", f"{type(exc).__name__}: {first}"
        else:
            if name == REFERENCE_BACKEND:
                reference = grads
            elif reference is not None:
                try:
                    report.parity.append(grad_parity(model, reference, name, tolerance))
                except Exception as exc:  # e.g. out of memory for the float32 copies: the figures above stand
                    res.status, res.error = "error", f"gradient parity: {type(exc).__name__}: {exc}".splitlines()[0]
        _clear_grads(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _progress(f"{name}: {res.error or f'{res.step_time_s:.3f} s, sync check {res.sync_check}'}")
    report.backends = [results[n] for n in names]
    if reference is None and len(names) > 1:
        report.notes.append(f"no gradient parity: the reference backend '{REFERENCE_BACKEND}' did not run")
    if whole_step:
        # The trainer builds its own (float32 master) copy: the bench model and its gradients go first.
        del model, reference
        _clear_cuda(device)
        run_whole_steps(report, names, dims, clip, rows, flops.total, peak, gradient_checkpointing, device)
    return report


def _clear_cuda(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _parameter_count(dims: dict[str, Any]) -> int:
    """Parameters of `MiniMaxH3Transformer3DModel(**dims)`, counted on the meta device (no memory)."""
    from .model.build import meta_transformer

    return sum(p.numel() for p in meta_transformer(dims).parameters())


def trainer_config(dims: dict[str, Any], clip: Clip, dtype_name: str, checkpointing: bool, log_dir: Path):
    """A `Config` whose `Trainer` trains `dims` on `clip`'s synthetic FL2VA sample, one rank, sp = 1."""
    from .config import load_config

    defaults = model_dims({})
    changed = {k: v for k, v in dims.items() if defaults.get(k) != v}
    latent_frames = video_latent_num_frames(clip.frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    overrides = [
        *(f"model.config.{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in changed.items()),
        f"model.dtype={dtype_name}",
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
        "model.attention_backend=native",
        "task.name=fl2va",
        "data.source=synthetic",
        "data.synthetic.num_samples=2",
        f"data.synthetic.text_len={clip.text_len}",
        f"data.synthetic.vision_tokens={clip.vision_tokens}",
        f"data.synthetic.num_latent_frames={latent_frames}",
        f"data.synthetic.latent_height={clip.height // 16}",
        f"data.synthetic.latent_width={clip.width // 16}",
        f"data.synthetic.num_audio_latents={audio_latent_num_frames(clip.frames)}",
        "data.synthetic.keyframe_anchors=[first,last]",
        "parallel.sp=1",
        "train.grad_accum=1",
        "train.steps=1000",
        "checkpoint.every=0",
        f"logging.dir={log_dir}",
        "logging.progress=false",
    ]
    return load_config(None, overrides)


def _whole_step(trainer: Any, step: int, device: torch.device, sync_check: bool):
    """`trainer.train_step(step)`: `(stats, seconds, sync error or None, syncs in the read-back or None)`.

    With `sync_check` (CUDA) the whole step runs under `torch.cuda.set_sync_debug_mode("error")`,
    except `Trainer._reduce_step`, the step's one designed device->host copy: it runs under "warn"
    and its syncs are counted (one is the design). Anything else that syncs raises and is reported.
    """
    if device.type != "cuda":
        start = time.perf_counter()
        stats = trainer.train_step(step)
        return stats, time.perf_counter() - start, None, None
    import warnings

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    previous = torch.cuda.get_sync_debug_mode()
    read_back = getattr(trainer, "_reduce_step", None)
    counted = [0] if read_back is not None else None

    def exempt(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return read_back(*args, **kwargs)
            finally:
                counted[0] += sum("synchroniz" in str(w.message).lower() for w in caught)
                torch.cuda.set_sync_debug_mode("error")

    sync, stats = None, None
    start.record()
    if sync_check:
        if read_back is not None:
            trainer._reduce_step = exempt
        torch.cuda.set_sync_debug_mode("error")
    try:
        stats = trainer.train_step(step)
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        sync = SyncError(
            str(getattr(trainer, "phase", "train_step")), str(exc).strip().splitlines()[0], _sync_frames(exc)
        )
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        trainer.__dict__.pop("_reduce_step", None)
    end.record()
    torch.cuda.synchronize(device)
    if sync is not None:
        return None, 0.0, sync, counted[0] if counted else None
    return stats, start.elapsed_time(end) / 1000.0, None, (counted[0] if counted and sync_check else None)


def run_whole_steps(
    report: BenchReport,
    names: list[str],
    dims: dict[str, Any],
    clip: Clip,
    rows: Rows,
    total_flops: int,
    peak_tflops: float | None,
    gradient_checkpointing: str,
    device: torch.device,
) -> None:
    """Time `Trainer.train_step` (on CUDA FSDP2 on a one-rank mesh for its bf16 policy; grad clip,
    AdamW, its one all-reduce and read-back) per backend into `report.steps`: warm-up, then a
    checked step (`_whole_step`).

    The trainer keeps float32 master weights, gradients and two AdamW moments (16 bytes per
    parameter) beside the bf16 compute copy; "auto" checkpointing counts them against the device.
    """
    import tempfile

    from .train.trainer import Trainer

    cuda = device.type == "cuda"
    dtype_name = "bfloat16" if cuda else "float32"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    reserve = int(plan.DEFAULT_RESERVE_GIB * GIB)

    def need(step_dims: dict[str, Any], ckpt: bool) -> int:
        # float32 master weight, gradient, two AdamW moments (16 B) and the bf16 compute copy (2 B).
        return 18 * _parameter_count(step_dims) + plan.activation_bytes(step_dims, rows.seq_len, dtype_name, ckpt)

    if gradient_checkpointing == "auto":
        ckpt = total is not None and need(dims, False) + reserve > total
    else:
        ckpt = gradient_checkpointing == "on"
    layers = int(dims["num_layers"])
    if total is not None:
        # An 80 GB card cannot hold the optimizer state of 4 full-width blocks: fewer blocks, same widths.
        while layers > 1 and need({**dims, "num_layers": layers}, ckpt) + reserve > total:
            layers -= 1
    if layers != dims["num_layers"]:
        report.notes.append(
            f"whole step: {layers} of {dims['num_layers']} blocks, the most whose float32 master weights, "
            f"gradients and AdamW moments fit in {total / GIB:.1f} GiB"
        )
        dims = {**dims, "num_layers": layers}
        total_flops = step_flops(dims, rows).total
    report.step_setup = {
        # One rank in float32 (the CPU) trains plain tensors: FSDP2 would only copy them (`shards_nothing`).
        "what": f"Trainer.train_step: {'FSDP2 (one-rank mesh)' if cuda else 'plain tensors'}, clip_grad_norm_, "
        "fused AdamW, one all-reduce",
        "dtype": dtype_name,
        "master_weights": "float32",
        "gradient_checkpointing": ckpt,
        "num_layers": layers,
        "flops": total_flops,
        "plan_memory_bytes": need(dims, ckpt),
    }
    _progress(f"whole step: building the trainer ({'checkpointing' if ckpt else 'no checkpointing'})")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(trainer_config(dims, clip, dtype_name, ckpt, Path(tmp)), hooks=[])
        try:
            step = 0
            for name in names:
                res = StepCheck(name=name, backend=BACKENDS[name])
                try:
                    set_backend(trainer.model.transformer, res.backend)
                    step += 1
                    _whole_step(trainer, step, device, sync_check=False)  # warm-up
                    if cuda:
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    step += 1
                    stats, seconds, sync, read_back = _whole_step(trainer, step, device, sync_check=cuda)
                    res.sync_check, res.read_back_syncs = ("ok" if cuda else "n/a"), read_back
                    if sync is not None:
                        res.sync_check, res.sync_error = "sync", sync
                        step += 1
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(device)
                        stats, seconds, _, _ = _whole_step(trainer, step, device, sync_check=False)
                    res.step_time_s = seconds
                    res.achieved_tflops = total_flops / seconds / 1e12
                    res.mfu = res.achieved_tflops / peak_tflops if peak_tflops else None
                    res.loss, res.grad_norm = float(stats["loss"]), float(stats["grad_norm"])
                    if cuda:
                        res.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
                except torch.cuda.OutOfMemoryError as exc:
                    res.status, res.error = "error", f"out of memory: {str(exc).splitlines()[0]}"
                except Exception as exc:  # reported per backend, like the forward/backward rows
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    res.status, res.error = "error", f"{type(exc).__name__}: {first}"
                report.steps.append(res)
                _progress(f"whole step {name}: {res.error or f'{res.step_time_s:.3f} s, sync check {res.sync_check}'}")
                _clear_cuda(device)
        finally:
            trainer.close()


def _run_backend(
    model: MiniMaxH3Transformer3DModel,
    ti: TrainingInputs,
    device: torch.device,
    ckpt: bool,
    res: BackendResult,
    total_flops: int,
    seq_len: int,
    peak_tflops: float | None,
) -> dict[str, torch.Tensor] | None:
    """Warm-up and timed step of one backend into `res`; returns the gradients (on the CPU) for the reference."""
    _clear_grads(model)
    set_backend(model, res.backend)
    # Wrapped after the backend is set: at sp > 1 the Ulysses processors copy it when built.
    forward = SequenceParallelH3(model, SequenceParallel(None), gradient_checkpointing=ckpt)
    _timed_step(forward, ti, device, sync_check=False)  # warm-up: kernels, autotuning, allocator cache
    _clear_grads(model)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    loss, seconds, sync = _timed_step(forward, ti, device, sync_check=cuda)
    res.sync_check = "ok" if cuda else "n/a"
    if sync is not None:
        # Reported, then timed again without the check so the other figures still come out.
        res.sync_check, res.sync_error = "sync", sync
        _clear_grads(model)
        torch.cuda.reset_peak_memory_stats(device)
        loss, seconds, _ = _timed_step(forward, ti, device, sync_check=False)
    res.step_time_s = seconds
    res.tokens_per_s = seq_len / seconds
    res.achieved_tflops = total_flops / seconds / 1e12
    res.mfu = res.achieved_tflops / peak_tflops if peak_tflops else None
    res.loss = float(loss)
    if device.type == "cuda":
        res.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    if res.name == REFERENCE_BACKEND:
        return {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    return None


def _progress(message: str) -> None:
    # stderr, so a run cut short by a time limit still shows how far it got.
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def format_report(report: BenchReport) -> str:
    """The readable table `h3train bench` prints."""
    lay = report.layout
    lines = [
        f"h3train bench: {report.device}, {report.mode} width, {report.model['num_layers']} blocks "
        f"(+{report.model['num_refiner_layers']} refiner), {report.parameters:,} parameters",
        f"precision     {report.precision}",
        f"checkpointing {'on' if report.gradient_checkpointing else 'off'}",
        f"layout        fl2va {lay['height']}x{lay['width']} x {lay['frames']} frames -> {lay['seq_len']:,} rows = "
        f"{lay['text']:,} text + {lay['keyframe']:,} keyframe + {lay['audio']:,} audio + "
        f"{lay['target_video']:,} video; {lay['timesteps']} distinct timesteps",
        f"model FLOPs   {report.flops['total']:.4g} per step (fwd + bwd, matmuls; see h3train/bench.py)",
        f"peak          {_fmt(report.peak_tflops, '.0f')} TFLOP/s bf16 ({report.peak_tflops_source})",
        f"plan memory   {report.plan_memory_bytes / GIB:.2f} GiB (parameters + gradients + plan.py activations)",
        "",
        f"{'backend':<8} {'kernel':<14} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>9} {'MFU':>7} "
        f"{'peak GiB':>9} {'loss':>10}  sync",
    ]
    for b in report.backends:
        if b.status != "ok":
            lines.append(f"{b.name:<8} {b.backend:<14} {b.status}: {b.error}")
            continue
        mem = None if b.peak_memory_bytes is None else b.peak_memory_bytes / GIB
        mfu = "n/a" if b.mfu is None else f"{100 * b.mfu:.1f}%"
        lines.append(
            f"{b.name:<8} {b.backend:<14} {b.step_time_s:>9.4f} {b.tokens_per_s:>11,.0f} {b.achieved_tflops:>9.2f} "
            f"{mfu:>7} {_fmt(mem, '.2f'):>9} {b.loss:>10.5f}  "
            f"{b.sync_check}"
        )
        if b.sync_error:
            lines.append(f"  host-device sync during {b.sync_error.phase}: {b.sync_error.message}")
            lines.extend(f"    at {frame}" for frame in b.sync_error.frames)
    if report.parity:
        lines.append("")
        lines.append(f"gradient parity vs {REFERENCE_BACKEND} (relative L2 per parameter, max over parameters)")
        for p in report.parity:
            lines.append(
                f"  {p.backend:<8} max {p.max_rel_l2:.3e} ({p.worst_parameter}), all {p.global_rel_l2:.3e}; "
                f"tolerance {p.tolerance:.0e}: {'ok' if p.ok else 'FAILED'}"
            )
    if report.steps:
        setup = report.step_setup
        lines.append("")
        lines.append(
            f"whole step ({setup.get('what', 'Trainer.train_step')}; {setup.get('num_layers')} blocks, "
            f"{setup.get('dtype')} compute, float32 master weights, "
            f"checkpointing {'on' if setup.get('gradient_checkpointing') else 'off'}, "
            f"plan {setup.get('plan_memory_bytes', 0) / GIB:.1f} GiB)"
        )
        lines.append(
            f"{'backend':<8} {'step s':>9} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'loss':>10}  "
            "sync (read-back syncs)"
        )
        for st in report.steps:
            if st.status != "ok":
                lines.append(f"{st.name:<8} {st.status}: {st.error}")
                continue
            mem = None if st.peak_memory_bytes is None else st.peak_memory_bytes / GIB
            mfu = "n/a" if st.mfu is None else f"{100 * st.mfu:.1f}%"
            back = "" if st.read_back_syncs is None else f" ({st.read_back_syncs})"
            lines.append(
                f"{st.name:<8} {st.step_time_s:>9.4f} {st.achieved_tflops:>9.2f} {mfu:>7} {_fmt(mem, '.2f'):>9} "
                f"{st.loss:>10.5f}  {st.sync_check}{back}"
            )
            if st.sync_error:
                lines.append(f"  host-device sync during {st.sync_error.phase}: {st.sync_error.message}")
                lines.extend(f"    at {frame}" for frame in st.sync_error.frames)
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(f"result: {'ok' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def bench_command(args: argparse.Namespace) -> int:
    """`h3train bench`: 0 when every backend ran without a sync and parity holds, 1 otherwise."""
    base = REDUCED_CLIP if args.reduced or not torch.cuda.is_available() else FULL_CLIP
    text_len = args.text_len or base.text_len
    clip = Clip(
        frames=args.frames or base.frames,
        height=args.height or base.height,
        width=args.width or base.width,
        text_len=text_len,
        vision_tokens=text_len // 2,
    )
    report = run_bench(
        reduced=args.reduced,
        layers=args.layers,
        backends=args.backends,
        peak_tflops=args.peak_tflops,
        gradient_checkpointing=args.gradient_checkpointing,
        parity_tolerance=args.parity_tol,
        clip=clip,
        seed=args.seed,
        whole_step=getattr(args, "whole_step", False),
    )
    print(format_report(report), flush=True)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out, json.dumps(report.to_json(), indent=2, allow_nan=True) + "\n")
        print(f"wrote {out}")
    return 0 if report.ok else 1
