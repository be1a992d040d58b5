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

GIB = 1024**3

# Packed rows of the longest released FL2VA clip: 15 s at 768x1344 (362 frames -> 107 latent frames
# of 24 x 42 rows = 107,856), first + last keyframes (2 x 1,008), stereo audio (2 x 603) and a
# 2,048-row text prefix (prompt plus the keyframes' Qwen3-VL vision blocks). The 5 s clip at the
# same canvas (124 frames -> 37 latent frames, 2 x 207 audio rows) packs to 41,774 rows.
RELEASED_MAX_ROWS = 113_126
RELEASED_5S_ROWS = 41_774
# The text prefix of both: the rows the text refiner runs over.
RELEASED_TEXT_ROWS = 2_048

# AdaLN rows per timestep (video, text, audio) and the six modulation vectors per block.
_MODALITIES = 3
_ADALN_VECTORS = 6

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_FP32 = 4

DEFAULT_DEVICE_MEMORY_GIB = 80.0
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
    # `model.activation_checkpointing`: none, full or selective.
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
    # Transformer blocks recomputed in backward (`model.activation_checkpointing`); None: all of them
    # when `full`, else none.
    checkpointed_layers: int | None = None
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
    # Of `grads_bytes`, what is resident at the backward's activation peak (`backward_grads_bytes`);
    # None: all of it (gradients accumulate over micro-batches).
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


def _norm_row_bytes(width: int, rows: int = 1, frozen: bool = False) -> int:
    """torch's composite RMSNorm per row: the float32 upcast of its input (4 width) and its rstd (4 per
    normalised row), plus the float32 normalised copy its weight's gradient needs (4 width) unless frozen."""
    return (4 if frozen else 8) * width + _FP32 * rows


