"""`h3train bench`: the trainer's own training step per attention backend, timed half by half.

Per backend it builds a `Trainer` (`train.assemble.build_trainer`, one rank, sp = 1) from a `Config`
made here (`trainer_config`) and times the two halves of `Trainer.train_step`: `forward_backward`
(micro-batch, loss, backward) and `update` (grad norm, clip, the step's one all-reduce and
device->host copy, AdamW, schedule), their sum being the step. It reports packed rows per second,
model FLOPs utilisation against the device's bf16 peak, peak memory, loss and grad norm, whether the
step made a host-device sync beyond its one designed read-back, and every backend's gradients
against `native`'s (relative L2 error per parameter, max over parameters).

What runs. A `MiniMaxH3Transformer3DModel` at full width (the diffusers defaults: hidden 5376,
56 heads x 128, SwiGLU 14336, text_dim 5120, 2 refiner blocks) with `--layers` blocks, randomly
initialised from the seed, on synthetic FL2VA samples laid out by diffusers' own builder: by default
768x1344 x 124 frames -> 37 latent frames of 24 x 42 rows (37,296 video rows), first and last
keyframes (2 x 1,008 rows), stereo audio (2 x 207 rows) and a 2,048-row text prefix: 41,774 rows.
On CUDA the trainer's FSDP2 policy on a one-rank mesh: float32 master weights, bf16 blocks with the
`_keep_in_fp32_modules` in float32, fused AdamW. On the CPU, float32 plain tensors.

Steps. Step 1 warms up (kernels, autotuning, allocator cache, prefetcher). Every backend's trainer
starts from the same seeded weights and draws the same step-1 sample and noise, so step 1's
gradients (read after `forward_backward`, for parity), loss and grad norm are what compare across
kernels. Then `--repeats` timed steps: each half's time is its median, the step time their sum. One
timer (`Clock`) takes every figure: CUDA events on the stream (no host wait added), or `perf_counter`.

Sync check (CUDA, first timed step; `timed_step`). `forward_backward` runs under
`torch.cuda.set_sync_debug_mode("error")`: anything that would block the host on the device
raises and is reported with its phase and frames; the timing then comes from the next steps.
`update` holds the step's one designed read-back (`Trainer._reduce_step`), so it runs under "warn"
with every sync counted (`read_back_syncs`): one is the design, more is reported as a sync.
Exit status: 0 when every backend ran, made no extra sync and held parity; 1 otherwise; 2 for a bad option.

Memory. 16 bytes per parameter (float32 weight, gradient, two AdamW moments), 2 more for the bf16
compute copy on CUDA, and `plan.activation_bytes` (about 78 GiB for the 4-block default without
checkpointing). `--gradient-checkpointing auto` turns checkpointing on when that plus
`plan.DEFAULT_RESERVE_GIB` exceeds the device (80 GB cards), off on an H200; where even then
`--layers` blocks do not fit, fewer run (a note says how many).

Reduced mode (`--reduced`, and always on CPU): hidden 64, 4 heads x 16, 2 blocks, a 22-frame
128x192 clip (a few hundred rows); the CPU stand-in for the flash-vs-native parity is `math` (SDPA's
math kernel) vs `native`. It finishes in seconds so the test suite runs it.

Model FLOPs of one step (matmuls only; norms, rotary, modulation, softmax and the optimizer's
elementwise update are not counted). S packed rows, of which L text, N_v video (keyframes
included), N_a audio; T distinct timesteps; h hidden, a = heads * head_dim, f ffn, n blocks,
n_r refiner blocks, e time_embed_dim, d time_embed_hidden_dim, q freq_dim, P_v = 96 / P_a = 32 the
patch widths, D text_dim. Forward:

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
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
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
from .config import Config, LossWeights, SyntheticDataConfig, TimestepConfig, validate
from .data.format import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK
from .errors import ConfigError
from .host_syncs import cuda_syncs, is_sync
from .model.dims import model_kwargs
from .objective import TrainingInputs, make_training_inputs
from .ops.attention import ATTENTION_BACKENDS, unavailable
from .parallel.fsdp import local_tensor
from .tasks.layout import PackedSample
from .tasks.synthetic import SyntheticSource

GIB = 1024**3

REFERENCE_BACKEND = "native"
DEFAULT_CUDA_BACKENDS = ("flash", "cudnn", "native")
DEFAULT_CPU_BACKENDS = ("native", "math")
DEFAULT_REPEATS = 3

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


def clip_data(clip: Clip, num_samples: int = 1) -> SyntheticDataConfig:
    """Synthetic FL2VA samples of `clip`'s geometry (first + last keyframes, stereo audio).

    The one description of the bench's data: `bench_sample` draws from it for the layout and FLOPs,
    and the trainer of every case trains on it.
    """
    return SyntheticDataConfig(
        num_samples=num_samples,
        text_len=clip.text_len,
        vision_tokens=clip.vision_tokens,
        num_latent_frames=video_latent_num_frames(clip.frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK),
        latent_height=clip.height // 16,
        latent_width=clip.width // 16,
        num_audio_latents=audio_latent_num_frames(clip.frames),
        keyframe_anchors=["first", "last"],
    )


def bench_sample(clip: Clip, text_dim: int, seed: int) -> PackedSample:
    """One random FL2VA sample (first + last keyframes, stereo audio) of `clip`'s geometry."""
    return SyntheticSource(clip_data(clip), text_dim, seed)[0]


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
    """A seeded random model built on `device`, cast to `dtype` except the `_keep_in_fp32_modules`.

    Not the bench's step (that is the trainer's): the FLOP-count test and `bench_memory`'s
    activation measurements need the bare model without a trainer around it.
    """
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
    from .quiet import known_notices

    with known_notices():
        model.set_attention_backend(backend)


