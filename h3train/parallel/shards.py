"""A full tensor's value into this rank's shard: the one copy of the offset arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import torch
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
