"""The plan's arithmetic: parameter counts and per-rank bytes from constructor kwargs and mesh sizes alone (the
package docstring's memory model). Nothing here reads a config or a dataset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.torch_version import TorchVersion

from ..model.adapter import AdapterCounts
from ..model.quant import CODES, base_bytes_per_weight
from ..optim.kinds import state_bytes_per_value
from ..optim.lowbit import QUANT_BLOCK
from ..tasks.released import KEYFRAME_ROWS, LONGEST_ROWS, SHORT_ROWS

GIB = 1024**3

# AdaLN rows per timestep (video, text, audio) and the six modulation vectors per block.
_MODALITIES = 3
_ADALN_VECTORS = 6

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_FP32 = 4

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


def _dim(dims: Mapping[str, Any], key: str) -> int:
    try:
        return int(dims[key])
    except KeyError:
        raise ValueError(f"model dims lack '{key}': pass h3train.model.dims.model_dims(cfg)") from None


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


def cuda_fused_rms_norm() -> bool:
    """Whether this torch runs `nn.RMSNorm` on CUDA as one fused kernel (`aten::_fused_rms_norm`, torch 2.9
    and later), which keeps for the backward only its input in the compute dtype and one float32 rstd per
    normalised row. Older builds, and every CPU build, run the composite (`_norm_row_bytes`)."""
    return TorchVersion(torch.__version__.split("+")[0]) >= (2, 9)


def fused_norm_for(device: str) -> bool:
    """The norm kernel a run on `device` ("cuda" or "cpu") executes with this torch: fused on CUDA where
    `cuda_fused_rms_norm`, the composite otherwise."""
    return device == "cuda" and cuda_fused_rms_norm()


def _norm_row_bytes(width: int, rows: int = 1, frozen: bool = False, fused: bool = False, b: int = _FP32) -> int:
    """What one RMSNorm keeps per row for the backward. torch's composite (CPU; CUDA before 2.9): the float32
    upcast of its input (4 width) and its rstd (4 per normalised row), plus the float32 normalised copy its
    weight's gradient needs (4 width) unless frozen. The fused CUDA kernel (`fused`): its input as it came,
    in the compute dtype (`b` width), and the float32 rstd, frozen or not."""
    if fused:
        return b * width + _FP32 * rows
    return (4 if frozen else 8) * width + _FP32 * rows


def block_activation_row_bytes(
    dims: Mapping[str, Any], dtype: str, sp: int = 1, frozen_base: bool = False, fused_norm: bool = False
) -> int:
    """Bytes autograd keeps per row of the packed sequence for one `MiniMaxH3TransformerBlock`.

    With h = hidden, a = heads * head_dim, f = ffn, b = bytes of the compute dtype and
    rot = 6 * rope_freq_dim rotated channels per head, following `MiniMaxH3TransformerBlock.forward`
    (the last column: `frozen_base`, where it differs):

        norm1: float32 upcast of its input, float32 normalised, rstd      8h + 4        4h + 4
        (1 + scale_msa) row and norm1's output (the modulation product)   2bh           bh
        q/k/v projection input                                            bh
        norm_q / norm_k: as norm1, per head                               2 (8a + 4 heads)   2 (4a + 4 heads)
        rotary cos / sin cast to the compute dtype, for q and for k       4 b rot   (none in float32)
        q, k, v and output kept by the attention kernel, its logsumexp    4ab + 4 heads
        Ulysses: the all-to-all copy of the attention output (sp > 1)     ab
        gate_msa row, attention projection output                         2bh           bh
        norm2, its modulation, feed-forward input                         8h + 4 + 3bh  4h + 4 + 2bh
        SwiGLU projection output (value | gate), silu(gate), their product 4bf
        gate_mlp row, feed-forward output                                 2bh           bh

    Nothing else survives: the shift rows feed additions, and the rotary multiplications keep only
    cos / sin. The norm terms are those of torch's composite RMSNorm (CPU, and CUDA before torch 2.9);
    `fused_norm` (CUDA's fused kernel, `cuda_fused_rms_norm`) keeps each norm's input in the compute
    dtype and its rstd instead (bh + 4 for norm1, 150,528 bytes a row less in all for the 33 B
    model). The attention terms assume an O(S)-memory kernel (flash, cuDNN, efficient
    SDPA); a math backend would also keep the (heads / sp) x S x S scores.

    `frozen_base`: no parameter of the block's base needs a gradient (a LoRA run with no
    `lora.train_modules` inside the block), so what only a weight's gradient reads is not kept: the
    norms' normalised copies, and the products the frozen AdaLN rows multiply (scale_msa, gate_msa,
    scale_mlp, gate_mlp: their rows stay, for the gradient of the other factor). The Linear inputs
    stay: each adapter's lora_A reads the base layer's input and keeps it for its own weight's
    gradient (its rank-r output is `plan_memory`'s). A block with fewer adapted Linears than the
    default targets (attention and feed-forward) keeps at most this.

    For the 33 B model in bfloat16 (h 5376, a 56 x 128, f 14336, rot 96) that is 481,704 bytes
    (470 KiB) per row per block, 496,040 bytes with sp > 1; with a frozen base 338,344 bytes
    (330 KiB), 352,680 with sp > 1. With the fused norm: 331,176 bytes (323 KiB) per row per block.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    heads = _dim(dims, "num_attention_heads")
    a = heads * _dim(dims, "attention_head_dim")
    f = _dim(dims, "ffn_dim")
    rot = 6 * _dim(dims, "rope_freq_dim")
    # Kept only for a weight's gradient: the modulation products and the gated outputs, one bh each.
    product = 0 if frozen_base else b * h

    def norm(width: int, rows: int = 1) -> int:
        return _norm_row_bytes(width, rows, frozen_base, fused_norm, b)

    terms = {
        "norm1, its modulation, q/k/v input": norm(h) + b * h + product + b * h,
        "norm_q, norm_k": 2 * norm(a, heads),
        "rotary tables cast per call": 0 if b == _FP32 else 4 * b * rot,
        "attention kernel": 4 * a * b + _FP32 * heads,
        "Ulysses output all-to-all": a * b if sp > 1 else 0,
        "gate_msa, attention output": b * h + product,
        "norm2, its modulation, feed-forward input": norm(h) + 2 * b * h + product,
        "SwiGLU": 4 * b * f,
        "gate_mlp, feed-forward output": b * h + product,
    }
    return sum(terms.values())


def refiner_block_row_bytes(dims: Mapping[str, Any], dtype: str, fused_norm: bool = False) -> int:
    """Bytes autograd keeps per text row for one `MiniMaxH3TokenRefinerBlock` whose parameters train.

    A plain pre-norm block (no AdaLN, no rotary), so with the symbols of `block_activation_row_bytes`:

        norm1, and its output (the q/k/v projection input)                8h + 4 + bh
        norm_q / norm_k                                                   2 (8a + 4 heads)
        q, k (the q/k norms' outputs), v and output, its logsumexp        4ab + 4 heads
        norm2, and its output (the feed-forward input)                    8h + 4 + bh
        SwiGLU projection output, silu(gate), their product               4bf

    The residual additions keep nothing: no gate multiplies the attention or feed-forward output.
    For the 33 B model in bfloat16 that is 394,920 bytes (386 KiB) per text row; the norms as in
    `block_activation_row_bytes` with `fused_norm`.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    heads = _dim(dims, "num_attention_heads")
    a = heads * _dim(dims, "attention_head_dim")
    f = _dim(dims, "ffn_dim")
    terms = {
        "norm1, q/k/v input": _norm_row_bytes(h, fused=fused_norm, b=b) + b * h,
        "norm_q, norm_k": 2 * _norm_row_bytes(a, heads, fused=fused_norm, b=b),
        "attention kernel": 4 * a * b + _FP32 * heads,
        "norm2, feed-forward input": _norm_row_bytes(h, fused=fused_norm, b=b) + b * h,
        "SwiGLU": 4 * b * f,
    }
    return sum(terms.values())


def _frozen_parts(dims: Mapping[str, Any], lora: AdapterCounts | None) -> tuple[bool, bool]:
    """(whether a block's base is frozen, whether everything outside the block stack is) for `lora`'s run.

    A block's base is frozen when its trainable parameters are adapters alone. Outside the stack is
    frozen when every trainable parameter sits in the blocks; otherwise the plan cannot tell whether
    the trained part comes before the stack (the gradient then reaches the refiner) and counts it as
    a full fine-tune would, an upper bound.
    """
    if lora is None:
        return False, False
    layers = _dim(dims, "num_layers")
    return lora.block_trainable == lora.block_adapters, lora.trainable <= layers * lora.block_trainable


def output_stage_row_bytes(
    dims: Mapping[str, Any], dtype: str, frozen_base: bool = False, fused_norm: bool = False
) -> int:
    """Bytes per row the output stage keeps for the backward: `norm_out` (RMSNorm, `_norm_row_bytes`, and its
    modulation, 2bh) and the float32 cast feeding the two output heads (4h). Its backward runs first and
    frees them before the block stack's backward starts (`step_peak`).

    `frozen_base` (nothing outside the blocks trains): `norm_out`'s norm as frozen and its (1 + scale) row
    (bh); the frozen heads keep no input.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    if frozen_base:
        return _norm_row_bytes(h, frozen=True, fused=fused_norm, b=b) + b * h
    return _norm_row_bytes(h, fused=fused_norm, b=b) + 2 * b * h + _FP32 * h


def persistent_row_bytes(dims: Mapping[str, Any], frozen_base: bool = False) -> int:
    """Bytes per row kept from the forward to the end of the backward outside the blocks: the float32 rotary
    tables every block reads (2 x 4 rot) and, unless nothing outside the blocks trains, the float32 inputs
    of the two patch projections (counted for every row). At sp = 1 the packing's `index_copy` also keeps
    the embedded rows it places (bh per row), left out (under 1 % of a row's activations in a stack of 50
    blocks). The text refiner runs over the text rows only: `refiner_activation_bytes`."""
    rot = 6 * _dim(dims, "rope_freq_dim")
    if frozen_base:
        return 2 * _FP32 * rot
    video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in dims["patch_size"])
    return 2 * _FP32 * rot + _FP32 * (video_patch + _dim(dims, "audio_in_channels"))


def outside_stack_row_bytes(
    dims: Mapping[str, Any], dtype: str, frozen_base: bool = False, fused_norm: bool = False
) -> int:
    """Bytes per row kept outside the block stack at the end of the forward: the output stage
    (`output_stage_row_bytes`) and what stays to the end (`persistent_row_bytes`)."""
    return output_stage_row_bytes(dims, dtype, frozen_base, fused_norm) + persistent_row_bytes(dims, frozen_base)


def refiner_activation_bytes(
    dims: Mapping[str, Any],
    text_rows: int,
    dtype: str,
    activation_checkpointing: str,
    lora: AdapterCounts | None = None,
    fused_norm: bool = False,
) -> int:
    """Bytes the text refiner keeps for the backward on each rank: it runs over all `text_rows` text
    rows on every SP rank, before the sequence is split, so sp does not divide them.

    Per text row: the context embedder's input cast to the compute dtype (b * text_dim; none in
    float32, where the float32 prompt is read as it is), each refiner block's
    `refiner_block_row_bytes` (recomputed, `activation_checkpointing="full"`: only its input, bh) and
    `final_norm`. A LoRA run (`lora`) whose trainable parameters all sit in the block stack keeps
    nothing here: no gradient reaches the refiner.
    """
    if text_rows <= 0 or _frozen_parts(dims, lora)[1] or (lora is not None and lora.heads_only):
        return 0
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    cast = 0 if b == _FP32 else b * _dim(dims, "text_dim")
    block = b * h if activation_checkpointing == "full" else refiner_block_row_bytes(dims, dtype, fused_norm)
    return text_rows * (cast + _dim(dims, "num_refiner_layers") * block + _norm_row_bytes(h, fused=fused_norm, b=b))


def heads_activation_bytes(
    dims: Mapping[str, Any], local_rows: int, sp: int, text_rows: int, lora: AdapterCounts
) -> int:
    """Peak activation memory of one rank when only the output projections train (`lora.heads_only`).

    Nothing before them needs a gradient, so the blocks, the refiner and `norm_out` keep nothing, with
    or without checkpointing (which then has nothing to recompute). Per local row: the float32 cast of
    `norm_out`'s output that the projections (float32 islands) read, kept by their adapters (4h, one
    tensor for both heads), and what the adapters keep beyond it (`head_row_values`, float32). The
    loss runs over the whole sequence on every SP rank and keeps, per row outside the text, the float32
    error of the trained projection's prediction (`head_output_values`, the widest; with sp > 1 the
    heads' outputs travel in one all-gather, so both heads' errors are kept: the wider one). An upper
    bound, as rows that no head predicts (keyframes) count too. `head_delta_values` once.
    """
    h = _dim(dims, "hidden_size")
    widest = lora.head_output_values
    if sp > 1:
        video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in dims["patch_size"])
        widest = max(widest, video_patch, _dim(dims, "audio_in_channels"))
    predicted = max(local_rows * sp - text_rows, 0)
    return _FP32 * (local_rows * (h + lora.head_row_values) + predicted * widest + lora.head_delta_values)


