"""Every transformer block's AdaLN table computed where its projection's weights live.

A block's `adaln_proj.linear` (`[N, D]` with N = 18 x hidden: six modulation vectors for each of the
three modalities; 2,688 -> 96,768 at the released dims, 40 % of the block's parameters) maps the
step's few timestep embeddings `[T, D]` to a table `[T, N]`. FSDP2 would all-gather its weight twice a
step and reduce-scatter its gradient, per block, on every rank: half a gigabyte of bf16 for a table of
a few rows. Here the projection's weight and bias stay out of the block's FSDP2 unit (`ignored_params`)
and stay sharded where they live, as DTensors of the same mesh and placements FSDP2 gives its own
parameters (`Shard(0)` over `dp_shard x sp`, replicated over `dp_replicate`), so DCP checkpoints,
resume on other layouts, EMA, the optimizers, clipping and export see what they always saw.

Every block reads the same embeddings, so one model forward computes every served block's table before
the block loop (`block_tables`), on each rank r of the shard group of S ranks:

1. the embeddings `[R, D]` of every rank of the group are all-gathered once (`[S x R, D]`, a few KB);
2. rank r projects them with the weight rows it holds of each block (`[S x R, c]` a block, c =
   ceil(N / S), the rows of `torch.chunk`, as FSDP2 and DTensor shard), side by side (`[S x R, L x c]`);
3. one all-to-all gives each rank every rank's columns of its own tables (`L x [R, N]`).

Each block then reads its table from its arguments (`BlockTable`), so a block recomputed in backward
(`selective`, `full`) issues no exchange of its own: nothing of the tables runs between FSDP2's
reduce-scatters and prefetch all-gathers of the block units. The backward is the same exchanges
reversed, once, after the last block's backward: an all-to-all of the table gradients, after which rank
r holds the gradient of every rank's tables on its own rows, so its weight gradients are local; the
embeddings' gradients are reduce-scattered back. FSDP2 would reduce-scatter the weight gradient as the
average over the group (and average it over `dp_replicate` under HSDP, once a step): the local gradient
is the sum over the group's ranks, so it is divided by S (`_LocalLinear`), and under HSDP the gradient
accumulated over the step's micro-batches is all-reduced over `dp_replicate` after the last one and
divided by its size (`_reduce_across_replicas`, weight and bias each): that same average, whatever the
backend's averaging.

Every rank issues the same collectives whatever its samples: the embeddings are padded to R rows
(`table_rows`), a bound the host knows without asking the other ranks: a sample carries at most
`TIMESTEPS_PER_SAMPLE` distinct timesteps, and a pack at most that many per sample of the step's
largest micro-batch, which the step composer knows for every rank. A padding row's table row is never read.

Not served here, and gathered by FSDP2 as before: a DoRA-adapted projection (its weight norm needs the
whole weight), CPU offload, and a shard group of one rank. `norm_out`'s projection (2 x hidden rows) is
in the root unit, gathered once a step and kept to the backward: it stays there.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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

#: The most distinct timesteps one sample's rows carry (diffusers' `build_row_timesteps`): its target video
#: (and text), its target audio, its visual conditioning and its reference audio rows.
TIMESTEPS_PER_SAMPLE = 4


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


def _local_columns(layer: nn.Module, embeddings: torch.Tensor) -> torch.Tensor:
    """This rank's columns `[S x R, n]` (n <= c, its weight rows) of the tables of `embeddings` `[S x R, D]`
    under served `layer`: a trained `nn.Linear` through `_LocalLinear`; a frozen `QuantizedLinear` base
    through its dequantized rows (no weight gradient)."""
    group: TableGroup = layer.table_group
    if isinstance(layer, QuantizedLinear):
        weight = dequantize(layer.qweight.to_local(), layer.scale.to_local(), group.dtype)
        return F.linear(embeddings, weight, layer.bias.to_local().to(group.dtype))
    return _LocalLinear.apply(embeddings, layer.weight.to_local(), layer.bias.to_local(), group)


def _exchange(layers: Sequence[nn.Module], x: torch.Tensor, group: TableGroup) -> list[torch.Tensor]:
    """Each of `layers`' table `[R, N]` of embeddings `x` `[R, D]` (R equal on every rank of the group): one
    all-gather of the embeddings, each layer's local columns padded to c and side by side, one all-to-all."""
    timesteps, size = x.shape[0], group.size
    rows = {layer.out_features for layer in layers}
    if len(rows) != 1:
        raise ValueError(f"the served projections differ in their rows: {sorted(rows)}")
    (n,) = rows
    c = group.chunk_rows(n)
    gathered = _GatherEmbeddings.apply(x.to(group.dtype), group.shard)
    pieces = []
    for layer in layers:
        mine = _local_columns(layer, gathered)
        pieces.append(F.pad(mine, (0, c - mine.shape[1])) if mine.shape[1] < c else mine)
    # Rows [q*R, (q+1)*R) are rank q's embeddings: chunk q of dim 0 goes to rank q, and chunk p received
    # holds rank p's columns, block after block, of this rank's tables.
    received = all_to_all(torch.cat(pieces, dim=1).contiguous(), group.shard)
    tables = received.view(size, timesteps, len(layers), c).permute(2, 1, 0, 3).reshape(len(layers), timesteps, -1)
    return list(tables[:, :, :n].unbind(0))


