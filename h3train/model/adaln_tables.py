"""Every transformer block's AdaLN table computed where its projection's weights live.

A block's `adaln_proj.linear` (`[N, D]` with N = 18 x hidden: six modulation vectors for each of the
three modalities; 2,688 -> 96,768 at the released dims, 40 % of the block's parameters) maps the
step's few timestep embeddings `[T, D]` to a table `[T, N]`. FSDP2 would all-gather its weight twice a
step and reduce-scatter its gradient, per block, on every rank: half a gigabyte of bf16 for a table of
a few rows. Here the projection's weight and bias stay out of the block's FSDP2 unit (`ignored_params`)
and stay sharded where they live, as DTensors of the same mesh and placements FSDP2 gives its own
parameters (`Shard(0)` over `dp_shard x sp`, replicated over `dp_replicate`), so DCP checkpoints,
resume on other layouts, EMA, the optimizers, clipping and export see what they always saw.

One forward of the projection, on each rank r of the shard group of S ranks (`project`):

1. the embeddings `[T, D]` of every rank of the group are all-gathered (`[S x T, D]`, a few KB);
2. rank r projects them with the weight rows it holds (`[S x T, c]`, c = ceil(N / S), the rows of
   `torch.chunk`, as FSDP2 and DTensor shard);
3. an all-to-all gives each rank every rank's columns of its own table (`[T, N]`).

Its backward is the same exchanges reversed: an all-to-all of the table gradients, after which rank r
holds the gradient of every rank's table on its own rows, so its weight gradient is local; the
embeddings' gradients are reduce-scattered back. FSDP2 would reduce-scatter the weight gradient as the
average over the group (and average it over `dp_replicate` under HSDP, once a step): the local gradient
is the sum over the group's ranks, so it is divided by S (`_LocalLinear`), and under HSDP the gradient
accumulated over the step's micro-batches is all-reduced over `dp_replicate` after the last one and
divided by its size (`_reduce_across_replicas`, weight and bias each): that same average, whatever the
backend's averaging.

Every rank issues the same collectives whatever its samples: the embeddings are padded to the group's
largest count of timesteps, agreed once per model forward (`agree_timesteps`, one all-reduce of one
integer: the host reads it to size the exchanges); a padding row's table row is never read.

Not served here, and gathered by FSDP2 as before: a DoRA-adapted projection (its weight norm needs the
whole weight), CPU offload, and a shard group of one rank. `norm_out`'s projection (2 x hidden rows) is
in the root unit, gathered once a step and kept to the backward: it stays there.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..parallel.ulysses import all_to_all
from .quant import QuantizedLinear, dequantize

# The functional collectives under the names this torch gives them (newer torch renamed them).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class ReplicaReduction:
    """Whether the backward that runs next all-reduces the projections' gradients across `dp_replicate`
    (HSDP). As FSDP2's units, once a step: the trainer turns it on for the last micro-batch only."""

    def __init__(self) -> None:
        self.enabled = True


@dataclass(frozen=True)
class TableGroup:
    """The ranks one projection's weight is sharded over, and what its forward computes in.

    `shard`: the `dp_shard x sp` group (S ranks, this rank's index `index`); `replicate`: the
    `dp_replicate` group under HSDP, else None. `dtype`: the compute dtype (the block unit's
    `param_dtype`). `reduction`: whether this backward reduces across replicas.
    """

    mesh: DeviceMesh
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    size: int
    index: int
    replicas: int
    dtype: torch.dtype
    reduction: ReplicaReduction = field(default_factory=ReplicaReduction, compare=False)

    @classmethod
    def of(cls, mesh: DeviceMesh, dtype: torch.dtype) -> TableGroup:
        """The groups of an FSDP2 mesh: 1-D `(dp_shard_sp,)`, or 2-D `(dp_replicate, dp_shard_sp)` (HSDP)."""
        shard = mesh.get_group(mesh.ndim - 1)
        replicate = mesh.get_group(0) if mesh.ndim == 2 else None
        replicas = dist.get_world_size(replicate) if replicate is not None else 1
        return cls(mesh, shard, replicate, dist.get_world_size(shard), dist.get_rank(shard), replicas, dtype)

    @property
    def placements(self) -> tuple:
        return (Replicate(), Shard(0)) if self.mesh.ndim == 2 else (Shard(0),)

    def chunk_rows(self, rows: int) -> int:
        """Rows of the largest shard of a `rows`-row weight (`torch.chunk`'s), c."""
        return -(-rows // self.size)


class _GatherEmbeddings(torch.autograd.Function):
    """`[T, D]` -> `[S x T, D]` (rank order); backward reduce-scatters (sums) the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(_reduce_scatter(grad.contiguous(), "sum", 0, ctx.group)), None


class _LocalLinear(torch.autograd.Function):
    """`x @ weight.T + bias` in `x`'s dtype over this rank's weight rows, saving the resident weight rather
    than its compute-dtype copy. Backward: the weight's gradient (summed over the shard group's tables in
    float32, or float64 for a float64 weight) divided by S, the reduce-scatter's average; under HSDP
    `_reduce_across_replicas` averages it over `dp_replicate` once a step."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, group: TableGroup) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight.to(x.dtype), bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        group: TableGroup = ctx.group
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None
        # Summed in float32 at least, as FSDP2's `reduce_dtype`, then stored in the weight's dtype.
        wide = torch.promote_types(weight.dtype, torch.float32)
        grad_wide = grad.to(wide)
        scale = 1.0 / group.size
        grad_weight, grad_bias = (grad_wide.T @ x.to(wide)) * scale, grad_wide.sum(0) * scale
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None


