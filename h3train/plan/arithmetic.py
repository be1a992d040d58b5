"""The plan's arithmetic: parameter counts and per-rank bytes from constructor kwargs and mesh sizes alone (the
package docstring's memory model). Nothing here reads a config or a dataset.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..model.adapter import AdapterCounts
from ..model.quant import CODES, base_bytes_per_weight
from ..optim.kinds import state_bytes_per_value
from ..optim.lowbit import QUANT_BLOCK
from ..tasks.released import KEYFRAME_ROWS, LONGEST_ROWS, SHORT_ROWS
from .activations import (
    _DTYPE_BYTES,
    _FP32,
    StepPeak,
    _dim,
    block_policies,
    heads_activation_bytes,
    recompute_share,
    refiner_activation_bytes,
    refiner_recomputed,
    step_peak,
)

GIB = 1024**3

# AdaLN rows per timestep (video, text, audio) and the six modulation vectors per block.
_MODALITIES = 3
_ADALN_VECTORS = 6

# Device memory as torch reports it (`torch.cuda.get_device_properties().total_memory`, GiB), which is
# what a run plans against on CUDA: an 80 GB A100 reports about 79.3 GiB and an 80 GB H100 about 79.1, the
# figures their out-of-memory messages give as the total capacity. The plan's default card is the A100.
A100_MEMORY_GIB = 79.3
H100_MEMORY_GIB = 79.1
DEFAULT_DEVICE_MEMORY_GIB = A100_MEMORY_GIB
# FSDP2 reduces every gradient in float32 (`model/fsdp.py`'s `reduce_dtype`).
_REDUCE_BYTES = 4
# CUDA context (~0.5 GiB), NCCL communicator buffers (1-2 GiB on multi-node IB jobs) and
# caching-allocator fragmentation, which grows with the variety of tensor sizes.
DEFAULT_RESERVE_GIB = 4.0


@dataclass(frozen=True)
class ParameterCounts:
    """Exact parameter counts of `MiniMaxH3Transformer3DModel` for one set of constructor kwargs."""

    total: int
    # One `MiniMaxH3TransformerBlock`: the largest FSDP unit.
    block: int
    # Of which the AdaLN projection (`adaln_proj`), evaluated once per distinct timestep, not per row.
    block_adaln: int
    num_layers: int
    refiner_block: int
    num_refiner_layers: int
    # Everything outside the two block stacks: input/output projections, time MLP, norms.
    other: int
    # Of `other`, the `_keep_in_fp32_modules` islands (patch projections, time MLP, output heads).
    fp32_islands: int = 0
    # Of `total`, the 1-D parameters (norm scales, biases): shards torchao leaves unquantized.
    vectors: int = 0


@dataclass(frozen=True)
class EvaluationPlan:
    """Device memory of the forwards run between steps: the held-out loss (`validation.dataset`) and the
    rendering of `validation.samples`. No gradient is resident then (they are freed after each optimizer
    step) and no forward keeps activations for a backward. Byte counts are per rank."""

    # Packed rows of the longest such forward, and this rank's share of them.
    rows: int
    local_rows: int
    # The most one forward holds at once (`evaluation_activation_bytes`).
    activation_bytes: int
    # The VAEs moved onto the device while a rendered clip decodes (0: nothing rendered, or their
    # folder is not readable here); the decoder's own activations are not counted.
    components_bytes: int
    # What runs: "held-out loss", "rendering" or both, for the printout.
    what: str


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank parameters and memory of one training configuration. Byte counts are per rank."""

    dp_replicate: int
    dp_shard: int
    sp: int
    dtype: str
    # One policy of every block (none, selective, full), or `auto` for a mix (`policies` says which).
    activation_checkpointing: str
    rows: int
    local_rows: int
    params: ParameterCounts
    params_per_rank: int
    master_weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    unsharded_params_bytes: int
    unsharded_grads_bytes: int
    activation_bytes: int
    reserve_bytes: int
    device_bytes: int
    # Where `rows` came from, for the printout.
    rows_origin: str = ""
    # Host memory of the components that render `validation.samples` (not on the device), for the printout.
    render_line: str = ""
    # The base's stored held-out predictions (`validation.retention`), for the printout.
    retention_line: str = ""
    # LoRA runs: the adapter counts; `master_weights_bytes` is then the frozen base.
    lora: AdapterCounts | None = None
    # LoRA runs: the longest clips that fit here and on reference setups, for the printout.
    fit_lines: tuple[str, ...] = ()
    # `parallel.cpu_offload`: the sharded state (weights, gradients, AdamW) lives in host memory.
    cpu_offload: bool = False
    # One policy per transformer block (`BLOCK_POLICIES`): what each keeps and recomputes in backward.
    policies: tuple[str, ...] = ()
    # Where the step's peak falls (`StepPeak.phase`), for the printout.
    peak_phase: str = ""
    # The forward FLOPs the backward runs again under `policies`, as a share of the forward's.
    recompute_share: float = 0.0
    # The run's RMSNorm is CUDA's fused kernel (`fused_norm_for`).
    fused_norm: bool = False
    # `policies` were chosen by `model.activation_checkpointing: auto` (`choose_policies`).
    auto: bool = False
    # Of `activation_bytes`, what the backward creates and frees at the peak (`StepPeak.transient`).
    transient_bytes: int = 0
    # Tensor bytes of one checkpoint on disk, all ranks together (`checkpoint_bytes`); 0: not planned.
    checkpoint_bytes: int = 0
    # `train.ema.decay > 0`: the EMA's float32 shadow of every trainable parameter, sharded like it.
    ema_bytes: int = 0
    # `optim.name`: what the optimizer keeps per trainable parameter (`optim/lowbit.py`).
    optimizer: str = "adamw"
    # `lora.base_quant`: how the frozen base's matrices are stored (`model/quant.py`).
    base_quant: str = "none"
    # Text rows of the sample, which the refiner runs over on every SP rank, and what it keeps of
    # `activation_bytes` (`refiner_activation_bytes`), for the printout.
    text_rows: int = 0
    refiner_activation_bytes: int = 0
    # Of `grads_bytes`, what is resident at the step's peak (`step_peak`); None: all of it (gradients
    # accumulate over micro-batches).
    peak_grads_bytes: int | None = None
    # Validation and rendering between steps, when the run does either.
    evaluation: EvaluationPlan | None = None
    # `checkpoint.async_save`: host memory per rank that holds a copy of the rank's checkpoint shards while
    # the write goes on in the background (0: saves write from the device, tensor by tensor).
    staging_bytes: int = 0
    # Host memory per rank of the VAEs that render `validation.samples` (held on the CPU all run).
    render_host_bytes: int = 0
    # Ranks on one node, for the host memory a node needs (0: not planned).
    ranks_per_node: int = 0
    # `train.grad_accum`: micro-batches per optimizer step, for the global batch.
    grad_accum: int = 1
    # A plan that does not fit: the longest packed sequence a training step fits with here
    # (`longest_fit_rows`), the bound `data.max_rows` would set; 0: not planned.
    longest_fit: int = 0
    # Whether micro-batches are packs of `data.pack` rows: the bound that fits is then a pack budget.
    packed: bool = False
    # Packed rows of the longest sample the plan assumes (of the data, or the released clip away from it), for the
    # advice: no pack budget below it is advised, and a budget below it is said to refuse it; 0: not known.
    longest_sample_rows: int = 0
    # `parallel.adaln_tables`: over a shard group of more than one rank, not offloaded (`local_adaln`), the AdaLN
    # projections stay out of the unsharded blocks and their gradient (`plan_memory`).
    adaln_tables: bool = False
    # One all-gathered transformer block, the unit running (the prefetched one beside it is counted with its
    # AdaLN projection: `plan_memory`).
    gathered_block_bytes: int = 0
    # Of `unsharded_grads_bytes`, FSDP2's float32 reduce-scatter buffer of one block's gradient, where the
    # step's peak holds one (`step_peak`).
    reduce_buffer_bytes: int = 0

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: one per DP group (`dp_replicate * dp_shard`) per micro-batch."""
        return self.dp_replicate * self.dp_shard * self.grad_accum

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over."""
        return self.dp_shard * self.sp

    @property
    def local_adaln(self) -> bool:
        """Whether the AdaLN projections are computed from their shards, never all-gathered (`adaln_tables`)."""
        return self.adaln_tables is True and self.shard_size > 1 and not self.cpu_offload

    @property
    def sharded_state_bytes(self) -> int:
        return self.master_weights_bytes + self.grads_bytes + self.optimizer_bytes + self.ema_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory per rank the plan moves off the device (`cpu_offload`)."""
        return self.sharded_state_bytes if self.cpu_offload else 0

    @property
    def total_bytes(self) -> int:
        """Device memory per rank."""
        apart = 0 if self.peak_grads_bytes is None or self.cpu_offload else self.grads_bytes - self.peak_grads_bytes
        return (
            self.sharded_state_bytes
            - apart
            - self.host_bytes
            + self.unsharded_params_bytes
            + self.unsharded_grads_bytes
            + self.activation_bytes
            + self.reserve_bytes
        )

    @property
    def evaluation_bytes(self) -> int:
        """Device memory per rank while validation or rendering runs (0: neither does)."""
        e = self.evaluation
        if e is None:
            return 0
        state = 0 if self.cpu_offload else self.sharded_state_bytes - self.grads_bytes
        return state + self.unsharded_params_bytes + e.activation_bytes + e.components_bytes + self.reserve_bytes

    @property
    def peak_bytes(self) -> int:
        """Device memory per rank at the run's peak: a training step's (`total_bytes`) or the evaluation's."""
        return max(self.total_bytes, self.evaluation_bytes)

    @property
    def host_per_rank_bytes(self) -> int:
        """Host memory one rank holds besides its process: offloaded state, checkpoint staging, the VAEs."""
        return self.host_bytes + self.staging_bytes + self.render_host_bytes

    @property
    def device_gib(self) -> str:
        """The device's memory for a printout: GiB to a tenth, without a trailing `.0` (79.3, 80, 139.8)."""
        return f"{self.device_bytes / GIB:.1f}".removesuffix(".0")

    @property
    def headroom_bytes(self) -> int:
        return self.device_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_bytes