# What a transformer block does in the backward, per block (`model.activation_checkpointing`): keep
# everything (none), keep the attention kernel's output and logsumexp and recompute the rest
# (selective), or keep only its input and recompute it whole (full).
BLOCK_POLICIES = ("none", "selective", "full")


def block_saved_row_bytes(
    dims: Mapping[str, Any], dtype: str, policy: str, sp: int = 1, frozen_base: bool = False, fused_norm: bool = False
) -> int:
    """Bytes per row one transformer block keeps from its forward to its backward under `policy`.

    none: `block_activation_row_bytes`. selective: its input (bh), the attention output (ab) and the
    kernel's float32 logsumexp (4 heads): torch's selective checkpoint saves the attention op's outputs and
    recomputes every other op. full: its input (bh).
    """
    if policy == "none":
        return block_activation_row_bytes(dims, dtype, sp, frozen_base, fused_norm)
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    if policy == "full":
        return b * h
    if policy == "selective":
        heads = _dim(dims, "num_attention_heads")
        return b * h + heads * _dim(dims, "attention_head_dim") * b + _FP32 * heads
    raise ValueError(f"block policy {policy!r} is not one of {', '.join(BLOCK_POLICIES)}")


def block_policies(activation_checkpointing: str, num_layers: int) -> tuple[str, ...]:
    """One policy per transformer block for a uniform `activation_checkpointing` (none, selective, full)."""
    if activation_checkpointing not in BLOCK_POLICIES:
        raise ValueError(f"activation_checkpointing {activation_checkpointing!r} is not one of {BLOCK_POLICIES}")
    return (activation_checkpointing,) * num_layers


