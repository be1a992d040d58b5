"""FSDP2 plan: one unit per transformer block and per refiner block, ONE unit for all float32 islands, and the root.

Trained parameters have float32 master weights. With `model.dtype = bfloat16` the units compute in
bf16 (`param_dtype`) and reduce gradients in float32, except the `_keep_in_fp32_modules` islands
(`proj_in`, `audio_proj_in`, `time_embedder`, `proj_out`, `audio_proj_out`), which share one unit
with a float32 policy: a mixed-precision policy applies to a whole unit, and the islands must
compute in float32. They are tiny, so one unit (one all-gather, one reduce-scatter) serves all five;
it unshards at the first island's forward (the input projections) and, not resharding after
forward, stays unsharded through the output heads into backward.
`cast_forward_inputs=False` everywhere: FSDP's input cast would turn float64 positions and float32
timesteps into bf16 (0.999 becomes 1.0).

What reshards after forward: every refiner and transformer block except the last one, whose
backward starts right after the forward ends (resharding it would only all-gather it again); the
islands and the root (what is left: context_embedder, refiner final norm, norm_out) keep their
parameters too. Per step with N blocks and R refiner blocks: N + R + 2 all-gathers in forward,
N + R - 1 in backward, N + R + 2 reduce-scatters (`collectives.fsdp_collectives_per_step`).

One rank (world size 1): FSDP2 shards nothing there, and on a one-rank group it still copies each
unit into an unsharded twin every forward (the whole model twice in memory, since nothing reshards)
and each gradient through its reduce-scatter buffers. So `shards_nothing` tells the trainer to skip
it where it would do no other work: float32 compute over float32 parameters, no CPU offload. The
model then trains as plain tensors, which every consumer takes as well as DTensors (DCP reshards
between the two on resume, the clip, export, EMA and LoRA state read either). A one-rank run that
casts (bf16 compute over float32 master weights, LoRA's bf16 base upcast to float32) or offloads
keeps FSDP2 for that work: nothing reshards after forward there (the unsharded copy comes back for
backward anyway), so each unit is copied once per step, not twice. After a forward without
gradients every unit reshards (`_reshard_after_inference`), so that no unsharded copy outlives a
change of the sharded values.

`parallel.cpu_offload` (FSDP2 `CPUOffloadPolicy`): the sharded float32 parameters, their gradients
and so the AdamW state and step stay in host memory (pinned on CUDA); each unit is copied to the
device for its forward and backward. On a CPU-only run it moves nothing.

A LoRA run (`lora/adapters.py`) holds two original dtypes in one unit: the frozen base in bf16 and
the adapters (and `lora.train_modules`) in float32. FSDP2 shards each parameter in its own dtype
and all-gathers every parameter of a unit in the unit's `param_dtype`, so the same plan serves it:
with `model.dtype = float32` the base is upcast exactly for compute, with bfloat16 it is gathered
as stored. Only the float32 parameters get gradients (reduced in float32) and optimizer state.

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

from ..model.build import fp32_island_names
from ..model.sp_forward import SequenceParallelH3
from .dims import ParallelContext

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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), or `t` itself when it is a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def shards_nothing(model: nn.Module, ctx: ParallelContext, compute_dtype: str, cpu_offload: bool = False) -> bool:
    """Whether FSDP2 would only copy parameters for this run: one rank, float32 compute over float32
    parameters (no cast to a compute dtype), no CPU offload. The trainer then skips `apply_fsdp`."""
    return (
        ctx.fsdp_mesh.size() == 1
        and not cpu_offload
        and DTYPES[compute_dtype] == torch.float32
        and all(p.dtype == torch.float32 for p in model.parameters())
    )


def apply_fsdp(
    model: SequenceParallelH3, ctx: ParallelContext, compute_dtype: str, cpu_offload: bool = False
) -> SequenceParallelH3:
    """Shard `model` in place over `ctx.fsdp_mesh` (HSDP when it is 2-D); returns it."""
    transformer = model.transformer
    mesh = ctx.fsdp_mesh
    one_rank = mesh.size() == 1
    common: dict = {"mesh": mesh}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    block_policy = _policy(DTYPES[compute_dtype])
    island_policy = _policy(torch.float32)
    blocks = [*transformer.token_refiner.refiner_blocks, *transformer.transformer_blocks]
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mp_policy=block_policy, reshard_after_forward=not (last or one_rank), **common)
    islands = [getattr(transformer, name) for name in fp32_island_names(transformer)]
    fully_shard(islands, mp_policy=island_policy, reshard_after_forward=False, **common)
    # The root keeps what is left (context_embedder, refiner final norm, norm_out) and no longer
    # reshards after forward: backward needs those parameters straight away.
    fully_shard(model, mp_policy=block_policy, reshard_after_forward=False, **common)
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
