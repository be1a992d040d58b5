"""A full tensor's value into this rank's shard: the one copy of the offset arithmetic."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), or `t` itself when it is a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def fill_from_full(param: torch.Tensor, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
    """Give `param` (this rank's shard of a DTensor, or a plain tensor) its part of a full value.

    `read(rows)` returns the full value's block at `rows` (one slice per dimension), so a reader of
    a file reads this rank's rows only (`safetensors` `get_slice`) and no rank holds the whole tensor.
    """
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        if local.numel():
            local.copy_(read(tuple(slice(o, o + n) for o, n in zip(offset, shape))).to(local.dtype))
    else:
        param.copy_(read(tuple(slice(0, n) for n in param.shape)).to(param.dtype))


def global_norm(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The L2 norm of the full values of `tensors` (DTensors or plain tensors), from this rank's shards, in
    float32 (float64 where a tensor is): one all-reduce of one value over `group`, the group the shards
    split over (None: nothing to reduce). HSDP replicas hold the same shards, so they reduce nothing; the
    same value on every rank of the group, whatever torch's DTensor reductions would send."""
    local = [local_tensor(t) for t in tensors]
    wide = torch.float64 if any(t.dtype == torch.float64 for t in local) else torch.float32
    if not local:
        return torch.zeros((), dtype=wide)
    squares = torch.stack([n.to(wide) for n in torch._foreach_norm(local, 2.0)]).square().sum()
    if group is not None:
        dist.all_reduce(squares, group=group)
    return squares.sqrt()
