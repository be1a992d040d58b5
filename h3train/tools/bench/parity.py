"""Gradients of one attention backend against the reference backend's, per parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...parallel.shards import local_tensor

REFERENCE_BACKEND = "native"

# Relative L2 gradient error allowed between two attention kernels: bf16 rounds every stored
# activation and gradient at 2^-8 relative, float32 at 2^-24.
PARITY_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


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