def table_rows(samples: int) -> int:
    """R: the rows every rank of a shard group exchanges in one forward whose micro-batches hold at most
    `samples` samples on any rank (one unpacked; a pack's, the step composer's largest)."""
    return TIMESTEPS_PER_SAMPLE * samples


class BlockTable(NamedTuple):
    """What a served block's `adaln_proj` takes in place of the timestep embeddings: its table `[T, N]`,
    computed before the block loop (`block_tables`), and the projection's input `[T, D]` (`silu(temb)` in
    the compute dtype), which an adapter on the projection adds its own term from."""

    table: torch.Tensor
    inputs: torch.Tensor


def served_layer(modulation: nn.Module) -> nn.Module | None:
    """The layer of `modulation` (a block's `adaln_proj`) whose table `serve_tables` computes, or None."""
    layer = modulation.linear
    if hasattr(layer, "table_group"):
        return layer
    base = getattr(layer, "base_layer", None)
    return base if hasattr(base, "table_group") else None


def block_tables(blocks: Sequence[nn.Module], temb: torch.Tensor, rows: int, group: TableGroup) -> list:
    """Per transformer block, what its forward takes as `temb`: a `BlockTable` where its projection is served,
    else `temb` itself. `temb` `[T, D]` (T <= `rows`, `table_rows`) is padded with zero rows to `rows`; every
    served table is computed in one exchange (module docstring)."""
    if temb.shape[0] > rows:
        raise ValueError(
            f"a forward of {temb.shape[0]} timesteps over the {rows} table rows planned for it "
            f"({TIMESTEPS_PER_SAMPLE} per sample of the step's largest micro-batch)"
        )
    layers = [served_layer(block.adaln_proj) for block in blocks]
    served = [layer for layer in layers if layer is not None]
    if not served:
        return [temb] * len(blocks)
    # The activation at `temb`'s own precision, as diffusers' modulation; the padding rows stay zero.
    inputs = nn.functional.silu(temb).to(group.dtype)
    tables = iter(_exchange(served, F.pad(inputs, (0, 0, 0, rows - inputs.shape[0])), group))
    return [temb if layer is None else BlockTable(next(tables)[: inputs.shape[0]], inputs) for layer in layers]


def _served_forward(self: nn.Module, x: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    # The table computed before the block loop; an adapter wrapping this layer adds its term to it.
    if table is None:
        raise ValueError("a served AdaLN projection reads its table from the forward's exchange (`block_tables`)")
    return table


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


def _modulation_forward(self: nn.Module, temb: BlockTable) -> tuple[torch.Tensor, ...]:
    # diffusers' `MiniMaxH3AdaLayerNormModulation.forward` over the table computed before the block loop, in
    # the compute dtype where diffusers casts to the projection's parameter dtype: what FSDP2's gathered
    # parameters had, which the sharded ones (float32 masters, a bfloat16 base) are not. An adapter on the
    # projection sees the same input and passes the table on to its base layer.
    if not isinstance(temb, BlockTable):
        raise TypeError("a served AdaLN projection takes a BlockTable (`block_tables`), not the embeddings")
    out = self.linear(temb.inputs, table=temb.table)
    return out.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


def serve_tables(projections: list[tuple[nn.Module, nn.Module]], group: TableGroup, device: torch.device) -> None:
    """Shard each projection's parameters over `group` (DTensors of the FSDP2 mesh); its forward then reads
    the table `block_tables` computed. `projections` from `table_projections`, after `fully_shard` left
    them out of their units."""
    for modulation, layer in projections:
        for name, param in list(layer.named_parameters(recurse=False)):
            sharded = _shard(param, group, device)
            if sharded.requires_grad and group.replicate is not None:
                sharded.register_post_accumulate_grad_hook(_reduce_across_replicas(group))
            setattr(layer, name, sharded)
        layer.table_group = modulation.table_group = group
        layer.forward = types.MethodType(_served_forward, layer)
        modulation.forward = types.MethodType(_modulation_forward, modulation)