def _reduce_across_replicas(group: TableGroup) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook of a served parameter under HSDP: its accumulated local gradient averaged
    over `dp_replicate` (in float32 at least), on the backward `group.reduction` enables."""

    def hook(param: torch.Tensor) -> None:
        if not group.reduction.enabled:
            return
        local = param.grad.to_local()
        wide = local.to(torch.promote_types(local.dtype, torch.float32))
        dist.all_reduce(wide, group=group.replicate)
        local.copy_(wide.div_(group.replicas))

    return hook


def project(x: torch.Tensor, rows: int, local: Callable[[torch.Tensor], torch.Tensor], group: TableGroup):
    """This rank's table `[T, rows]` of embeddings `x` `[T, D]` (T equal on every rank of the group).

    `local(e)` maps the gathered embeddings `[S x T, D]` to this rank's columns `[S x T, n]` (n <= c,
    its weight rows); they are padded to c for the all-to-all and the padding dropped after.
    """
    x = x.to(group.dtype)
    timesteps, c, size = x.shape[0], group.chunk_rows(rows), group.size
    mine = local(_GatherEmbeddings.apply(x, group.shard))
    if mine.shape[1] < c:
        mine = F.pad(mine, (0, c - mine.shape[1]))
    # Rows [q*T, (q+1)*T) are rank q's embeddings: chunk q of dim 0 goes to rank q, and chunk p received
    # holds rank p's columns of this rank's table.
    received = all_to_all(mine.contiguous(), group.shard)
    return received.view(size, timesteps, c).permute(1, 0, 2).reshape(timesteps, size * c)[:, :rows]


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    group: TableGroup = self.table_group
    weight, bias = self.weight.to_local(), self.bias.to_local()
    return project(x, self.out_features, lambda e: _LocalLinear.apply(e, weight, bias, group), group)


def _quantized_forward(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    # A frozen base: no weight gradient, the embeddings' gradient through the dequantized rows.
    group: TableGroup = self.table_group
    codes, scale, bias = self.qweight.to_local(), self.scale.to_local(), self.bias.to_local()
    weight = dequantize(codes, scale, group.dtype)
    return project(x, self.out_features, lambda e: F.linear(e, weight, bias.to(group.dtype)), group)


def table_projections(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """Each transformer block's `adaln_proj` and the module holding the projection weights this module can
    serve: `adaln_proj.linear`, or its adapter's `base_layer` (not under DoRA); an `nn.Linear` or a
    `QuantizedLinear` with a bias."""
    transformer = getattr(model, "transformer", model)
    for block in transformer.transformer_blocks:
        layer = block.adaln_proj.linear
        if hasattr(layer, "base_layer"):
            if len(getattr(layer, "lora_magnitude_vector", {})):
                continue
            layer = layer.base_layer
        if type(layer) in (nn.Linear, QuantizedLinear) and layer.bias is not None:
            yield block.adaln_proj, layer


def ignored_parameters(block: nn.Module, projections: set[nn.Module]) -> set[nn.Parameter]:
    """The parameters of `block` the table projections hold, which its FSDP2 unit leaves out."""
    return {p for m in block.modules() if m in projections for p in m.parameters(recurse=False)}


@torch.no_grad()
def _shard(param: nn.Parameter, group: TableGroup, device: torch.device) -> nn.Parameter:
    """This rank's `torch.chunk` rows of `param` on `device`, as a DTensor of the FSDP2 mesh."""
    full = param.data
    pieces = torch.chunk(full, group.size, dim=0)
    rows = pieces[group.index].shape[0] if group.index < len(pieces) else 0
    if full.is_meta:
        local = torch.empty((rows, *full.shape[1:]), dtype=full.dtype, device="meta")
    elif rows:
        local = pieces[group.index].to(device).clone()
    else:
        local = torch.empty((0, *full.shape[1:]), dtype=full.dtype, device=device)
    sharded = DTensor.from_local(
        local, group.mesh, group.placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def _modulation_forward(self: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # diffusers' `MiniMaxH3AdaLayerNormModulation.forward`, casting to the compute dtype where it casts to
    # the projection's parameter dtype: what FSDP2's gathered parameters had, which the sharded ones
    # (float32 masters, a bfloat16 base) are not. An adapter on the projection sees the same input.
    group: TableGroup = self.table_group
    temb = self.linear(nn.functional.silu(temb).to(group.dtype))
    return temb.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


def serve_tables(projections: list[tuple[nn.Module, nn.Module]], group: TableGroup, device: torch.device) -> None:
    """Shard each projection's parameters over `group` (DTensors of the FSDP2 mesh) and give it the
    forward of `project`; `projections` from `table_projections`, after `fully_shard` left them out of
    their units."""
    for modulation, layer in projections:
        for name, param in list(layer.named_parameters(recurse=False)):
            sharded = _shard(param, group, device)
            if sharded.requires_grad and group.replicate is not None:
                sharded.register_post_accumulate_grad_hook(_reduce_across_replicas(group))
            setattr(layer, name, sharded)
        layer.table_group = modulation.table_group = group
        forward = _quantized_forward if isinstance(layer, QuantizedLinear) else _linear_forward
        layer.forward = types.MethodType(forward, layer)
        modulation.forward = types.MethodType(_modulation_forward, modulation)


def agree_timesteps(temb: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`temb` `[T, D]` padded with zero rows to the largest T of `group` (one all-reduce of one integer)."""
    count = torch.tensor([temb.shape[0]], dtype=torch.int64, device=temb.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    most = int(count.item())
    if most == temb.shape[0]:
        return temb
    return torch.cat([temb, temb.new_zeros(most - temb.shape[0], temb.shape[1])])
