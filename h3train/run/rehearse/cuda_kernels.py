"""Stand-ins, for the CPU rehearsal, of CUDA kernels that keep other tensors for the backward than the
CPU's composites do. The rehearsal runs on the CPU under fake tensors but plans a GPU run: where CUDA
dispatches an op to a fused kernel, what autograd keeps must be the kernel's, not the composite's.

- `nn.RMSNorm`: torch 2.9 and later run it on CUDA as `aten::_fused_rms_norm`, which keeps its input in
  the compute dtype and one float32 rstd per normalised row (2w + 4 bytes a bf16 row of width w); the CPU
  composite keeps a float32 upcast, a float32 normalised copy and the rstd (8w + 4). `FusedRMSNorm`
  computes the same values and keeps what the fused kernel keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class FusedRMSNorm(torch.autograd.Function):
    """`y = x * rstd * weight` over the last `len(shape)` dims, rstd = 1 / sqrt(mean(x^2) + eps) in float32;
    saves `x` as given, `rstd` (float32, one per normalised row) and `weight`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, ndim: int, eps: float) -> torch.Tensor:
        dims = tuple(range(-ndim, 0))
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        y = (x.float() * rstd).to(x.dtype)
        if weight is not None:
            y = y * weight
        ctx.ndim = ndim
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        dims = tuple(range(-ctx.ndim, 0))
        normed = x.float() * rstd
        g = grad.float() * (weight.float() if weight is not None else 1.0)
        # d/dx of x * rstd: rstd * (g - normed * mean(g * normed)).
        dx = rstd * (g - normed * (g * normed).mean(dims, keepdim=True))
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            lead = tuple(range(grad.dim() - weight.dim()))
            dw = (grad.float() * normed).sum(lead).to(weight.dtype)
        return dx.to(x.dtype), dw, None, None


def _fused_forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
    return FusedRMSNorm.apply(x, self.weight, len(self.normalized_shape), eps)


@contextmanager
def cuda_norm_kernels(enabled: bool = True) -> Iterator[None]:
    """Every `nn.RMSNorm` runs as `FusedRMSNorm` inside the block (when `enabled`)."""
    if not enabled:
        yield
        return
    original = nn.RMSNorm.forward
    nn.RMSNorm.forward = _fused_forward
    try:
        yield
    finally:
        nn.RMSNorm.forward = original
