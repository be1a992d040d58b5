"""Attention backends' gradients against a float32 step, each measured in units of the default backend's error.

What runs. One training step of the trainer's model (`bench.trainer_config` + `build_trainer`, one
rank): step 1's sample, noise and timesteps, the same seeded weights. First in float32 with SDPA's
math kernel and float32 matmuls at full precision (no TF32): the reference. Then, on a second
trainer in the compute dtype (bfloat16, FSDP2's mixed precision as training runs it; on the CPU too),
the same step once per attention backend, the default (`native`) first.

What is compared. Per parameter p, each backend's error against the reference,
`e_b(p) = ||g_b(p) - g_32(p)||`, is divided by the default backend's own error on that parameter,
floored at `ERROR_FLOOR * eps * ||g_32(p)||` (`eps` the compute dtype's machine epsilon: a parameter
whose default error is about zero does not turn rounding into a large ratio). A backend's figure is
the largest ratio over parameters, `ratio`; `native` has 1 by construction, a kernel as accurate
as `native` about 1. It passes when `ratio <= gate` (`PARITY_GATE`).

Why not the two bfloat16 backends against each other. Their difference is mostly the bfloat16
rounding both carry, not the kernels: on the H200 at full width cuDNN against native differed by
2.1e-2 (relative L2) on block 0's `adaln_proj.linear.weight`, above the 2e-2 that a +0.5 % softmax
scale error passed at 1.1e-2. Against a float32 step every backend carries the same shared
rounding, so a correct kernel's ratio stays near 1 at any width, while a kernel's own error adds to
its numerator only. (The largest shared rounding, the AdaLN tables' gradient sums, is now taken in
float32: `model/adaln.py`.)

The gate. Ratios measured on the bench's reduced model (hidden 64, 4 x 16 heads, 2 blocks, 322
rows) in bfloat16 on the CPU, seeds 0, 1 and 2; the planted kernels are SDPA's math kernel with the
error named, as `tests/unit/test_backend_parity.py` plants them:

    SDPA math kernel                                  1.18 - 1.32
    softmax scale 2 % too large                       2.90 - 3.80
    query gradient dropped on 16 rows of each call    39 - 68

`PARITY_GATE` = 2.0 sits 1.5x above the largest correct kernel's ratio and 1.45x below the smallest
planted bug's (their geometric mean is 1.96).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...ops.attention import ATTENTION_BACKENDS
from ...parallel.shards import local_tensor
from ...tasks.synthetic import Clip
from .case_setup import set_backend

#: The default backend: every backend's error is counted in units of its error.
REFERENCE_BACKEND = "native"
#: The float32 reference step's kernel: SDPA's math kernel (plain matmuls and softmax).
FLOAT32_KERNEL = "math"
#: The compute dtype the backends are compared in.
PARITY_DTYPE = "bfloat16"
#: The largest `ratio` a backend may have (module docstring, "The gate").
PARITY_GATE = 2.0
#: The floor of the default backend's error on a parameter: this fraction of eps times the parameter's
#: reference gradient norm (bfloat16: 4.9e-4 relative; rounding the gradient alone costs about 1.1e-3).
ERROR_FLOOR = 1 / 16


@dataclass
class Parity:
    """One backend's gradients against the float32 step, in units of `reference`'s error (module docstring).

    `ratio`: the largest over parameters of `e_b(p) / max(e_reference(p), floor(p))`, on `worst_parameter`.
    `max_rel_l2`: the largest `e_b(p) / ||g_32(p)||`, on `max_rel_l2_parameter`; `global_rel_l2` the same over
    all parameters together (both for the record: not gated).
    """

    backend: str
    reference: str
    ratio: float
    worst_parameter: str
    max_rel_l2: float
    max_rel_l2_parameter: str
    global_rel_l2: float
    parameters: int
    gate: float
    ok: bool
    error: str | None = None


@dataclass
class ParityRun:
    """Every backend's `Parity` and the model, layout and dtypes they were measured on."""

    model: dict[str, Any]
    results: list[Parity] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(p.ok for p in self.results)