def refiner_recomputed(policies: tuple[str, ...]) -> bool:
    """The text-refiner blocks are recomputed when any transformer block is (`SequenceParallelH3`)."""
    return "full" in policies


@dataclass(frozen=True)
class StepPeak:
    """The most one rank's training step holds beside its resident state, and where (`step_peak`)."""

    # "forward" (its end: everything kept, no gradient yet), "block i" (the backward through block i),
    # "refiner" or "end" (every gradient, no activation).
    phase: str
    activations: int
    grads: int
    unsharded_params: int
    unsharded_grads: int
    # Of `activations`, what the backward creates and frees (gradients in flight, the loss's error), not kept
    # from the forward.
    transient: int = 0
    # Of `unsharded_grads`, FSDP2's float32 reduce-scatter buffer of the block reduced before this one.
    reduce_buffer: int = 0

    @property
    def total(self) -> int:
        return self.activations + self.grads + self.unsharded_params + self.unsharded_grads


def step_peak(
    dims: Mapping[str, Any],
    local_rows: int,
    dtype: str,
    policies: tuple[str, ...],
    *,
    sp: int = 1,
    text_rows: int = 0,
    lora: AdapterCounts | None = None,
    fused_norm: bool = False,
    grads_bytes: int = 0,
    block_grads_bytes: int = 0,
    head_grads_bytes: int = 0,
    grads_resident: bool = False,
    unsharded: Callable[[int | None], int] | None = None,
    unsharded_block_grads: int = 0,
    reduce_buffer: int = 0,
) -> StepPeak:
    """Walk one training step's forward end and its backward block by block, and return its peak.

    Per rank, `local_rows` rows of the packed sequence, `policies` one per transformer block (`BLOCK_POLICIES`).
    The backward runs the output stage, then the blocks from the last, then the text refiner:

    - forward end: every block's saved rows (`block_saved_row_bytes`), the output stage, the persistent
      rows and the refiner's; no gradient (`grads_resident`: all of them, as with grad_accum > 1);
    - block i: blocks 0..i-1 still hold their saved rows, the output stage is freed, block i holds all its
      activations (kept, or recomputed: the same tensors), the backward's largest transient (the gradient
      of the SwiGLU projection's output, 2bf) and the residual stream's gradient in flight (2bh); the
      gradients of the blocks after i (`block_grads_bytes` each, sharded) and of the units outside the
      stack exist, and block i's own unsharded gradient (`unsharded_block_grads`) with, from the second block
      the backward runs, FSDP2's reduce-scatter buffer of the block after it (`reduce_buffer`), which FSDP2
      frees at block i's post-backward;
    - output heads: the forward's end and the loss's float32 error and the gradient of both heads' outputs
      (2 x 4 x (P_v + P_a) a row), as the backward starts;
    - refiner: its recompute over the text rows with every block gradient reduced; end: every gradient.

    `head_grads_bytes`: the gradients of the units outside both stacks (the output stage, the root and
    the float32 islands), which exist through the stack's backward; the refiner's arrive after it.

    `unsharded(i)`: the all-gathered parameter bytes while the backward is in block i (None: the forward
    end). `grads_bytes`: every trainable gradient of the rank. A LoRA run's adapters keep their rank-r
    values per row of every block (`AdapterCounts.block_row_values`) and their delta weights.
    """
    layers = _dim(dims, "num_layers")
    if len(policies) != layers:
        raise ValueError(f"{len(policies)} block policies for {layers} blocks")
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    block_frozen, outside_frozen = _frozen_parts(dims, lora)
    whole = local_rows * block_activation_row_bytes(dims, dtype, sp, block_frozen, fused_norm)
    saved = [local_rows * block_saved_row_bytes(dims, dtype, p, sp, block_frozen, fused_norm) for p in policies]
    if block_frozen and outside_frozen and policies and policies[0] == "none":
        # Nothing before block 0's first adapted Linear needs a gradient: its norm1 and modulation keep nothing.
        drop = local_rows * (_norm_row_bytes(h, frozen=True, fused=fused_norm, b=b) + b * h)
        whole -= drop
        saved[0] -= drop
    adapters = 0 if lora is None else local_rows * lora.block_row_values * b + lora.block_delta_values * b
    output_stage = local_rows * output_stage_row_bytes(dims, dtype, outside_frozen, fused_norm)
    persistent = local_rows * persistent_row_bytes(dims, outside_frozen)
    refiner_full = refiner_recomputed(policies)
    refiner = refiner_activation_bytes(dims, text_rows, dtype, "full" if refiner_full else "none", lora, fused_norm)
    unsharded = unsharded or (lambda i: 0)
    resident = grads_bytes if grads_resident else 0
    outside_grads = min(head_grads_bytes, grads_bytes)
    transient = local_rows * (2 * b * _dim(dims, "ffn_dim") + 2 * b * h)
    # The loss's float32 error and the gradient of both heads' outputs, per row, as the backward starts.
    video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in dims["patch_size"])
    heads_grad = 2 * _FP32 * (video_patch + _dim(dims, "audio_in_channels"))
    kept = [s + adapters if p == "none" else s for s, p in zip(saved, policies)]
    forward_end = sum(kept) + output_stage + persistent + refiner
    phases = [
        StepPeak("forward", forward_end, resident, unsharded(None), 0),
        StepPeak(
            "output heads", forward_end + local_rows * heads_grad, resident, unsharded(None), 0, local_rows * heads_grad
        ),
    ]
    below = sum(kept)
    for i in range(layers - 1, -1, -1):
        below -= kept[i]
        reduced = resident if grads_resident else min(outside_grads + (layers - 1 - i) * block_grads_bytes, grads_bytes)
        acts = below + whole + adapters + transient + persistent + refiner
        buffer = reduce_buffer if i < layers - 1 else 0
        phases.append(
            StepPeak(f"block {i}", acts, reduced, unsharded(i), unsharded_block_grads + buffer, transient, buffer)
        )
    if refiner_full and refiner:
        recompute = text_rows * refiner_block_row_bytes(dims, dtype, fused_norm)
        phases.append(StepPeak("refiner", refiner + recompute, grads_bytes, unsharded(-1), 0))
    phases.append(StepPeak("end", 0, grads_bytes, 0, 0))
    return max(phases, key=lambda p: p.total)