@dataclass
class SyncError:
    """Where the step made a host-device sync: the phase and the innermost Python frames."""

    phase: str
    message: str
    frames: list[str]


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


class Clock:
    """Marks on the device's timeline, read once at the end: the one timer of every figure here.

    On CUDA a mark is an event recorded on the current stream: marking makes the host wait for
    nothing, so marks may sit inside the sync check, and the intervals are the device's time. On the
    CPU a mark is `time.perf_counter()`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (on CUDA after waiting for the device); the marks are cleared."""
        marks, self._marks = self._marks, []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


@dataclass
class TimedStep:
    """One step as `timed_step` ran it: the trainer's logged values (None when a sync stopped it),
    each half's seconds, the sync found, and how many syncs `update` made (None when unchecked)."""

    stats: dict[str, float] | None
    forward_backward_s: float
    update_s: float
    sync: SyncError | None = None
    read_back_syncs: int | None = None


def _sync_frames(exc: BaseException) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]


def timed_step(trainer: Any, step: int, clock: Clock, sync_check: bool) -> TimedStep:
    """`trainer.forward_backward(step)`, then `trainer.update(step, ...)`, each half timed on `clock`.

    With `sync_check` (CUDA) the step runs under `torch.cuda.set_sync_debug_mode("error")`: a sync
    in `forward_backward` raises and comes back as `sync` (phase and frames; no stats, no times).
    `update`, which holds the step's one designed device->host copy, runs under "warn" with its
    syncs counted: more than one comes back as `sync`, with the times (a warning stops nothing).
    """
    previous = torch.cuda.get_sync_debug_mode() if sync_check else None
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    sync = None
    try:
        clock.mark()
        grads = trainer.forward_backward(step)
        clock.mark()
        with cuda_syncs(sync_check) as syncs:
            stats = trainer.update(step, grads)
        clock.mark()
    except RuntimeError as exc:
        if not is_sync(exc):
            raise
        # Only strings leave this block: the traceback holds the step's frames and with them its
        # activations, which must be freed before the next step runs.
        sync = SyncError(str(trainer.phase), str(exc).strip().splitlines()[0], _sync_frames(exc))
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode(previous)
    if sync is not None:
        clock.intervals()
        return TimedStep(None, 0.0, 0.0, sync)
    forward_backward_s, update_s = clock.intervals()
    timed = TimedStep(stats, forward_backward_s, update_s, read_back_syncs=len(syncs) if sync_check else None)
    if len(syncs) > 1:
        timed.sync = SyncError(
            f"update of step {step}",
            f"{len(syncs)} host-device syncs where the step's one read-back is designed",
            syncs,
        )
    return timed


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
        grad = local_tensor(p.grad)
        g, r = grad.float(), ref.to(grad.device).float()
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


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients, copied to the CPU (the reference for `grad_parity`)."""
    return {
        n: local_tensor(p.grad).detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None
    }


def select_backends(requested: str | None, device: torch.device, dtype: str) -> tuple[list[str], list[str]]:
    """The backends to run and notes on skipped defaults. An explicit unavailable one is a `ConfigError`."""
    if requested:
        names = [n.strip() for n in requested.split(",") if n.strip()]
        for n in names:
            if n not in ATTENTION_BACKENDS:
                raise ConfigError(
                    f"bench --backends: unknown backend '{n}'; choose from {', '.join(ATTENTION_BACKENDS)}"
                )
            why = unavailable(n, device.type, dtype)
            if why:
                raise ConfigError(f"bench --backends: '{n}' cannot run here: {why}")
        return list(dict.fromkeys(names)), []
    defaults = DEFAULT_CUDA_BACKENDS if device.type == "cuda" else DEFAULT_CPU_BACKENDS
    notes = [f"{n} skipped: {why}" for n in defaults if (why := unavailable(n, device.type, dtype))]
    return [n for n in defaults if not unavailable(n, device.type, dtype)], notes


def _check_clip(clip: Clip) -> None:
    from .tasks.table import FRAME_RULE, is_frame_count

    if not is_frame_count(clip.frames):
        raise ConfigError(f"bench --frames {clip.frames}: must be {FRAME_RULE} (22, 39, ..., 124, ..., 362)")
    for flag, value in (("--height", clip.height), ("--width", clip.width)):
        if value < 32 or value % 32:
            raise ConfigError(f"bench {flag} {value}: must be a positive multiple of 32 (one row is 32x32 pixels)")
    if clip.text_len < 1:
        raise ConfigError(f"bench --text-len {clip.text_len}: must be at least 1")


def trainer_config(
    dims: dict[str, Any], clip: Clip, dtype: str, checkpointing: bool, backend: str, seed: int, log_dir: Path
) -> Config:
    """The `Config` of one bench case: `dims` trained on `clip`'s synthetic samples, one rank, sp = 1.

    A kernel that is not a `model.attention_backend` choice (`math`) is built as `native` and set by
    `run_case` once the trainer is built.
    """
    defaults = model_kwargs({})
    changed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items() if defaults.get(k) != v}
    cfg = Config()
    cfg.model = dataclasses.replace(
        cfg.model,
        config={**changed, "num_layers": int(dims["num_layers"])},
        dtype=dtype,
        activation_checkpointing="full" if checkpointing else "none",
        attention_backend=backend if ATTENTION_BACKENDS[backend].trains else "native",
    )
    cfg.task.name = "fl2va"
    cfg.data = dataclasses.replace(cfg.data, source="synthetic", synthetic=clip_data(clip, num_samples=2))
    cfg.parallel.sp = 1
    cfg.train = dataclasses.replace(cfg.train, steps=1000, grad_accum=1, seed=seed)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=0, resume="none")
    cfg.logging = dataclasses.replace(cfg.logging, dir=str(log_dir), progress=False)
    validate(cfg)
    return cfg


def run_case(
    cfg: Config,
    res: BackendResult,
    device: torch.device,
    repeats: int,
    seq_len: int,
    total_flops: int,
    peak_tflops: float | None,
    reference: dict[str, torch.Tensor] | None,
    tolerance: float,
) -> tuple[dict[str, torch.Tensor] | None, Parity | None]:
    """Build the case's trainer and run it into `res` (module docstring, "Steps" and "Sync check").

    Returns the reference gradients (for `REFERENCE_BACKEND`) or this backend's parity against
    `reference` (when there is one), read after step 1's `forward_backward`.
    """
    from .train.assemble import build_trainer

    trainer = build_trainer(cfg, hooks=[])
    try:
        if not ATTENTION_BACKENDS[res.name].trains:
            set_backend(trainer.model.transformer, res.backend)
        grads = trainer.forward_backward(1)
        gradients, parity = None, None
        if res.name == REFERENCE_BACKEND:
            gradients = _gradients(trainer.model)
        elif reference is not None:
            parity = grad_parity(trainer.model, reference, res.name, tolerance)
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
        return gradients, parity
    finally:
        trainer.close()


def _parameter_count(dims: dict[str, Any]) -> int:
    """Parameters of `MiniMaxH3Transformer3DModel(**dims)`, counted on the meta device (no memory)."""
    from .model.build import meta_transformer

    return sum(p.numel() for p in meta_transformer(dims).parameters())


def _clear_cuda(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _progress(message: str) -> None:
    # stderr, so a run cut short by a time limit still shows how far it got.
    print(f"bench: {message}", file=sys.stderr, flush=True)


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
    repeats: int = DEFAULT_REPEATS,
) -> BenchReport:
    """Plan the model and layout once, then build and run one trainer per backend (`run_case`)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    notes: list[str] = []
    if not cuda and not reduced:
        reduced = True
        notes.append("no CUDA device: reduced mode")
    dtype = torch.bfloat16 if cuda else torch.float32
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
    tolerance = parity_tolerance if parity_tolerance is not None else PARITY_TOLERANCE[dtype]

    sample = bench_sample(clip, int(dims["text_dim"]), seed)
    rows = rows_of(make_training_inputs(sample, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights()))

    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    reserve = int(plan.DEFAULT_RESERVE_GIB * GIB)
    state_bytes = 16 + (2 if cuda else 0)

    def planned(step_dims: dict[str, Any], ckpt: bool) -> int:
        return state_bytes * _parameter_count(step_dims) + plan.activation_bytes(
            step_dims, rows.seq_len, dtype_name, "full" if ckpt else "none", text_rows=clip.text_len
        )

    if gradient_checkpointing == "auto":
        ckpt = total is not None and planned(dims, False) + reserve > total
        if ckpt:
            notes.append(
                f"gradient checkpointing on: the step without it plans {planned(dims, False) / GIB:.1f} GiB "
                f"of {total / GIB:.1f} GiB"
            )
    else:
        ckpt = gradient_checkpointing == "on"
    blocks = int(dims["num_layers"])
    if total is not None:
        # An 80 GB card cannot hold the optimizer state of 4 full-width blocks: fewer blocks, same widths.
        while blocks > 1 and planned({**dims, "num_layers": blocks}, ckpt) + reserve > total:
            blocks -= 1
    if blocks != dims["num_layers"]:
        notes.append(
            f"{blocks} of {dims['num_layers']} blocks, the most whose float32 master weights, gradients and "
            f"AdamW moments fit in {total / GIB:.1f} GiB"
        )
        dims = {**dims, "num_layers": blocks}
    flops = step_flops(dims, rows)

    if cuda:
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
            "float32 master weights; blocks compute in bfloat16 (FSDP2 policy), _keep_in_fp32_modules in float32"
            if cuda
            else "float32 weights, gradients and AdamW state (plain tensors)"
        ),
        gradient_checkpointing=ckpt,
        model={k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items()},
        parameters=_parameter_count(dims),
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
        plan_memory_bytes=planned(dims, ckpt),
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
    # The reference runs first so every other backend can be compared as soon as it has run.
    order = sorted(names, key=lambda n: n != REFERENCE_BACKEND)
    reference: dict[str, torch.Tensor] | None = None
    with tempfile.TemporaryDirectory(prefix="h3train-bench-") as tmp:
        for name in order:
            res = results[name]
            _progress(f"{name}: building the trainer ({dims['num_layers']} blocks, {rows.seq_len:,} rows, {device})")
            cfg = trainer_config(dims, clip, dtype_name, ckpt, name, seed, Path(tmp) / name)
            try:
                gradients, parity = run_case(
                    cfg, res, device, repeats, rows.seq_len, flops.total, peak, reference, tolerance
                )
            except torch.cuda.OutOfMemoryError as exc:
                res.status, res.error = "error", f"out of memory: {str(exc).splitlines()[0]}"
            except Exception as exc:  # a backend that cannot run this shape or build is reported, not fatal
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                res.status, res.error = "error", f"{type(exc).__name__}: {first}"
            else:
                reference = gradients if name == REFERENCE_BACKEND else reference
                if parity is not None:
                    report.parity.append(parity)
            _clear_cuda(device)
            _progress(f"{name}: {res.error or f'{res.step_time_s:.3f} s, sync check {res.sync_check}'}")
    report.backends = [results[n] for n in names]
    if reference is None and len(names) > 1:
        report.notes.append(f"no gradient parity: the reference backend '{REFERENCE_BACKEND}' did not run")
    return report