@dataclass
class _Errors:
    """One backend's per-parameter error norms against the reference, and the reference's norms."""

    error: dict[str, float]
    norm: dict[str, float]


def _errors(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> _Errors:
    """`||g - g_32||` and `||g_32||` per parameter of `model`'s gradients; a gradient missing on one side
    only is an infinite error."""
    error, norm = {}, {}
    seen = set()
    for name, p in model.named_parameters():
        ref = reference.get(name)
        if p.grad is None and ref is None:
            continue
        seen.add(name)
        if p.grad is None or ref is None:
            error[name], norm[name] = math.inf, 0.0 if ref is None else float(ref.norm())
            continue
        g = local_tensor(p.grad).detach().float()
        error[name], norm[name] = float((g - ref).norm()), float(ref.norm())
    for name in reference.keys() - seen:
        error[name], norm[name] = math.inf, float(reference[name].norm())
    return _Errors(error, norm)


def compare(backend: str, errors: _Errors, default: _Errors, gate: float, eps: float) -> Parity:
    """`Parity` of `backend` from its errors and the default backend's, per parameter (module docstring)."""
    worst, worst_name, top, top_name = 0.0, "", 0.0, ""
    diff_sq = ref_sq = 0.0
    for name, e in errors.error.items():
        norm = errors.norm[name]
        unit = max(default.error.get(name, math.inf), ERROR_FLOOR * eps * norm)
        ratio = 0.0 if e == 0 else (e / unit if unit > 0 else math.inf)
        rel = 0.0 if e == 0 else (e / norm if norm > 0 else math.inf)
        if ratio > worst or not worst_name:
            worst, worst_name = ratio, name
        if rel > top or not top_name:
            top, top_name = rel, name
        diff_sq, ref_sq = diff_sq + e * e, ref_sq + norm * norm
    return Parity(
        backend=backend,
        reference=REFERENCE_BACKEND,
        ratio=worst,
        worst_parameter=worst_name,
        max_rel_l2=top,
        max_rel_l2_parameter=top_name,
        global_rel_l2=math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else (0.0 if diff_sq == 0 else math.inf),
        parameters=len(errors.error),
        gate=gate,
        ok=worst <= gate,
    )


@contextmanager
def full_float32() -> Iterator[None]:
    """Float32 matmuls at full precision inside the block (no TF32), restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _step(trainer: Any, ti: Any, backend: str) -> None:
    """Step 1's forward and backward on `trainer`'s model with attention backend `backend`, as
    `Trainer.forward_backward` runs it (one micro-batch, one rank: the loss itself), gradients fresh."""
    from ...objective import compute_loss

    set_backend(trainer.model.transformer, ATTENTION_BACKENDS[backend].diffusers)
    trainer.model.zero_grad(set_to_none=True)
    compute_loss(trainer.model, ti.to(trainer.device)).loss.backward()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _progress(message: str) -> None:
    print(f"parity: {message}", file=sys.stderr, flush=True)


def model_summary(dims: dict[str, Any], clip: Clip, rows: int | None, why: str) -> dict[str, Any]:
    """The parity's model as the report names it."""
    return {
        "hidden_size": dims["hidden_size"],
        "heads": dims["num_attention_heads"],
        "head_dim": dims["attention_head_dim"],
        "blocks": dims["num_layers"],
        "clip": f"{clip.height}x{clip.width} x {clip.frames} frames, {clip.text_len} text rows",
        "rows": rows,
        "dtype": PARITY_DTYPE,
        "reference": f"float32 step (attention kernel '{FLOAT32_KERNEL}', no TF32)",
        "why": why,
    }


def _config(dims: dict[str, Any], clip: Clip, dtype: str, seed: int, root: Path) -> Any:
    """The bench's trainer config of `dims` on `clip` in `dtype`, native attention, nothing recomputed."""
    from .case_setup import trainer_config

    return trainer_config(dims, clip, dtype, "none", REFERENCE_BACKEND, seed, root / dtype)


def backend_parity(
    dims: dict[str, Any],
    clip: Clip,
    backends: Sequence[str],
    device: torch.device,
    seed: int,
    root: Path,
    gate: float = PARITY_GATE,
    why: str = "",
) -> ParityRun:
    """`Parity` of each of `backends` (and of `REFERENCE_BACKEND`, run first) on `dims` trained on `clip`
    (module docstring): two trainers, float32 then `PARITY_DTYPE`, one step per backend on the second."""
    from ...run.assemble import build_trainer

    start = time.perf_counter()
    names = [REFERENCE_BACKEND, *(n for n in dict.fromkeys(backends) if n != REFERENCE_BACKEND)]
    eps = torch.finfo(getattr(torch, PARITY_DTYPE)).eps
    run = ParityRun(model_summary(dims, clip, None, why))

    _progress(f"float32 reference ({dims['num_layers']} blocks, hidden {dims['hidden_size']}, {device})")
    trainer = build_trainer(_config(dims, clip, "float32", seed, root), hooks=[])
    try:
        _, ti = trainer.parts.batches.next(1, 0)
        run.model["rows"] = int(ti.model_inputs["position_ids"].shape[0])
        with full_float32():
            _step(trainer, ti, FLOAT32_KERNEL)
        reference = {
            n: local_tensor(p.grad).detach().float().clone()
            for n, p in trainer.model.named_parameters()
            if p.grad is not None
        }
    finally:
        trainer.close()
    _clear(device)

    errors: dict[str, _Errors | str] = {}
    trainer = build_trainer(_config(dims, clip, PARITY_DTYPE, seed, root), hooks=[])
    try:
        for name in names:
            try:
                _step(trainer, ti, name)
            except Exception as exc:  # a kernel that cannot run this shape is reported, not fatal
                errors[name] = _first_line(exc)
            else:
                errors[name] = _errors(trainer.model, reference)
            trainer.model.zero_grad(set_to_none=True)
            _progress(f"{name}: {errors[name] if isinstance(errors[name], str) else 'done'}")
    finally:
        trainer.close()
    del reference
    _clear(device)

    default = errors[REFERENCE_BACKEND]
    for name in names:
        got = errors[name]
        if isinstance(default, str) or isinstance(got, str):
            failed = got if isinstance(got, str) else f"the default backend '{REFERENCE_BACKEND}' failed: {default}"
            run.results.append(
                Parity(name, REFERENCE_BACKEND, math.inf, "", math.inf, "", math.inf, 0, gate, False, failed)
            )
            continue
        run.results.append(compare(name, got, default, gate, eps))
    run.seconds = time.perf_counter() - start
    return run


def _clear(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_parity(
    reduced: bool,
    dims: dict[str, Any],
    clip: Clip,
    backends: Sequence[str],
    device: torch.device,
    seed: int,
    root: Path,
    gate: float = PARITY_GATE,
) -> ParityRun:
    """`h3train bench`'s parity of `backends`: on the bench's model in reduced mode; at full width on the GPU
    checks' model (`sample.CHECK_DIMS` on `CHECK_CLIP`), where the float32 step takes seconds (the
    full-width one would not fit beside the bench, nor would its math kernel's S x S scores)."""
    if reduced:
        return backend_parity(dims, clip, backends, device, seed, root, gate, "the bench's model")
    from ...model.architecture import model_kwargs
    from .case_setup import CHECK_CLIP, CHECK_DIMS

    why = "the GPU checks' model: the full-width float32 step does not fit beside the bench"
    return backend_parity(model_kwargs(CHECK_DIMS), CHECK_CLIP, backends, device, seed, root, gate, why)
