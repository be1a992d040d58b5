"""Ulysses sequence parallelism: row split, head/sequence all-to-all, and the gather back.

Gradient contract. Every SP rank computes the identical replicated loss from the gathered outputs.
`gather` returns only the local rows' gradient in backward, so rank r's backward carries the share
of each parameter gradient that its rows produce; the shares sum over the SP group to the true
gradient. FSDP2 reduce-scatters over `dp_shard x sp` with an average, which would divide that sum by
`sp`. `gather` therefore scales the local gradient by `sp`, making the average over the SP ranks
equal to the sum: the true gradient, whatever `sp` is.

Everything before the split (input projections, time embedding, text refiner) runs on the full
sequence on every SP rank; `local_rows` picks only this rank's rows out of it, so its gradient
flows through the local rows alone and the same contract covers it.

Communication per block and step: one all-to-all carries q, k and v together and one carries the
attention output back, in forward and again in backward (4 in all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


class _AllToAll(torch.autograd.Function):
    """An even all-to-all of dim-0 chunks, waited in forward and in backward (its own inverse).

    torch's `all_to_all_single_autograd` lost the backward's exchange inside a compiled block on
    torch 2.8 (every gradient upstream of attention came back wrong); this function issues each
    exchange, forward and backward, as a functional collective followed by its wait.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return wait_tensor(all_to_all_single(x, None, None, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return wait_tensor(all_to_all_single(grad.contiguous(), None, None, ctx.group)), None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of `x`'s dim 0 to rank j of `group`, chunk i received from rank i (even chunks); its
    backward is the same exchange of the gradients."""
    return _AllToAll.apply(x, group)


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
        """This rank's rows of a non-differentiable per-row tensor (indices, positions), as a copy.

        A copy, not a view: a view would keep the full-length storage alive for as long as the
        slice is saved for backward (an index of `index_select`, the AdaLN indices of every block).
        """
        n = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * n, n).clone()

    def local_rows(self, seq_len: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's rows `[B, S_pad / sp, C]` of a packed sequence of `seq_len` rows.

        Each `(source [B, N, C], indices [N])` pair puts `source[:, i]` at row `indices[i]`; padding
        rows are zero. Only this rank's rows are selected: no view of the full sequence survives,
        and `index_select` saves its index, not its full-length source. So backward carries only
        this rank's rows' share, with no communication: the other rows are accounted on their own
        ranks. No host sync either (no data-dependent shapes).
        """
        first = parts[0][0]
        zero_row = first.new_zeros(first.shape[0], 1, first.shape[-1])
        sources = torch.cat([*(source.to(first.dtype) for source, _ in parts), zero_row], dim=1)
        # Row j of the padded sequence reads row `source_row[j]` of `sources`; padding reads the zero row.
        source_row = torch.full(
            (padded_length(seq_len, self.size),), sources.shape[1] - 1, dtype=torch.long, device=first.device
        )
        offset = 0
        for source, indices in parts:
            source_row[indices] = torch.arange(offset, offset + source.shape[1], device=first.device)
            offset += source.shape[1]
        return sources.index_select(1, self.local_slice(source_row))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S_pad / sp, C]` -> `[B, S_pad, C]`; backward scales by sp (see module docstring)."""
        if not self.enabled:
            return x
        return _GatherRows.apply(x, self.group, float(self.size))

    def heads_to_sequence(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each `[B, S/sp, H, D]` -> `[B, S, H/sp, D]`: scatter heads, gather the sequence.

        All tensors (q, k, v) travel in one all-to-all.
        """
        if not self.enabled:
            return xs
        b, s_local, h, d = xs[0].shape
        g, sp = len(xs), self.size
        # [sp, B, S/sp, G, H/sp, D]: chunk j of every tensor's heads goes to rank j.
        send = torch.stack(xs, dim=2).reshape(b, s_local, g, sp, h // sp, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        recv = _AllToAll.apply(send.flatten(0, 1).flatten(1), self.group)
        recv = recv.view(sp, b, s_local, g, h // sp, d)
        # Received chunk i holds source rank i's rows, so concatenating by source restores row order.
        full = recv.permute(1, 0, 2, 3, 4, 5).reshape(b, sp * s_local, g, h // sp, d)
        return full.unbind(2)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S, H/sp, D]` -> `[B, S/sp, H, D]`: the inverse of `heads_to_sequence`."""
        if not self.enabled:
            return x
        b, s, h_local, d = x.shape
        s_local = s // self.size
        # [sp, B, S/sp, H/sp, D]: row chunk j goes back to rank j.
        send = x.reshape(b, self.size, s_local, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = _AllToAll.apply(send.flatten(0, 1).flatten(1), self.group)
        recv = recv.view(self.size, b, s_local, h_local, d)
        # Received chunk i holds head block i of this rank's rows.
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s_local, self.size * h_local, d)
