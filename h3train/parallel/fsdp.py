"""FSDP2 plan: one unit per transformer block, per refiner block, per float32 island, and the root.

Trained parameters have float32 master weights. With `model.dtype = bfloat16` the units compute in
bf16 (`param_dtype`) and reduce gradients in float32, except the `_keep_in_fp32_modules` islands,
which are their own units with a float32 policy: a mixed-precision policy applies to a whole unit,
and the islands must compute in float32.
`cast_forward_inputs=False` everywhere: FSDP's input cast would turn float64 positions and float32
timesteps into bf16 (0.999 becomes 1.0).

A LoRA run (`lora/adapters.py`) holds two original dtypes in one unit: the frozen base in bf16 and
the adapters (and `lora.train_modules`) in float32. FSDP2 shards each parameter in its own dtype
and all-gathers every parameter of a unit in the unit's `param_dtype`, so the same plan serves it:
with `model.dtype = float32` the base is upcast exactly for compute, with bfloat16 it is gathered
as stored. Only the float32 parameters get gradients (reduced in float32) and optimizer state.

The gradient contract: every trainable parameter, full model or adapter, lives in one of these
units, so FSDP2 reduce-scatters its gradient as the average over `dp_shard x sp` (all-reduced over
`dp_replicate` under HSDP), and the gathered output's `sp` scale (`parallel/ulysses.py`) makes that
average the full gradient. `apply_fsdp` checks that no trainable parameter is left unsharded, where
it would be reduced by nothing and keep only its own rank's share.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..model.build import fp32_island_names
from ..model.sp_forward import SequenceParallelH3
from .dims import ParallelContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: SequenceParallelH3, ctx: ParallelContext, compute_dtype: str) -> SequenceParallelH3:
    """Shard `model` in place over `ctx.fsdp_mesh` (HSDP when it is 2-D); returns it."""
    transformer = model.transformer
    block_policy = _policy(DTYPES[compute_dtype])
    island_policy = _policy(torch.float32)
    for block in transformer.token_refiner.refiner_blocks:
        fully_shard(block, mesh=ctx.fsdp_mesh, mp_policy=block_policy)
    for block in transformer.transformer_blocks:
        fully_shard(block, mesh=ctx.fsdp_mesh, mp_policy=block_policy)
    for name in fp32_island_names(transformer):
        fully_shard(getattr(transformer, name), mesh=ctx.fsdp_mesh, mp_policy=island_policy)
    # The root keeps what is left (context_embedder, refiner final norm, norm_out) and no longer
    # reshards after forward: backward needs those parameters straight away.
    fully_shard(model, mesh=ctx.fsdp_mesh, mp_policy=block_policy, reshard_after_forward=False)
    unsharded = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if unsharded:
        raise RuntimeError(
            f"trainable parameters outside every FSDP2 unit (their gradients would not be reduced): {unsharded[:3]}"
        )
    return model