def forward_flops(dims: Mapping[str, Any], rows: int, text_rows: int = 0) -> tuple[int, int, int]:
    """Forward FLOPs of the matmuls of one packed sequence of `rows` rows: (per transformer block's linears,
    per transformer block's attention, everything else: refiner blocks and heads). As
    `tools/bench/flops.py` counts them, without the per-timestep tables."""
    h = _dim(dims, "hidden_size")
    a = _dim(dims, "num_attention_heads") * _dim(dims, "attention_head_dim")
    f = _dim(dims, "ffn_dim")
    video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in dims["patch_size"])
    linear = 2 * rows * (4 * h * a + 3 * h * f)
    attention = 4 * rows * rows * a
    heads = 2 * rows * h * (video_patch + _dim(dims, "audio_in_channels"))
    return linear, attention, refiner_forward_flops(dims, text_rows) + heads


def refiner_forward_flops(dims: Mapping[str, Any], text_rows: int) -> int:
    """Forward FLOPs of the matmuls of the text refiner's blocks over `text_rows` rows (every SP rank runs
    them over every text row)."""
    h = _dim(dims, "hidden_size")
    a = _dim(dims, "num_attention_heads") * _dim(dims, "attention_head_dim")
    f = _dim(dims, "ffn_dim")
    return _dim(dims, "num_refiner_layers") * (2 * text_rows * (4 * h * a + 3 * h * f) + 4 * text_rows**2 * a)