def _fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def format_report(report: BenchReport) -> str:
    """The readable table `h3train bench` prints."""
    lay = report.layout
    setup = report.step_setup
    lines = [
        f"h3train bench: {report.device}, {report.mode} width, {report.model['num_layers']} blocks "
        f"(+{report.model['num_refiner_layers']} refiner), {report.parameters:,} parameters",
        f"step          {setup.get('what', 'Trainer.forward_backward + Trainer.update')}",
        f"timing        {setup.get('timing', 'n/a')}",
        f"precision     {report.precision}",
        f"checkpointing {'on' if report.gradient_checkpointing else 'off'}",
        f"layout        fl2va {lay['height']}x{lay['width']} x {lay['frames']} frames -> {lay['seq_len']:,} rows = "
        f"{lay['text']:,} text + {lay['keyframe']:,} keyframe + {lay['audio']:,} audio + "
        f"{lay['target_video']:,} video; {lay['timesteps']} distinct timesteps",
        f"model FLOPs   {report.flops['total']:.4g} per step (fwd + bwd, matmuls; see h3train/bench.py)",
        f"peak          {_fmt(report.peak_tflops, '.0f')} TFLOP/s bf16 ({report.peak_tflops_source})",
        f"plan memory   {report.plan_memory_bytes / GIB:.2f} GiB (weights, gradients, AdamW state, activations)",
        "",
        f"{'backend':<8} {'kernel':<14} {'fwd+bwd s':>9} {'update s':>9} {'step s':>9} {'tokens/s':>11} "
        f"{'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'loss':>10}  sync (read-back syncs)",
    ]
    for b in report.backends:
        if b.status != "ok":
            lines.append(f"{b.name:<8} {b.backend:<14} {b.status}: {b.error}")
            continue
        mem = None if b.peak_memory_bytes is None else b.peak_memory_bytes / GIB
        mfu = "n/a" if b.mfu is None else f"{100 * b.mfu:.1f}%"
        back = "" if b.read_back_syncs is None else f" ({b.read_back_syncs})"
        lines.append(
            f"{b.name:<8} {b.backend:<14} {_fmt(b.forward_backward_s, '9.4f'):>9} {_fmt(b.update_s, '9.4f'):>9} "
            f"{b.step_time_s:>9.4f} {b.tokens_per_s:>11,.0f} {b.achieved_tflops:>9.2f} {mfu:>7} "
            f"{_fmt(mem, '.2f'):>9} {b.loss:>10.5f}  {b.sync_check}{back}"
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
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(f"result: {'ok' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def report_from_args(args: argparse.Namespace) -> BenchReport:
    """`run_bench` with the options of `h3train bench`."""
    base = REDUCED_CLIP if args.reduced or not torch.cuda.is_available() else FULL_CLIP
    text_len = args.text_len or base.text_len
    clip = Clip(
        frames=args.frames or base.frames,
        height=args.height or base.height,
        width=args.width or base.width,
        text_len=text_len,
        vision_tokens=text_len // 2,
    )
    return run_bench(
        reduced=args.reduced,
        layers=args.layers,
        backends=args.backends,
        peak_tflops=args.peak_tflops,
        gradient_checkpointing=args.gradient_checkpointing,
        parity_tolerance=args.parity_tol,
        clip=clip,
        seed=args.seed,
        repeats=DEFAULT_REPEATS if args.repeats is None else args.repeats,
    )


def write_json(out: Path, data: dict[str, Any]) -> None:
    """`data` as the bench's JSON file at `out` (atomically), and the line that says where."""
    atomic_write_text(out, json.dumps(data, indent=2, allow_nan=True) + "\n")
    print(f"wrote {out}")


def bench_command(args: argparse.Namespace) -> int:
    """`h3train bench`: 0 when every backend ran without a sync and parity holds, 1 otherwise."""
    report = report_from_args(args)
    print(format_report(report), flush=True)
    if args.out:
        write_json(Path(args.out), report.to_json())
    return 0 if report.ok else 1
