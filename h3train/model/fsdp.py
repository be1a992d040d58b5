"""FSDP2 plan: one unit per refiner and transformer block, ONE unit for all float32 islands, and the root.

Master weights are float32. Blocks compute in `model.dtype` and reduce gradients in float32; the
`_keep_in_fp32_modules` islands (`proj_in`, `audio_proj_in`, `time_embedder`, `proj_out`,
`audio_proj_out`) must compute in float32, and a mixed-precision policy covers a whole unit, so
they share one float32 unit. `cast_forward_inputs=False` everywhere: the input cast would round
float64 positions and float32 timesteps to bf16 (0.999 becomes 1.0).

Every block but the last reshards after forward (on one rank none does: backward would gather it
again); the last block, the islands and the root (what is left) stay unsharded into backward,
which needs them at once. Collectives per step: `collectives.fsdp_collectives_per_step`.

On one rank FSDP2 shards nothing but still copies every unit, so where it has no other work
(float32 compute over float32 parameters, no CPU offload) `shards_nothing` tells the trainer to
skip it and train plain tensors. `parallel.cpu_offload` keeps the shards, their gradients and the
AdamW state in host memory. A LoRA run's units hold a bf16 base and float32 adapters; each unit
gathers in its `param_dtype`, and only the float32 parameters get gradients.

With `parallel.adaln_tables` (true, or `auto` where `plan/tables.py` chooses them), each transformer
block's AdaLN projection stays out of its block's unit (`ignored_params`) and is computed where its
weights live (`model/adaln_tables.py`): its weight and bias are DTensors of the same mesh and
placements, never all-gathered, their gradient made the average below by the projection's own backward.

The gradient contract: every trainable parameter, full model or adapter, lives in one of these
units, so FSDP2 reduce-scatters its gradient as the average over `dp_shard x sp` (all-reduced over
`dp_replicate` under HSDP), and the gathered output's `sp` scale (`parallel/ulysses.py`) makes that
average the full gradient. `apply_fsdp` checks that no trainable parameter is left unsharded, where
it would be reduced by nothing and keep only its own rank's share. Where the backend sums what it is
asked to average (`ctx.averaging`, probed on these groups at start-up), every unit reduces by SUM
and divides by the data-parallel size itself: the same average.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..parallel.dims import ParallelContext
from .adaln_tables import TableGroup, ignored_parameters, serve_tables, table_projections
from .build import fp32_island_names
from .sp_forward import SequenceParallelH3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _reshard_after_inference(model: nn.Module, args: object, output: object) -> None:
    # A unit that does not reshard after forward stays unsharded until its backward; after a
    # forward without gradients (held-out loss, samples, the CFG negative) no backward comes, and
    # the next forward would reuse that unsharded copy even if the sharded values changed in
    # between (an optimizer step, the EMA swapped in for validation and out again).
    if not torch.is_grad_enabled():
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def shards_nothing(model: nn.Module, ctx: ParallelContext, compute_dtype: str, cpu_offload: bool = False) -> bool:
    """Whether FSDP2 would only copy parameters for this run: one rank, float32 compute over float32
    parameters (no cast to a compute dtype), no CPU offload. The trainer then skips `apply_fsdp`."""
    return (
        ctx.fsdp_mesh.size() == 1
        and not cpu_offload
        and DTYPES[compute_dtype] == torch.float32
        and all(p.dtype == torch.float32 for p in model.parameters())
    )


def serves_tables(mesh_size: int, shard_size: int, adaln_tables: bool | str, cpu_offload: bool) -> bool:
    """Whether the AdaLN projections are computed where their weights live (`model/adaln_tables.py`):
    `parallel.adaln_tables` true (an `auto` the start has not resolved serves none: `plan.tables`), a shard
    group of more than one rank, no CPU offload."""
    return adaln_tables is True and mesh_size > 1 and shard_size > 1 and not cpu_offload


def requires_all_reduce(model: nn.Module, last: bool) -> None:
    """HSDP: whether the backward that runs next all-reduces gradients across `dp_replicate`, for FSDP2's
    units and the AdaLN tables' projections alike (the last micro-batch of a step)."""
    model.set_requires_all_reduce(last)
    tables = getattr(model, "tables", None)
    if tables is not None:
        tables.reduction.enabled = last


def apply_fsdp(
    model: SequenceParallelH3,
    ctx: ParallelContext,
    compute_dtype: str,
    cpu_offload: bool = False,
    adaln_tables: bool = False,
) -> SequenceParallelH3:
    """Shard `model` in place over `ctx.fsdp_mesh` (HSDP when it is 2-D); returns it.

    `adaln_tables`: the blocks' AdaLN projections stay out of their units and are computed where their
    weights live (`model/adaln_tables.py`), where `serves_tables`.
    """
    transformer = model.transformer
    mesh = ctx.fsdp_mesh
    one_rank = mesh.size() == 1
    common: dict = {"mesh": mesh}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    block_policy = _policy(DTYPES[compute_dtype])
    island_policy = _policy(torch.float32)
    tables = serves_tables(mesh.size(), mesh.size(mesh.ndim - 1), adaln_tables, cpu_offload)
    projections = list(table_projections(transformer)) if tables else []
    served = {layer for _, layer in projections}
    blocks = [*transformer.token_refiner.refiner_blocks, *transformer.transformer_blocks]
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        ignored = ignored_parameters(block, served) or None
        fully_shard(
            block,
            mp_policy=block_policy,
            reshard_after_forward=not (last or one_rank),
            ignored_params=ignored,
            **common,
        )
    islands = [getattr(transformer, name) for name in fp32_island_names(transformer)]
    fully_shard(islands, mp_policy=island_policy, reshard_after_forward=False, **common)
    # The root keeps what is left (context_embedder, refiner final norm, norm_out) and no longer
    # reshards after forward: backward needs those parameters straight away.
    ignored = {p for _, layer in projections for p in layer.parameters(recurse=False)} or None
    fully_shard(model, mp_policy=block_policy, reshard_after_forward=False, ignored_params=ignored, **common)
    if projections:
        group = TableGroup.of(mesh, block_policy.param_dtype)
        serve_tables(projections, group, ctx.device)
        model.tables = group
    model.register_forward_hook(_reshard_after_inference)
    if ctx.averaging.force_sum:
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_force_sum_reduction_for_comms(True)
    unsharded = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if unsharded:
        raise RuntimeError(
            f"trainable parameters outside every FSDP2 unit (their gradients would not be reduced): {unsharded[:3]}"
        )
    return model