def block_activation_row_bytes(dims: Mapping[str, Any], dtype: str, sp: int = 1, frozen_base: bool = False) -> int:
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
    cos / sin. The norm terms are those of torch's composite RMSNorm (CPU, and CUDA builds without a
    fused kernel); a fused kernel keeps only its input (bh instead of 8h), so on such builds this is
    an upper bound. The attention terms assume an O(S)-memory kernel (flash, cuDNN, efficient
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
    (330 KiB), 352,680 with sp > 1.
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
        return _norm_row_bytes(width, rows, frozen_base)

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


def refiner_block_row_bytes(dims: Mapping[str, Any], dtype: str) -> int:
    """Bytes autograd keeps per text row for one `MiniMaxH3TokenRefinerBlock` whose parameters train.

    A plain pre-norm block (no AdaLN, no rotary), so with the symbols of `block_activation_row_bytes`:

        norm1, and its output (the q/k/v projection input)                8h + 4 + bh
        norm_q / norm_k                                                   2 (8a + 4 heads)
        q, k (the q/k norms' outputs), v and output, its logsumexp        4ab + 4 heads
        norm2, and its output (the feed-forward input)                    8h + 4 + bh
        SwiGLU projection output, silu(gate), their product               4bf

    The residual additions keep nothing: no gate multiplies the attention or feed-forward output.
    For the 33 B model in bfloat16 that is 394,920 bytes (386 KiB) per text row.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    heads = _dim(dims, "num_attention_heads")
    a = heads * _dim(dims, "attention_head_dim")
    f = _dim(dims, "ffn_dim")
    terms = {
        "norm1, q/k/v input": _norm_row_bytes(h) + b * h,
        "norm_q, norm_k": 2 * _norm_row_bytes(a, heads),
        "attention kernel": 4 * a * b + _FP32 * heads,
        "norm2, feed-forward input": _norm_row_bytes(h) + b * h,
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


def outside_stack_row_bytes(dims: Mapping[str, Any], dtype: str, frozen_base: bool = False) -> int:
    """Bytes per row kept outside the block stack, an upper bound shared by every configuration.

    `norm_out` (composite RMSNorm 8h + 4, modulation 2bh), the float32 cast feeding the two output
    heads (4h), the float32 rotary tables every block reads (2 x 4 rot) and the float32 inputs of
    the two patch projections (counted for every row). At sp = 1 the packing's `index_copy` also
    keeps the embedded rows it places (bh per row), left out (under 1 % of a row's activations in a
    stack of 50 blocks). The text refiner runs over the text rows only: `refiner_activation_bytes`.

    `frozen_base` (nothing outside the blocks trains): `norm_out` keeps its float32 input and rstd
    (4h + 4) and its (1 + scale) row (bh); the frozen heads and patch projections keep no input.
    """
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    rot = 6 * _dim(dims, "rope_freq_dim")
    if frozen_base:
        return _norm_row_bytes(h, frozen=True) + b * h + 2 * _FP32 * rot
    video_patch = _dim(dims, "in_channels") * math.prod(int(p) for p in dims["patch_size"])
    patch_inputs = _FP32 * (video_patch + _dim(dims, "audio_in_channels"))
    return 8 * h + _FP32 + 2 * b * h + _FP32 * h + 2 * _FP32 * rot + patch_inputs


def refiner_activation_bytes(
    dims: Mapping[str, Any],
    text_rows: int,
    dtype: str,
    activation_checkpointing: str,
    lora: AdapterCounts | None = None,
) -> int:
    """Bytes the text refiner keeps for the backward on each rank: it runs over all `text_rows` text
    rows on every SP rank, before the sequence is split, so sp does not divide them.

    Per text row: the context embedder's input cast to the compute dtype (b * text_dim; none in
    float32, where the float32 prompt is read as it is), each refiner block's
    `refiner_block_row_bytes` (with `full` checkpointing only its input, bh) and `final_norm`
    (8h + 4). A LoRA run (`lora`) whose trainable parameters all sit in the block stack keeps
    nothing here: no gradient reaches the refiner.
    """
    if text_rows <= 0 or _frozen_parts(dims, lora)[1] or (lora is not None and lora.heads_only):
        return 0
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    cast = 0 if b == _FP32 else b * _dim(dims, "text_dim")
    block = b * h if activation_checkpointing == "full" else refiner_block_row_bytes(dims, dtype)
    return text_rows * (cast + _dim(dims, "num_refiner_layers") * block + _norm_row_bytes(h))


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


def activation_bytes(
    dims: Mapping[str, Any],
    local_rows: int,
    dtype: str,
    activation_checkpointing: str,
    sp: int = 1,
    checkpointed_layers: int | None = None,
    *,
    text_rows: int = 0,
    lora: AdapterCounts | None = None,
) -> int:
    """Peak activation memory of one rank holding `local_rows` rows of the packed sequence.

    With checkpointing each block keeps only its input (bh per row) and the backward recomputes
    one block at a time, so the peak is every block's input plus one block's full activations.
    Without it every block keeps everything `block_activation_row_bytes` lists. Selective
    checkpointing (`checkpointed_layers` of the blocks) sits between: the checkpointed blocks keep
    their inputs, the others everything, plus one recomputed block at a time.

    `text_rows`: the sample's text rows, which the refiner runs over (`refiner_activation_bytes`;
    0: not counted). Full checkpointing (`activation_checkpointing="full"`) recomputes its blocks too, after
    the stack's backward, so the recompute peak is the larger of one block over the local rows and
    one refiner block over the text rows.

    `lora`: a LoRA run's counts. Its frozen base keeps less (`frozen_base` of the row functions),
    and when only the blocks train, nothing before block 0's first adapted Linear needs a gradient:
    the refiner keeps nothing, nor do block 0's norm1 and modulation (4h + 4 + bh per row less,
    unless block 0 is checkpointed). The adapters' own per-row values are `plan_memory`'s. When only
    the output projections train, `heads_activation_bytes`.
    """
    if lora is not None and lora.heads_only:
        return heads_activation_bytes(dims, local_rows, sp, text_rows, lora)
    b = _DTYPE_BYTES[dtype]
    h = _dim(dims, "hidden_size")
    layers = _dim(dims, "num_layers")
    block_frozen, outside_frozen = _frozen_parts(dims, lora)
    block = block_activation_row_bytes(dims, dtype, sp, frozen_base=block_frozen)
    full = activation_checkpointing == "full"
    done = (layers if full else 0) if checkpointed_layers is None else checkpointed_layers
    per_row = done * h * b + (layers - done) * block + outside_stack_row_bytes(dims, dtype, outside_frozen)
    if block_frozen and outside_frozen and not done:
        per_row -= _norm_row_bytes(h, frozen=True) + b * h
    refiner_recompute = full and text_rows > 0 and not outside_frozen
    recompute = max(
        local_rows * block if done else 0,
        text_rows * refiner_block_row_bytes(dims, dtype) if refiner_recompute else 0,
    )
    refiner = refiner_activation_bytes(dims, text_rows, dtype, activation_checkpointing, lora)
    return local_rows * per_row + refiner + recompute


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
    checkpointed_layers: int | None = None,
    ema: bool = False,
    text_rows: int = 0,
    optimizer: str = "adamw",
    base_quant: str = "none",
    grad_accum: int | None = None,
) -> MemoryPlan:
    """Per-rank memory of an AdamW fine-tune on a resolved `(dp_replicate, dp_shard, sp)` mesh.

    `dims` are the constructor kwargs with defaults filled in (`h3train.model.dims.model_dims`);
    `dtype` is the compute dtype (`model.dtype`); `activation_checkpointing` is
    `model.activation_checkpointing` (none, full or selective); `rows` is the packed sequence length of the
    longest sample, padded to a multiple of `sp` as the SP forward does. `lora`: a LoRA run
    (`lora_counts`), whose base is frozen in bfloat16; None: a full fine-tune. `cpu_offload`: the
    sharded state is counted in host memory, not on the device. `checkpointed_layers`: selective
    checkpointing (`activation_bytes`). `ema`: an EMA of the trainable parameters (`train.ema.decay`),
    a float32 shadow of each, sharded (and offloaded) as its parameter is. `text_rows`: the sample's
    text rows (at most `rows`), which the text refiner runs over on every SP rank; 0 leaves the
    refiner out. `optimizer`: `optim.name`; `adamw_bf16` stores the trainable weights and gradients
    in bfloat16 (its float32 islands, which a LoRA's adapters are counted outside of, in float32),
    and each kind its moments at `state_bytes_per_value` bytes (8 for float32 AdamW). `base_quant`:
    `lora.base_quant`, the frozen base's matrices at 1 byte per weight (the row scales, 2 bytes per
    row of thousands of inputs, are left out), its vectors in bfloat16 and islands in float32.
    `grad_accum`: `train.grad_accum`; at 1 the gradients count beside the activations only as far as
    `backward_grads_bytes` says they coexist; None (or more) counts all of them beside the activations.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("sp", sp), ("rows", rows)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value} (resolve dp_shard=-1 against the world size first)")
    counts = parameter_counts(dims)
    shard = dp_shard * sp
    per_rank = -(-counts.total // shard)
    local_rows = -(-rows // sp)
    b = _DTYPE_BYTES[dtype]
    text_rows = min(max(text_rows, 0), rows)
    activations = activation_bytes(
        dims, local_rows, dtype, activation_checkpointing, sp, checkpointed_layers, text_rows=text_rows, lora=lora
    )
    full = activation_checkpointing == "full"
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
        # Each adapted Linear keeps what its kind needs beyond the base's input, already counted: per
        # row (LoRA its lora_A output, DoRA also its norms' rows) or once (LoKr / LoHa: the delta
        # weight). Checkpointing holds one block's worth at a time.
        layers = _dim(dims, "num_layers")
        done = (layers if full else 0) if checkpointed_layers is None else checkpointed_layers
        blocks = layers - done + (1 if done else 0)
        activations += blocks * (local_rows * lora.block_row_values + lora.block_delta_values) * b
    trainable_bytes, moment_bytes = trainable_state_bytes(counts, trainable, optimizer, lora is None, shard)
    peak_grads = None
    if grad_accum == 1:
        layers = _dim(dims, "num_layers")
        done = (layers if full else 0) if checkpointed_layers is None else checkpointed_layers
        block = block_activation_row_bytes(dims, dtype, sp, frozen_base=_frozen_parts(dims, lora)[0])
        # What the blocks keep for the backward, given up block by block as it proceeds (nothing when
        # only the output projections train).
        freed = local_rows * (done * _dim(dims, "hidden_size") * b + (layers - done) * block)
        if lora is not None and lora.heads_only:
            freed = 0
        peak_grads = backward_grads_bytes(trainable_bytes, freed)
    return MemoryPlan(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        sp=sp,
        dtype=dtype,
        activation_checkpointing=activation_checkpointing,
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
        # Counted at every mesh size: the compute-dtype copy of a unit exists even unsharded, and a
        # one-rank mesh is not a layout the 33 B model fits in anyway.
        unsharded_params_bytes=2 * _unsharded_block_bytes(dims, counts, block_params, b, lora, base_quant),
        unsharded_grads_bytes=block_grads * _FP32,
        activation_bytes=activations,
        reserve_bytes=int(reserve_gib * GIB),
        device_bytes=int(device_memory_gib * GIB),
        rows_origin=rows_origin,
        lora=lora,
        cpu_offload=cpu_offload,
        checkpointed_layers=checkpointed_layers,
        text_rows=text_rows,
        refiner_activation_bytes=refiner_activation_bytes(dims, text_rows, dtype, activation_checkpointing, lora),
        peak_grads_bytes=peak_grads,
    )


def _unsharded_block_bytes(
    dims: Mapping[str, Any], counts: ParameterCounts, block_params: int, b: int, lora: AdapterCounts | None, quant: str
) -> int:
    """Bytes of one all-gathered block: every parameter in the compute dtype (`b` bytes), except an int8
    base's matrices, which FSDP2 all-gathers as they are stored (integer codes are not cast)."""
    if lora is None or quant == "none" or CODES[quant][0].is_floating_point:
        # float8 codes are floating point: FSDP2 casts them to the compute dtype like any parameter.
        return block_params * b
    h = _dim(dims, "hidden_size")
    vectors = 2 * h + 2 * _dim(dims, "attention_head_dim") + _ADALN_VECTORS * _MODALITIES * h
    matrices = counts.block - vectors
    return matrices * base_bytes_per_weight(quant) + (block_params - matrices) * b


def backward_grads_bytes(grads: int, freed: int) -> int:
    """Gradient bytes beside the activations at the backward's peak when no gradient is resident as it
    starts (`train.grad_accum = 1`: the step zeroes them, `set_to_none`, before its one micro-batch).

    The backward walks the blocks from the last: each gives up what it kept for the backward (`freed`
    in all) and gains its gradient shard (`grads` in all), so memory moves in a straight line from the
    start (the activations' peak, no gradient) to the end. The peak is the larger end: no gradient
    when the blocks keep more than their gradients weigh, else the difference. After the backward the
    activations are gone, and the gradients alone are less. The units outside the block stack reduce
    last and weigh little next to a block: left out.
    """
    return max(0, grads - freed)


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


# Rows of the two keyframes of an FL2VA clip at the released canvas (48 x 84 latents, 24 x 42 rows each).
RELEASED_KEYFRAME_ROWS = 2 * 1_008


def rows_to_seconds(rows: int, keyframes: bool = True) -> float:
    """Clip seconds at the released 768x1344 canvas of a sample that packs to `rows` rows.

    Linear between the released 5 s (`RELEASED_5S_ROWS`) and 15 s (`RELEASED_MAX_ROWS`) FL2VA clips:
    each second adds about 7,135 rows (about 7 latent frames of 1,008 rows and 80 audio rows); the
    fixed part is the text prefix and, with `keyframes` (FL2VA's first and last), the two keyframes
    (`RELEASED_KEYFRAME_ROWS`). Negative below the fixed part: no clip fits.
    """
    per_second = (RELEASED_MAX_ROWS - RELEASED_5S_ROWS) / 10.0
    fixed = RELEASED_5S_ROWS - (0 if keyframes else RELEASED_KEYFRAME_ROWS)
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
        "checkpointed_layers": plan.checkpointed_layers,
        "ema": plan.ema_bytes > 0,
        "text_rows": plan.text_rows,
        "optimizer": plan.optimizer,
        "base_quant": plan.base_quant,
        "grad_accum": 1 if plan.peak_grads_bytes is not None else None,
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