def recompute_share(dims: Mapping[str, Any], rows: int, policies: tuple[str, ...], text_rows: int = 0) -> float:
    """The forward FLOPs the backward runs again under `policies`, as a share of the forward's: a full block
    recomputes its linears and attention, a selective one its linears, and the refiner blocks are
    recomputed with any full block."""
    linear, attention, other = forward_flops(dims, rows, text_rows)
    total = len(policies) * (linear + attention) + other
    again = sum(linear + attention if p == "full" else linear if p == "selective" else 0 for p in policies)
    if refiner_recomputed(policies):
        again += refiner_forward_flops(dims, text_rows)
    return again / total if total else 0.0


def activation_bytes(
    dims: Mapping[str, Any],
    local_rows: int,
    dtype: str,
    activation_checkpointing: str | tuple[str, ...],
    sp: int = 1,
    *,
    text_rows: int = 0,
    lora: AdapterCounts | None = None,
    fused_norm: bool = False,
) -> int:
    """Activation bytes of one rank at its training step's peak (`step_peak`), with no gradient or
    parameter beside them: `activation_checkpointing` is one policy for every block or one per block.
    When only the output projections train, `heads_activation_bytes`."""
    if lora is not None and lora.heads_only:
        return heads_activation_bytes(dims, local_rows, sp, text_rows, lora)
    layers = _dim(dims, "num_layers")
    policies = (
        block_policies(activation_checkpointing, layers)
        if isinstance(activation_checkpointing, str)
        else tuple(activation_checkpointing)
    )
    return step_peak(
        dims, local_rows, dtype, policies, sp=sp, text_rows=text_rows, lora=lora, fused_norm=fused_norm
    ).activations