def parameter_counts(dims: Mapping[str, Any]) -> ParameterCounts:
    """Count the parameters from the constructor kwargs, module by module as `__init__` builds them.

    Linear layers are `in * out (+ out if bias)`; every RMSNorm has one weight vector; the SwiGLU
    feed-forward is a fused `hidden -> 2 * ffn` projection plus `ffn -> hidden`, both bias-free.
    """
    h = _dim(dims, "hidden_size")
    inner = _dim(dims, "num_attention_heads") * _dim(dims, "attention_head_dim")
    head_dim = _dim(dims, "attention_head_dim")
    ffn = _dim(dims, "ffn_dim")
    t_emb = _dim(dims, "time_embed_dim")
    t_hidden = _dim(dims, "time_embed_hidden_dim")
    freq = _dim(dims, "freq_dim")
    patch = dims["patch_size"]
    video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in patch)
    audio_ch = _dim(dims, "audio_in_channels")
    text = _dim(dims, "text_dim")
    layers = _dim(dims, "num_layers")
    refiner_layers = _dim(dims, "num_refiner_layers")

    attention = 4 * h * inner + 2 * head_dim  # to_q/k/v/out, norm_q/k
    swiglu = h * 2 * ffn + ffn * h
    plain_block = 2 * h + attention + swiglu  # norm1, norm2
    adaln = t_emb * _ADALN_VECTORS * _MODALITIES * h + _ADALN_VECTORS * _MODALITIES * h
    block = plain_block + adaln

    outside_blocks = {
        "proj_in": video_patch * h + h,
        "audio_proj_in": audio_ch * h + h,
        "context_embedder": text * h + h,
        "time_embedder": freq * t_hidden + t_hidden + t_hidden * t_emb + t_emb,
        "token_refiner.final_norm": h,
        "norm_out": h + t_emb * 2 * h + 2 * h,
        "proj_out": h * video_patch + video_patch,
        "audio_proj_out": h * audio_ch + audio_ch,
    }
    other = sum(outside_blocks.values())
    islands = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")
    plain_vectors = 2 * h + 2 * head_dim
    outside_vectors = 5 * h + t_hidden + t_emb + 2 * h + video_patch + audio_ch
    vectors = layers * (plain_vectors + _ADALN_VECTORS * _MODALITIES * h) + refiner_layers * plain_vectors
    total = layers * block + refiner_layers * plain_block + other
    return ParameterCounts(
        total=total,
        block=block,
        block_adaln=adaln,
        num_layers=layers,
        refiner_block=plain_block,
        num_refiner_layers=refiner_layers,
        other=other,
        fp32_islands=sum(outside_blocks[name] for name in islands),
        vectors=vectors + outside_vectors,
    )


