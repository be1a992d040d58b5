"""What one rank keeps for the backward and computes in a step, per row of its sequence: activation bytes per
block and per stage (with each block's recompute policy), the step's peak within the backward, the forward
FLOPs and the share recomputed. Pure arithmetic over constructor kwargs (the package docstring's model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.torch_version import TorchVersion

from ..model.adapter import AdapterCounts

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_FP32 = 4


def _dim(dims: Mapping[str, Any], key: str) -> int:
    try:
        return int(dims[key])
    except KeyError:
        raise ValueError(f"model dims lack '{key}': pass h3train.model.architecture.model_dims(cfg)") from None


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