def evaluation_activation_bytes(dims: Mapping[str, Any], local_rows: int, dtype: str, sp: int, text_rows: int) -> int:
    """The most one no-grad forward over `local_rows` rows (and `text_rows` text rows) holds at once.

    Under `no_grad` a block's intermediates are freed as the block goes on, so the forward holds the
    residual stream (the block's input and output, 2bh per row) and at most what one block keeps for a
    backward (`block_activation_row_bytes`, an upper bound of its live intermediates). The text refiner
    runs first, over the text rows on every SP rank, never beside a transformer block.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    stack = local_rows * (block_activation_row_bytes(dims, dtype, sp) + 2 * b * h)
    refiner = text_rows * (refiner_block_row_bytes(dims, dtype) + 2 * b * h)
    return max(stack, refiner)


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

    `dims` are the constructor kwargs with defaults filled in (`h3train.model.dims.model_dims`);
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
    layers = _dim(dims, "num_layers")
    if policies is None and activation_checkpointing == "auto":
        return choose_policies(dims, **common)
    if policies is None:
        policies = block_policies(activation_checkpointing, layers)
    policies = tuple(policies)
    counts = parameter_counts(dims)
    shard = dp_shard * sp
    per_rank = -(-counts.total // shard)
    local_rows = -(-rows // sp)
    b = _DTYPE_BYTES[dtype]
    text_rows = min(max(text_rows, 0), rows)
    if lora is None:
        trainable, block_params, block_grads = per_rank, counts.block, counts.block
        frozen_base = 0
    else:
        frozen = counts.total - lora.train_modules
        base = (frozen - lora.frozen_fp32) * 2 + lora.frozen_fp32 * _FP32
        if base_quant != "none":
            # The matrices outside the islands: everything frozen there but the vectors.
            base -= max(frozen - lora.frozen_fp32 - counts.vectors, 0) * (2 - base_bytes_per_weight(base_quant))
        trainable, frozen_base = -(-lora.trainable // shard), -(-base // shard)
        block_params, block_grads = counts.block + lora.block_adapters, lora.block_trainable
    trainable_bytes, moment_bytes = trainable_state_bytes(counts, trainable, optimizer, lora is None, shard)
    one_rank = shard == 1
    # Where the projection is computed from its own shards, its weight and bias stay out of the gathered
    # block, and a full fine-tune's unsharded block gradient (a LoRA's frozen projection has none).
    tables = adaln_tables is True and not one_rank and not cpu_offload
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

    accum = grad_accum != 1
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
            fused_norm=fused_norm,
            grads_bytes=trainable_bytes,
            block_grads_bytes=int(block_grad_shard),
            head_grads_bytes=int(head_grads * trainable_bytes / max(trainable, 1)),
            grads_resident=accum,
            unsharded=unsharded,
            unsharded_block_grads=0 if plain else gathered_grads * b,
            reduce_buffer=reduce_buffer,
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
    from ..model.dims import model_defaults

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