def plan_memory(
    dims: Mapping[str, Any],
    *,
    dp_replicate: int,
    dp_shard: int,
    sp: int,
    dtype: str,
    activation_checkpointing: str,
    rows: int,
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    rows_origin: str = "",
    lora: AdapterCounts | None = None,
    cpu_offload: bool = False,
    policies: tuple[str, ...] | None = None,
    ema: bool = False,
    text_rows: int = 0,
    optimizer: str = "adamw",
    base_quant: str = "none",
    grad_accum: int | None = None,
    fused_norm: bool = False,
    adaln_tables: bool = False,
) -> MemoryPlan:
    """Per-rank memory of an AdamW fine-tune on a resolved `(dp_replicate, dp_shard, sp)` mesh.

    `dims` are the constructor kwargs with defaults filled in (`h3train.model.architecture.model_dims`);
    `dtype` is the compute dtype (`model.dtype`); `activation_checkpointing` is
    `model.activation_checkpointing`: one of `BLOCK_POLICIES` for every block, or `auto`, the least
    recompute whose peak fits the device less the reserve (`choose_policies`); `policies` gives one per
    block instead. `rows` is the packed sequence length of the longest sample, padded to a multiple of
    `sp` as the SP forward does. `lora`: a LoRA run (`lora_counts`), whose base is frozen in bfloat16;
    None: a full fine-tune. `cpu_offload`: the sharded state is counted in host memory, not on the
    device. `ema`: an EMA of the trainable parameters (`train.ema.decay`), a float32 shadow of each,
    sharded (and offloaded) as its parameter is. `text_rows`: the sample's text rows (at most `rows`),
    which the text refiner runs over on every SP rank; 0 leaves the refiner out. `optimizer`:
    `optim.name`; `adamw_bf16` stores the trainable weights and gradients in bfloat16 (its float32
    islands, which a LoRA's adapters are counted outside of, in float32), and each kind its moments at
    `state_bytes_per_value` bytes (8 for float32 AdamW). `base_quant`: `lora.base_quant`, the frozen
    base's matrices at 1 byte per weight (the row scales, 2 bytes per row of thousands of inputs, are
    left out), its vectors in bfloat16 and islands in float32. `grad_accum`: `train.grad_accum`; at 1
    no gradient is resident as the step starts and the backward walk (`step_peak`) places them; None
    (or more) counts all of them beside the activations. `fused_norm`: the run's RMSNorm is CUDA's fused
    kernel (`fused_norm_for`). `adaln_tables`: `parallel.adaln_tables`; over a shard group of more than one
    rank and without `cpu_offload` (`model/fsdp.py`'s `serves_tables`), each block's AdaLN projection
    (`ParameterCounts.block_adaln`) is never all-gathered nor its gradient reduce-scattered, so the
    unsharded block and its unsharded gradient leave it out (its shards stay resident in the sharded
    state). A DoRA-adapted projection, which the run gathers as before, is counted as not gathered.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("sp", sp), ("rows", rows)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value} (resolve dp_shard=-1 against the world size first)")
    common = {
        "dp_replicate": dp_replicate,
        "dp_shard": dp_shard,
        "sp": sp,
        "dtype": dtype,
        "rows": rows,
        "device_memory_gib": device_memory_gib,
        "reserve_gib": reserve_gib,
        "rows_origin": rows_origin,
        "lora": lora,
        "cpu_offload": cpu_offload,
        "ema": ema,
        "text_rows": text_rows,
        "optimizer": optimizer,
        "base_quant": base_quant,
        "grad_accum": grad_accum,
        "fused_norm": fused_norm,
        "adaln_tables": adaln_tables,
    }
    if policies is None and activation_checkpointing == "auto":
        return choose_policies(dims, **common)
    if policies is None:
        policies = block_policies(activation_checkpointing, _dim(dims, "num_layers"))
    return _planned(dims, tuple(policies), activation_checkpointing, **common)


def _planned(
    dims: Mapping[str, Any],
    policies: tuple[str, ...],
    activation_checkpointing: str,
    *,
    dp_replicate: int,
    dp_shard: int,
    sp: int,
    dtype: str,
    rows: int,
    device_memory_gib: float,
    reserve_gib: float,
    rows_origin: str,
    lora: AdapterCounts | None,
    cpu_offload: bool,
    ema: bool,
    text_rows: int,
    optimizer: str,
    base_quant: str,
    grad_accum: int | None,
    fused_norm: bool,
    adaln_tables: bool,
) -> MemoryPlan:
    """`plan_memory` with one policy per block (`policies`), its arguments checked."""
    counts = parameter_counts(dims)
    shard = dp_shard * sp
    per_rank = -(-counts.total // shard)
    local_rows = -(-rows // sp)
    text_rows = min(max(text_rows, 0), rows)
    trainable, frozen_base, block_params, block_grads = _trained_and_frozen(counts, lora, base_quant, shard)
    trainable_bytes, moment_bytes = trainable_state_bytes(counts, trainable, optimizer, lora is None, shard)
    accum = grad_accum != 1
    peak, unsharded_block = _step_peak_of(
        dims,
        counts,
        policies,
        _PeakInputs(
            shard=shard,
            sp=sp,
            dtype=dtype,
            local_rows=local_rows,
            text_rows=text_rows,
            lora=lora,
            base_quant=base_quant,
            cpu_offload=cpu_offload,
            adaln_tables=adaln_tables,
            fused_norm=fused_norm,
            accum=accum,
            trainable=trainable,
            trainable_bytes=trainable_bytes,
            block_params=block_params,
            block_grads=block_grads,
        ),
    )
    full = all(p == "full" for p in policies) and bool(policies)
    return MemoryPlan(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        sp=sp,
        dtype=dtype,
        activation_checkpointing="full" if full else (policies[0] if len(set(policies)) == 1 else "auto"),
        rows=rows,
        local_rows=local_rows,
        params=counts,
        params_per_rank=per_rank,
        master_weights_bytes=frozen_base + trainable_bytes,
        grads_bytes=trainable_bytes,
        optimizer_bytes=moment_bytes,
        ema_bytes=trainable * _FP32 if ema else 0,
        optimizer=optimizer,
        base_quant=base_quant,
        unsharded_params_bytes=peak.unsharded_params,
        unsharded_grads_bytes=peak.unsharded_grads,
        activation_bytes=peak.activations,
        transient_bytes=peak.transient,
        reserve_bytes=int(reserve_gib * GIB),
        device_bytes=int(device_memory_gib * GIB),
        rows_origin=rows_origin,
        lora=lora,
        cpu_offload=cpu_offload,
        policies=policies,
        text_rows=text_rows,
        refiner_activation_bytes=refiner_activation_bytes(
            dims, text_rows, dtype, "full" if refiner_recomputed(policies) else "none", lora, fused_norm
        ),
        peak_grads_bytes=None if accum else peak.grads,
        peak_phase=peak.phase,
        recompute_share=recompute_share(dims, rows, policies, text_rows),
        fused_norm=fused_norm,
        auto=activation_checkpointing == "auto",
        adaln_tables=adaln_tables,
        gathered_block_bytes=unsharded_block,
        reduce_buffer_bytes=peak.reduce_buffer,
    )


def _trained_and_frozen(
    counts: ParameterCounts, lora: AdapterCounts | None, base_quant: str, shard: int
) -> tuple[int, int, int, int]:
    """(trainable parameters per rank, frozen base bytes per rank, parameters of one gathered block, trainable
    parameters of one block): a full fine-tune trains everything; a LoRA run's base is frozen in bfloat16
    (its float32 islands aside), a quantized base's matrices at `base_bytes_per_weight`."""
    if lora is None:
        return -(-counts.total // shard), 0, counts.block, counts.block
    frozen = counts.total - lora.train_modules
    base = (frozen - lora.frozen_fp32) * 2 + lora.frozen_fp32 * _FP32
    if base_quant != "none":
        # The matrices outside the islands: everything frozen there but the vectors.
        base -= max(frozen - lora.frozen_fp32 - counts.vectors, 0) * (2 - base_bytes_per_weight(base_quant))
    return -(-lora.trainable // shard), -(-base // shard), counts.block + lora.block_adapters, lora.block_trainable


@dataclass(frozen=True)
class _PeakInputs:
    """What `_step_peak_of` reads of one plan: the mesh's shard group, the rank's rows, the run's kind
    (LoRA, quantized base, offload, tables, kernels) and its trainable state per rank."""

    shard: int
    sp: int
    dtype: str
    local_rows: int
    text_rows: int
    lora: AdapterCounts | None
    base_quant: str
    cpu_offload: bool
    adaln_tables: bool
    fused_norm: bool
    accum: bool
    trainable: int
    trainable_bytes: int
    block_params: int
    block_grads: int


def _step_peak_of(
    dims: Mapping[str, Any], counts: ParameterCounts, policies: tuple[str, ...], x: _PeakInputs
) -> tuple[StepPeak, int]:
    """The step's peak (`step_peak`) and the bytes of one all-gathered block, for `policies` and `x`."""
    layers = _dim(dims, "num_layers")
    shard, sp, dtype, lora, base_quant, cpu_offload = x.shard, x.sp, x.dtype, x.lora, x.base_quant, x.cpu_offload
    b = _DTYPE_BYTES[dtype]
    block_params, block_grads, trainable, trainable_bytes = (
        x.block_params,
        x.block_grads,
        x.trainable,
        x.trainable_bytes,
    )
    local_rows, text_rows, accum = x.local_rows, x.text_rows, x.accum
    one_rank = shard == 1
    # Where the projection is computed from its own shards, its weight and bias stay out of the gathered
    # block, and a full fine-tune's unsharded block gradient (a LoRA's frozen projection has none).
    tables = x.adaln_tables is True and not one_rank and not cpu_offload
    local_adaln = counts.block_adaln if tables else 0
    unsharded_block = _unsharded_block_bytes(dims, counts, block_params, b, lora, base_quant, local_adaln)
    # The block prefetched beside the running one is counted with its projection: the fake-tensor rehearsal,
    # the plan's referee on a CPU, holds one gathered block where CUDA holds two, and shows the projection's
    # saving once. Counting it once keeps the plan on the safe side by one projection's weights (0.48 GiB
    # in bf16 at the released dims), which the rehearsal cannot confirm.
    prefetched_block = _unsharded_block_bytes(dims, counts, block_params, b, lora, base_quant, 0)
    gathered_grads = block_grads - (local_adaln if lora is None else 0)
    plain = one_rank and b == _FP32 and not cpu_offload and lora is None
    # Across ranks FSDP2 copies a block's unsharded gradient into one buffer of the reduce dtype for the
    # reduce-scatter and holds it until the next block's post-backward (`step_peak`). On one rank the measured
    # peaks (`calibration.jsonl`) hold none beside a block's activations.
    reduce_buffer = 0 if one_rank else gathered_grads * _REDUCE_BYTES

    def unsharded(i: int | None) -> int:
        """All-gathered parameter bytes. Across ranks: the unit running and the one prefetched. On one rank
        no block reshards after forward, so every block not yet through its backward stays gathered, with
        the refiner and the root (`model/fsdp.py`); float32 on one rank trains plain tensors (no copy)."""
        if plain:
            return 0
        if not one_rank:
            return unsharded_block + prefetched_block
        rest = (counts.total - layers * counts.block) * b
        if i is None:
            return layers * unsharded_block + rest
        return (i + 1) * unsharded_block + rest if i >= 0 else rest

    block_grad_shard = -(-block_grads // shard) * (trainable_bytes / max(trainable, 1))
    # Trainable parameters outside both block stacks, per rank: what reduces before the stack's backward ends.
    stacks = layers * block_grads + (0 if lora is not None else counts.num_refiner_layers * counts.refiner_block)
    head_grads = -(-max((lora.trainable if lora is not None else counts.total) - stacks, 0) // shard)
    if lora is not None and lora.heads_only:
        acts = heads_activation_bytes(dims, local_rows, sp, text_rows, lora)
        peak = StepPeak("forward", acts, trainable_bytes if accum else 0, unsharded(None), 0)
    else:
        peak = step_peak(
            dims,
            local_rows,
            dtype,
            policies,
            sp=sp,
            text_rows=text_rows,
            lora=lora,
            fused_norm=x.fused_norm,
            grads_bytes=trainable_bytes,
            block_grads_bytes=int(block_grad_shard),
            head_grads_bytes=int(head_grads * trainable_bytes / max(trainable, 1)),
            grads_resident=accum,
            unsharded=unsharded,
            unsharded_block_grads=0 if plain else gathered_grads * b,
            reduce_buffer=reduce_buffer,
        )
    return peak, unsharded_block


def policy_mixes(layers: int) -> list[tuple[str, ...]]:
    """Every per-block mix of the three policies in the order that keeps the backward's peak lowest: the full
    blocks first, then the selective, then the kept (whose activations are freed first as the backward
    starts from the last block)."""
    return [
        ("full",) * n_full + ("selective",) * n_sel + ("none",) * (layers - n_full - n_sel)
        for n_full in range(layers + 1)
        for n_sel in range(layers - n_full + 1)
    ]


def choose_policies(dims: Mapping[str, Any], **kwargs: Any) -> MemoryPlan:
    """`model.activation_checkpointing: auto`: of every mix of none, selective and full (`policy_mixes`), the
    plan with the least recompute (`MemoryPlan.recompute_share`) whose peak fits the device less the
    reserve; the lower peak breaks a tie. When none fits: full recompute, which keeps the least."""
    layers = _dim(dims, "num_layers")
    best: MemoryPlan | None = None
    for mix in policy_mixes(layers):
        candidate = plan_memory(dims, activation_checkpointing="auto", policies=mix, **kwargs)
        if not candidate.fits:
            continue
        key = (round(candidate.recompute_share, 12), candidate.peak_bytes)
        if best is None or key < (round(best.recompute_share, 12), best.peak_bytes):
            best = candidate
    if best is None:
        best = plan_memory(dims, activation_checkpointing="auto", policies=("full",) * layers, **kwargs)
    return best


def _unsharded_block_bytes(
    dims: Mapping[str, Any],
    counts: ParameterCounts,
    block_params: int,
    b: int,
    lora: AdapterCounts | None,
    quant: str,
    local_adaln: int = 0,
) -> int:
    """Bytes of one all-gathered block: every parameter in the compute dtype (`b` bytes), except an int8
    base's matrices, which FSDP2 all-gathers as they are stored (integer codes are not cast).
    `local_adaln`: the AdaLN projection's parameters (weight and bias, `ParameterCounts.block_adaln`) when
    they are not gathered (`parallel.adaln_tables`), else 0."""
    if lora is None or quant == "none" or CODES[quant][0].is_floating_point:
        # float8 codes are floating point: FSDP2 casts them to the compute dtype like any parameter.
        return (block_params - local_adaln) * b
    h = _dim(dims, "hidden_size")
    adaln_bias = _ADALN_VECTORS * _MODALITIES * h
    vectors = 2 * h + 2 * _dim(dims, "attention_head_dim") + adaln_bias
    matrices = counts.block - vectors
    if local_adaln:
        matrices -= local_adaln - adaln_bias
    return matrices * base_bytes_per_weight(quant) + (block_params - local_adaln - matrices) * b


def trainable_state_bytes(
    counts: ParameterCounts, trainable: int, optimizer: str, full: bool, shard: int = 1
) -> tuple[int, int]:
    """(weight bytes, AdamW moment bytes) of `trainable` parameters under `optim.name = optimizer`,
    the gradients taking the weights' bytes. `full`: a full fine-tune, whose float32 islands keep
    float32 under `adamw_bf16` and whose vectors keep float32 moments under torchao's quantized
    kinds (a shard under 4,096 values is not quantized: every 1-D parameter's, at any width); a
    LoRA's trainables are counted all alike. `shard`: the ways each count is divided (per rank).
    """
    islands = -(-counts.fp32_islands // shard) if full and optimizer == "adamw_bf16" else 0
    weights = (trainable - islands) * (2 if optimizer == "adamw_bf16" else _FP32) + islands * _FP32
    plain = islands + (-(-counts.vectors // shard) if full and optimizer in QUANT_BLOCK else 0)
    moments = math.ceil((trainable - plain) * state_bytes_per_value(optimizer)) + plain * 2 * _FP32
    return weights, moments


def longest_fit_rows(dims: Mapping[str, Any], **kwargs: Any) -> int:
    """The most packed rows (a multiple of `sp`) for which `plan_memory(dims, rows=..., **kwargs)` fits; 0: none.

    Memory grows with the rows through the activations alone, never falling, but not in a straight
    line: the text rows are at most the rows, and the recompute peak switches from a refiner block's
    to a transformer block's. So the answer is found by doubling, then bisecting, the local rows.
    """
    sp = kwargs["sp"]

    def fits(local: int) -> bool:
        return plan_memory(dims, rows=local * sp, **kwargs).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * sp


def rows_to_seconds(rows: int, keyframes: bool = True) -> float:
    """Clip seconds at the released 768x1344 canvas of a sample that packs to `rows` rows.

    Linear between the released 5 s (`SHORT_ROWS`) and 15 s (`LONGEST_ROWS`) FL2VA clips:
    each second adds about 7,135 rows (about 7 latent frames of 1,008 rows and 80 audio rows); the
    fixed part is the text prefix and, with `keyframes` (FL2VA's first and last), the two keyframes
    (`KEYFRAME_ROWS`). Negative below the fixed part: no clip fits.
    """
    per_second = (LONGEST_ROWS - SHORT_ROWS) / 10.0
    fixed = SHORT_ROWS - (0 if keyframes else KEYFRAME_ROWS)
    return 5.0 + (rows - fixed) / per_second


# The shortest clip the frame rule (17 n + 5 frames, n >= 1, at 24 fps) allows: 22 frames.
SHORTEST_CLIP_S = 22 / 24
# Reference setups of the LoRA printout: (label, ranks, sp), all 80 GB devices.
LORA_REFERENCE_SETUPS = (("8 x A100-80GB", 8, 8), ("1 x 80 GB GPU", 1, 1))


def fit_kwargs(plan: MemoryPlan) -> dict[str, Any]:
    """The arguments of `plan_memory` that made `plan`, but for the mesh and the rows (`longest_fit_rows`)."""
    return {
        "dtype": plan.dtype,
        "activation_checkpointing": plan.activation_checkpointing,
        "device_memory_gib": plan.device_bytes / GIB,
        "reserve_gib": plan.reserve_bytes / GIB,
        "lora": plan.lora,
        "cpu_offload": plan.cpu_offload,
        # `auto` bounds the rows by the policy that keeps the least: full recompute.
        "policies": tuple("full" for _ in plan.policies) if plan.auto else plan.policies,
        "ema": plan.ema_bytes > 0,
        "text_rows": plan.text_rows,
        "optimizer": plan.optimizer,
        "base_quant": plan.base_quant,
        "grad_accum": 1 if plan.peak_grads_bytes is not None else None,
        "fused_norm": plan.fused_norm,
        "adaln_tables": plan.adaln_tables,
    }


def lora_fit_lines(dims: Mapping[str, Any], plan: MemoryPlan, clip: str = "FL2VA") -> tuple[str, ...]:
    """Lines saying the longest clip that fits this mesh and each reference setup (`LORA_REFERENCE_SETUPS`).

    `clip`: the task's clip the seconds are of (`T2VA`: no keyframe rows; any other: FL2VA's two).
    """
    heads = _dim(dims, "num_attention_heads")
    common = fit_kwargs(plan)
    setups = [("this mesh", plan.dp_replicate, plan.dp_shard, plan.sp)]
    for label, ranks, sp in LORA_REFERENCE_SETUPS:
        sp = math.gcd(sp, heads)
        setups.append((f"{label} (sp={sp})", 1, ranks // sp, sp))
    from ..model.architecture import model_defaults

    # Seconds of the released canvas mean something only for the released architecture.
    released = all(dims.get(k) == v for k, v in model_defaults().items() if not str(k).startswith("_"))
    lines = []
    for label, dp_replicate, dp_shard, sp in setups:
        rows = longest_fit_rows(dims, dp_replicate=dp_replicate, dp_shard=dp_shard, sp=sp, **common)
        seconds = rows_to_seconds(rows, keyframes=clip != "T2VA")
        said = "no clip of the released canvas"
        if seconds >= SHORTEST_CLIP_S:
            said = f"~{seconds:.1f} s of 768x1344 {clip}"
        lines.append(f"  {label:<28} {rows:>11,} rows" + (f"  ({said})" if released else ""))
    return tuple(lines)


class MeshSizes(Protocol):
    """A resolved mesh, e.g. `h3train.parallel.dims.ParallelDims`."""

    dp_replicate: int
    dp_shard: int
    sp: int
