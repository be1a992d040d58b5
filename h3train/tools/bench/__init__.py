"""`h3train bench`: the trainer's own training step per attention backend, timed half by half.

Per backend it builds a `Trainer` (`run.assemble.build_trainer`, one rank, sp = 1) from a `Config`
made here (`trainer_config`) and times the two halves of `Trainer.train_step`: `forward_backward`
(micro-batch, loss, backward) and `update` (grad norm, clip, the step's one all-reduce and
device->host copy, AdamW, schedule), their sum being the step. It reports packed rows per second,
model FLOPs utilisation against the device's bf16 peak, peak memory, loss and grad norm, whether the
step made a host-device sync beyond its one designed read-back, and every backend's gradients
against a float32 step, in units of `native`'s own error (`parity.py`).

What runs. A `MiniMaxH3Transformer3DModel` at full width (the diffusers defaults: hidden 5376,
56 heads x 128, SwiGLU 14336, text_dim 5120, 2 refiner blocks) with `--layers` blocks, randomly
initialised from the seed, on synthetic FL2VA samples laid out by diffusers' own builder: by default
768x1344 x 124 frames -> 37 latent frames of 24 x 42 rows (37,296 video rows), first and last
keyframes (2 x 1,008 rows), stereo audio (2 x 207 rows) and a 2,048-row text prefix: 41,774 rows.
On CUDA the trainer's FSDP2 policy on a one-rank mesh: float32 master weights, bf16 blocks with the
`_keep_in_fp32_modules` in float32, fused AdamW. On the CPU, float32 plain tensors.

Steps. Step 1 warms up (kernels, autotuning, allocator cache, prefetcher). Every backend's trainer
starts from the same seeded weights and draws the same step-1 sample and noise, so step 1's loss
and grad norm are what compare across kernels (the gradients compare in the parity, after the timed
cases, on trainers of its own). Then `--repeats` timed steps: each half's time is its median, the
step time their sum. One timer (`Clock`) takes every figure: CUDA events on the stream (no host wait
added), or `perf_counter`.

Sync check (CUDA, first timed step; `timed_step`). `forward_backward` runs under
`torch.cuda.set_sync_debug_mode("error")`: anything that would block the host on the device
raises and is reported with its phase and frames; the timing then comes from the next steps.
`update` holds the step's one designed read-back (`reduction.all_reduce_to_host`), so it runs under "warn"
with every sync counted (`read_back_syncs`): one is the design, more is reported as a sync.
Exit status: 0 when every backend ran, made no extra sync and held parity; 1 otherwise; 2 for a bad option.

Memory. 16 bytes per parameter (float32 weight, gradient, two AdamW moments), 2 more for the bf16
compute copy on CUDA, and `plan.activation_bytes` (about 78 GiB for the 4-block default without
checkpointing). `--gradient-checkpointing auto` turns checkpointing on when that plus
`plan.DEFAULT_RESERVE_GIB` exceeds the device (80 GB cards), off on an H200; where even then
`--layers` blocks do not fit, fewer run (a note says how many).

Reduced mode (`--reduced`, and always on CPU): hidden 64, 4 heads x 16, 2 blocks, a 22-frame
128x192 clip (a few hundred rows); the CPU stand-in for flash-vs-native is `math` (SDPA's math kernel)
vs `native`, and the parity runs them in bfloat16 on the CPU. It finishes in seconds so the test suite
runs it.

Parity model. Reduced mode measures parity on the bench's own model. At full width the float32
reference step would not fit beside the bench (and its math kernel's S x S scores never would), so
the parity runs on the GPU checks' model (`gpu_checks.CHECK_DIMS`, `CHECK_CLIP`: hidden 1024,
8 x 128 heads, 2 blocks, 6,658 rows), where the float32 step takes seconds; the report names it.

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
no input gradient and count twice. `tests/cli/test_bench.py` holds this count equal to
`torch.utils.flop_counter` on the reduced model. Recompute under gradient checkpointing is not
model FLOPs and is not counted. MFU = FLOPs / step time / peak.
"""

from __future__ import annotations

from .bench_report import bench_command, format_report, report_from_args, write_json
from .case_setup import FULL_CLIP, REDUCED_CLIP, REDUCED_DIMS, Rows, build_bench_model, rows_of, set_backend
from .cases import (
    DEFAULT_CPU_BACKENDS,
    DEFAULT_CUDA_BACKENDS,
    DEFAULT_REPEATS,
    GIB,
    BackendResult,
    BenchReport,
    run_bench,
    run_case,
    select_backends,
    trainer_config,
)
from .flops import PEAK_BF16_TFLOPS, StepFlops, peak_tflops_for, step_flops
from .parity import FLOAT32_KERNEL, PARITY_GATE, REFERENCE_BACKEND, Parity, ParityRun, backend_parity, bench_parity
from .timing import Clock, SyncError, TimedStep, timed_step

__all__ = [
    "REDUCED_DIMS",
    "FULL_CLIP",
    "REDUCED_CLIP",
    "Rows",
    "rows_of",
    "build_bench_model",
    "set_backend",
    "PEAK_BF16_TFLOPS",
    "StepFlops",
    "step_flops",
    "peak_tflops_for",
    "SyncError",
    "Clock",
    "TimedStep",
    "timed_step",
    "REFERENCE_BACKEND",
    "FLOAT32_KERNEL",
    "PARITY_GATE",
    "Parity",
    "ParityRun",
    "backend_parity",
    "bench_parity",
    "GIB",
    "DEFAULT_CUDA_BACKENDS",
    "DEFAULT_CPU_BACKENDS",
    "DEFAULT_REPEATS",
    "BackendResult",
    "BenchReport",
    "select_backends",
    "trainer_config",
    "run_case",
    "run_bench",
    "format_report",
    "report_from_args",
    "write_json",
    "bench_command",
]
