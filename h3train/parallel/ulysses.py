"""Ulysses sequence parallelism: row split, head/sequence all-to-all, and the gather back.

Gradient contract. Every SP rank computes the identical replicated loss from the gathered outputs.
`gather_rows` returns only the local rows' gradient in backward, so rank r's backward carries the
share of each parameter gradient that its rows produce; the shares sum over the SP group to the true
gradient. FSDP2 reduce-scatters over `dp_shard x sp` with an average, which would divide that sum by
`sp`. `gather_rows` therefore scales the local gradient by `sp`, making the average over the SP ranks
equal to the sum: the true gradient, whatever `sp` is.

Everything before the split (input projections, time embedding, text refiner) runs on the full
sequence on every SP rank; its gradient flows only through the local rows of the split, so the same
contract covers it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


class _SplitRows(torch.autograd.Function):
    """Keep rows `[rank*n, (rank+1)*n)` of dim 1; backward zero-fills the other ranks' rows.

    No communication in backward on purpose: the replicated prefix (projections, refiner) on each
    rank must receive exactly its own rows' gradient, the other rows being accounted on their ranks.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        ctx.rank, ctx.world, ctx.full = rank, world, x.shape[1]
        n = x.shape[1] // world
        return x[:, rank * n : (rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.new_zeros(grad.shape[0], ctx.full, *grad.shape[2:])
        n = grad.shape[1]
        full[:, ctx.rank * n : (ctx.rank + 1) * n] = grad
        return full, None, None


class _GatherRows(torch.autograd.Function):
    """All-gather dim-1 row slices; backward keeps the local slice's gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.world, ctx.scale = dist.get_rank(group), world, scale
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = grad.shape[1] // ctx.world
        local = grad[:, ctx.rank * n : (ctx.rank + 1) * n]
        return local * ctx.scale, None, None


class SequenceParallel:
    """The SP group of this rank and the row arithmetic around it. `group is None` means sp = 1."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def pad(self, x: torch.Tensor, dim: int, value: float = 0) -> torch.Tensor:
        """Pad `dim` up to a multiple of the SP size (no-op at sp = 1)."""
        pad = padded_length(x.shape[dim], self.size) - x.shape[dim]
        if pad == 0:
            return x
        shape = list(x.shape)
        shape[dim] = pad
        return torch.cat([x, x.new_full(shape, value)], dim=dim)

    def local_slice(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's rows of a non-differentiable per-row tensor (indices, rope angles)."""
        n = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * n, n)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S_pad, C]` -> this rank's `[B, S_pad / sp, C]`, differentiable."""
        if not self.enabled:
            return x
        return _SplitRows.apply(x, self.rank, self.size)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S_pad / sp, C]` -> `[B, S_pad, C]`; backward scales by sp (see module docstring)."""
        if not self.enabled:
            return x
        return _GatherRows.apply(x, self.group, float(self.size))

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S/sp, H, D]` -> `[B, S, H/sp, D]`: scatter heads, gather the sequence."""
        if not self.enabled:
            return x
        b, s_local, h, d = x.shape
        # [sp, B, S/sp, H/sp, D]: chunk j of the heads goes to rank j.
        send = x.reshape(b, s_local, self.size, h // self.size, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = all_to_all_single_autograd(send.flatten(0, 1).flatten(1), None, None, self.group)
        recv = recv.view(self.size, b, s_local, h // self.size, d)
        # Received chunk i holds source rank i's rows, so concatenating by source restores row order.
        return recv.permute(1, 0, 2, 3, 4).reshape(b, self.size * s_local, h // self.size, d)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S, H/sp, D]` -> `[B, S/sp, H, D]`: the inverse of `heads_to_sequence`."""
        if not self.enabled:
            return x
        b, s, h_local, d = x.shape
        s_local = s // self.size
        # [sp, B, S/sp, H/sp, D]: row chunk j goes back to rank j.
        send = x.reshape(b, self.size, s_local, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = all_to_all_single_autograd(send.flatten(0, 1).flatten(1), None, None, self.group)
        recv = recv.view(self.size, b, s_local, h_local, d)
        # Received chunk i holds head block i of this rank's rows.
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s_local, self.size * h_local, d)
