"""The sequence-parallel forward of `MiniMaxH3Transformer3DModel`, over the model's own modules.

`SequenceParallelH3` mirrors `MiniMaxH3Transformer3DModel.forward` operation for operation, so at
sp = 1 it returns exactly what the diffusers forward returns. At sp > 1:

1. the input projections, the time embedding and the text refiner run on the full sequence on every
   SP rank (they are cheap and the text refiner attends over text only);
2. the packed sequence is padded to a multiple of sp and each rank keeps its slice of rows through
   the block stack; `UlyssesAttnProcessor` exchanges heads for rows around attention and drops the
   padding rows before attention, so padding never reaches a real row;
3. the output heads run on the local rows and their outputs are gathered back with the gradient
   scale of the contract in `parallel/ulysses.py`, then the padding is dropped.

This module is the FSDP2 root (it owns the transformer), so the root's unshard / reduce-scatter
hooks wrap this forward.

Activation checkpointing (`activation_checkpointing`): a policy per transformer block (`BLOCK_POLICIES`),
one string for every block or a sequence of one per block. Per row that a block holds, with hidden size
h, attention width a = heads * head_dim and b bytes per element of the compute dtype, a block keeps
from its forward to its backward:

- `none`: every activation its backward reads (the normed and modulated inputs, q, k, v, the attention
  output, the FFN's hidden values, ...), several times `(h + a) * b`; nothing is recomputed.
- `selective`: its input (`h * b`), the attention output (`a * b`) and the kernel's logsumexp (`heads`
  values, float32 on the GPU kernels, the compute dtype on the CPU's). torch's selective activation
  checkpoint (`selective_forward`) saves the whole output of the attention op (`ATTENTION_OPS`: the SDPA
  kernels, flash-attn's where registered) and recomputes every other op in backward: the AdaLN
  modulation, the norms, the q/k/v and output projections, the rotary angles, the Ulysses all-to-alls
  and the FFN. The backward does not run attention forward again, most of a block's FLOPs at long
  sequences.
- `full`: its input (`h * b`); the whole block, attention included, is recomputed in backward.

The text refiner (a few blocks over the text rows alone) is recomputed whole when any transformer block
is `full`, else not at all. A recomputed block sees the same arguments as its forward, including the real
sequence length and a pack's samples (they travel in `UlyssesRotary`); at sp > 1 its Ulysses all-to-alls
run again in backward, on every rank alike. A `full` block is checkpointed around its module call (FSDP2's
hooks included, as torch's composable checkpoint expects); a `selective` block's `forward` checkpoints
itself, inside the module hooks and, with `compile_blocks`, inside the compiled graph, where dynamo traces
the selective checkpoint and the partitioner saves what the policy saves.

Regional compilation (`compile_blocks`): each transformer block's `forward` is compiled on its own
(the block's module hooks, FSDP2's unshard and reshard, stay eager around it). The Ulysses
processor reads everything it needs from its arguments, so the block traces as one graph. A packed
sequence compiles where it attends in one varlen call (CUDA, bfloat16, torch >= 2.10:
`ops.attention.packed_attention_path`): the call reads only the offsets tensor, its count of samples
dynamic, so a new pack composition runs the same graph; per-sample attention would guard on each
sample's length, and `model.compile` is refused with packs elsewhere (`config.values.resolve_compile`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import cache, partial
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn as nn
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import (
    MINIMAX_H3_MODALITY_NUM,
    MiniMaxH3Attention,
    _apply_rotary_emb,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..ops.attention import Segments, segment_attention, segments_on
from ..parallel.ulysses import SequenceParallel
from .adaln_tables import TableGroup, block_tables, table_rows

FORWARD_ARGS = (
    "hidden_states",
    "audio_hidden_states",
    "encoder_hidden_states",
    "timestep",
    "timestep_indices",
    "token_tags",
    "position_ids",
    "video_indices",
    "audio_indices",
    "text_indices",
)


#: What a transformer block keeps for backward (module docstring): everything, its input and attention's
#: outputs, or its input.
BLOCK_POLICIES = ("none", "selective", "full")

#: The attention kernels whose whole output (attention output, logsumexp, the kernel's bookkeeping) a
#: `selective` block saves, by operator name: the SDPA kernels of every device (float64 and float32 SDPA
#: on the CPU run `_scaled_dot_product_flash_attention_for_cpu`), the kernels under them that a varlen call
#: reaches, torch's varlen op (a packed sequence's one call), flash-attn 2's ops and diffusers' flash-attn
#: 3 op. flash-attn's interface, where it is loaded, names its own (`_flash_attn_ops`); a flash-attn that
#: calls its extension without a registered op runs no op the policy sees, and a `selective` block
#: recomputes its attention. SDPA's math kernel (the
#: `_native_math` backend, benchmark only) is a composite of matmuls and a softmax: recomputed as well.
ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "torch_attn::_varlen_attn",
        "flash_attn::_flash_attn_forward",
        "flash_attn::_flash_attn_varlen_forward",
        "_diffusers_flash_attn_3::_flash_attn_forward",
    }
)

FLASH_ATTN_INTERFACE = "flash_attn.flash_attn_interface"


@cache
def _flash_attn_ops(interface: ModuleType | None) -> frozenset[str]:
    """The names of the ops flash-attn 2's `interface` module calls forward, dense and varlen (none when it
    is not loaded: diffusers loads it where flash-attn is installed)."""
    names = set()
    for attr in ("_wrapped_flash_attn_forward", "_wrapped_flash_attn_varlen_forward"):
        entry = getattr(interface, attr, None)
        op = getattr(entry, "default", entry)
        name = getattr(getattr(op, "_schema", None), "name", None)
        if name is not None:
            names.add(name)
    return frozenset(names)


def attention_saving_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The `selective` policy: an attention kernel's outputs are saved, every other op is recomputed."""
    name = getattr(getattr(op, "_schema", None), "name", None)
    if name in ATTENTION_OPS or name in _flash_attn_ops(sys.modules.get(FLASH_ATTN_INTERFACE)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The `context_fn` of a `selective` block's checkpoint: one fresh pair of contexts per call."""
    return create_selective_checkpoint_contexts(attention_saving_policy)


def selective_forward(forward, *args, **kwargs):
    """`forward(*args, **kwargs)` under the `selective` policy while gradients are on: what a `selective`
    block's `forward` becomes (`SequenceParallelH3`), inside its module hooks and inside its compiled graph."""
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
    return forward(*args, **kwargs)


class UlyssesRotary(NamedTuple):
    """The rotary angles of this rank's rows and the real (unpadded) length of the whole sequence.

    The block hands `rotary_emb` to its attention processor untouched, so the sequence length rides
    along as an argument rather than processor state: a compiled block traces it, and a checkpointed
    block's recompute gets the length of its own forward.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    seq_len: int
    #: A packed sequence's samples (lengths summing to `seq_len`), each attending over its own rows; None: one sample.
    segments: Segments | None = None


def _heads(attn: MiniMaxH3Attention, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v `[B, S, H, D]` of `hidden_states` `[B, S, hidden]`, q and k normalised, as diffusers' processor
    computes them (before any rotary angles)."""
    if attn.fused_projections:
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
    key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
    return query, key, value.unflatten(-1, (attn.heads, -1))


class UlyssesAttnProcessor:
    """Self-attention of one block on this rank's rows, attending over the whole sequence.

    q, k, v `[B, S_pad/sp, H, D]` -> all-to-all -> `[B, S_pad, H/sp, D]` -> drop padding rows ->
    attention over the `seq_len` real rows -> pad -> all-to-all back -> `[B, S_pad/sp, H, D]`.
    `rotary_emb` is a `UlyssesRotary` (angles of the local rows and the real sequence length); at
    sp = 1 a plain `(cos, sin)` pair also does, the sequence then having no padding. A packed
    sequence (`UlyssesRotary.segments`) attends block-diagonally, each sample over its own rows
    (`ops.attention.segment_attention`).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sp: SequenceParallel) -> None:
        self.sp = sp

    def __call__(
        self,
        attn: MiniMaxH3Attention,
        hidden_states: torch.Tensor,
        rotary_emb: UlyssesRotary | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("MiniMax H3 attends over one unmasked packed sequence; no mask is expected")
        segments = None
        if isinstance(rotary_emb, UlyssesRotary):
            seq_len, segments = rotary_emb.seq_len, rotary_emb.segments
        elif not self.sp.enabled and rotary_emb is not None:
            # A plain `(cos, sin)` at sp = 1: the sequence is not padded.
            seq_len = hidden_states.shape[1]
        else:
            raise ValueError("at sp > 1 the Ulysses processor needs a UlyssesRotary (angles and real sequence length)")
        query, key, value = _heads(attn, hidden_states)
        cos, sin = rotary_emb[0], rotary_emb[1]
        query = _apply_rotary_emb(query, cos, sin)
        key = _apply_rotary_emb(key, cos, sin)

        padded = query.shape[1] * self.sp.size
        query, key, value = (t[:, :seq_len] for t in self.sp.heads_to_sequence(query, key, value))
        if segments is None:
            out = dispatch_attention_fn(
                query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend
            )
        else:
            out = segment_attention(query, key, value, segments, self._attention_backend)
        if padded > seq_len:
            out = torch.cat([out, out.new_zeros(out.shape[0], padded - seq_len, *out.shape[2:])], dim=1)
        out = self.sp.sequence_to_heads(out)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class SegmentedTextAttnProcessor:
    """The text refiner's self-attention over a pack's prompts, each attending over its own rows.

    The refiner block passes its attention nothing but the rows, so the prompts' lengths are set on
    the processor (`segments`) by `SequenceParallelH3` right before each block runs, inside what an
    activation-checkpointed block recomputes. One call per block whatever the pack holds: FSDP2's
    collectives of a refiner block are the same on every rank. `segments` None: one prompt, diffusers'
    own arithmetic.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self) -> None:
        self.segments: Segments | None = None

    def __call__(
        self,
        attn: MiniMaxH3Attention,
        hidden_states: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or rotary_emb is not None:
            raise ValueError("the text refiner attends without a mask or rotary angles")
        query, key, value = _heads(attn, hidden_states)
        if self.segments is None:
            out = dispatch_attention_fn(
                query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend
            )
        else:
            out = segment_attention(query, key, value, self.segments, self._attention_backend)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _refine(block: nn.Module, text: torch.Tensor, segments: Segments | None) -> torch.Tensor:
    """Refiner block `block` over `text`, its prompts' lengths set where the block's processor reads them."""
    block.attn.processor.segments = segments
    return block(text)


def _block_policies(activation_checkpointing: str | Sequence[str], num_blocks: int) -> tuple[str, ...]:
    """One `BLOCK_POLICIES` entry per transformer block: a string for every block, or one per block."""
    if isinstance(activation_checkpointing, str):
        policies = (activation_checkpointing,) * num_blocks
    else:
        policies = tuple(activation_checkpointing)
        if len(policies) != num_blocks:
            raise ValueError(
                f"activation_checkpointing gives {len(policies)} block policies for {num_blocks} transformer blocks"
            )
    for policy in policies:
        if policy not in BLOCK_POLICIES:
            raise ValueError(f"activation_checkpointing {policy!r} is not one of {BLOCK_POLICIES}")
    return policies


class SequenceParallelH3(nn.Module):
    """Wraps the diffusers transformer; `forward` takes the ten `model.forward` arguments.

    Returns `(video, audio)`: `[B, N_v, 96]` velocity for every video row (conditioning rows first)
    and `[B, N_a, 32]` for every audio row, as `model.forward(..., return_dict=False)` does.

    `packed`: the model also takes packed sequences of several samples (`segments`, `text_segments`
    in `forward`), its blocks then attending through the Ulysses processor at sp = 1 too. Unpacked
    at sp = 1 the blocks keep diffusers' own processor.

    `activation_checkpointing`: one of `BLOCK_POLICIES` for every transformer block, or a sequence of one
    per block (`ValueError` for another length); the text refiner is recomputed when any block is `full`
    (`policy`).
    """

    def __init__(
        self,
        transformer: MiniMaxH3Transformer3DModel,
        sp: SequenceParallel,
        *,
        activation_checkpointing: str | Sequence[str] = "none",
        compile_blocks: bool = False,
        compile_backend: str | Callable = "inductor",
        packed: bool = False,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.sp = sp
        self.block_policies = _block_policies(activation_checkpointing, len(transformer.transformer_blocks))
        self.activation_checkpointing = activation_checkpointing
        heads = transformer.config.num_attention_heads
        if heads % sp.size:
            raise ValueError(f"sequence parallel size {sp.size} does not divide {heads} attention heads")
        self.processors: list[UlyssesAttnProcessor] = []
        # The ranks that compute the AdaLN tables together (`model/adaln_tables.py`), set by `apply_fsdp`
        # where it serves them.
        self.tables: TableGroup | None = None
        self.packed = packed
        if packed:
            for block in transformer.token_refiner.refiner_blocks:
                proc = SegmentedTextAttnProcessor()
                proc._attention_backend = block.attn.processor._attention_backend
                block.attn.set_processor(proc)
        if sp.enabled or packed:
            for block in transformer.transformer_blocks:
                proc = UlyssesAttnProcessor(sp)
                proc._attention_backend = block.attn.processor._attention_backend
                block.attn.set_processor(proc)
                self.processors.append(proc)
        # The bound `forward` is replaced on the instance: parameter names (state dicts, DCP, export)
        # stay those of the plain model, and the module hooks (FSDP2's unshard and reshard) run eagerly
        # around it. A `selective` block checkpoints inside them, and inside its compiled graph: dynamo
        # traces the selective checkpoint (the partitioner saves what the policy saves), where a compiled
        # graph run under the eager checkpoint's dispatch mode would fall back to eager on torch 2.8.
        for block, policy in zip(transformer.transformer_blocks, self.block_policies, strict=True):
            if isinstance(block.forward, partial) and block.forward.func is selective_forward:
                # An earlier wrapper's policy (the measuring tools wrap one model in turn): its forward within.
                block.forward = block.forward.args[0]
            if policy == "selective":
                block.forward = partial(selective_forward, block.forward)
            if compile_blocks:
                block.forward = torch.compile(block.forward, backend=compile_backend, fullgraph=True)

    def policy(self, index: int, refiner: bool = False) -> str:
        """The `BLOCK_POLICIES` entry of transformer block `index`, or of refiner block `index`: `full` when
        any transformer block is `full`, else `none`."""
        if refiner:
            return "full" if "full" in self.block_policies else "none"
        return self.block_policies[index]

    def _run(self, policy: str, fn, *args):
        # A `selective` block checkpoints itself (`selective_forward`); a `full` one is checkpointed
        # whole, its module hooks included.
        if policy == "full" and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        segments: tuple[int, ...] | None = None,
        text_segments: tuple[int, ...] | None = None,
        pack_samples: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ten `model.forward` arguments; a packed sequence (`pack_forward_rows`) adds each sample's
        packed length `segments` and text length `text_segments`, in sample order, and `pack_samples`, the
        most samples a micro-batch of this step holds on any rank (the step composer's: the AdaLN tables'
        exchange is sized by it, `adaln_tables.table_rows`)."""
        m, sp = self.transformer, self.sp
        seq_len = position_ids.shape[0]
        if segments is not None and not self.processors:
            raise ValueError("a packed sequence needs a model built with packed=True (data.pack)")
        if (segments is None) != (text_segments is None) or (segments is not None and sum(segments) != seq_len):
            raise ValueError(f"segments {segments} and text_segments {text_segments} do not split {seq_len} rows")
        device = position_ids.device
        samples = None if segments is None else segments_on(segments, device)
        prompts = None if text_segments is None else segments_on(text_segments, device)

        video_embeds = m.proj_in(hidden_states.to(get_parameter_dtype(m.proj_in)))
        audio_embeds = m.audio_proj_in(audio_hidden_states.to(get_parameter_dtype(m.audio_proj_in)))
        text_embeds = m.context_embedder(encoder_hidden_states.to(get_parameter_dtype(m.context_embedder)))
        for i, block in enumerate(m.token_refiner.refiner_blocks):
            if self.packed:
                # A pack's prompts are refined each alone, in one call of the block.
                text_embeds = self._run(self.policy(i, refiner=True), _refine, block, text_embeds, prompts)
            else:
                text_embeds = self._run(self.policy(i, refiner=True), block, text_embeds)
        text_embeds = m.token_refiner.final_norm(text_embeds)

        if sp.enabled:
            # Padding rows are zero, carry index 0 and position 0: valid lookups, dropped before
            # attention and after the heads, so they never touch a real row or the loss.
            parts = [(text_embeds, text_indices), (video_embeds, video_indices), (audio_embeds, audio_indices)]
            hidden = sp.local_rows(seq_len, parts)
        else:
            hidden = text_embeds.new_zeros((text_embeds.shape[0], seq_len, text_embeds.shape[-1]))
            hidden = hidden.index_copy(1, text_indices, text_embeds)
            hidden = hidden.index_copy(1, video_indices, video_embeds.to(text_embeds.dtype))
            hidden = hidden.index_copy(1, audio_indices, audio_embeds.to(text_embeds.dtype))

        temb = m.time_proj(timestep)
        temb = m.time_embedder(temb.to(get_parameter_dtype(m.time_embedder)))
        adaln_indices = timestep_indices * MINIMAX_H3_MODALITY_NUM + token_tags
        block_temb = [temb] * len(m.transformer_blocks)
        if self.tables is not None:
            # Every rank of the shard group exchanges tables of the same rows, a bound known on the host.
            if segments is not None and pack_samples is None:
                raise ValueError("a packed forward with the AdaLN tables served needs the step's pack_samples")
            most = 1 if segments is None else pack_samples
            block_temb = block_tables(m.transformer_blocks, temb, table_rows(most), self.tables)

        if sp.enabled:
            adaln_indices = sp.local_slice(sp.pad(adaln_indices, 0))
            timestep_indices = sp.local_slice(sp.pad(timestep_indices, 0))
            # The angles of this rank's rows only (they are row-wise; padding rows take position 0):
            # every block saves them for backward.
            rotary_emb = UlyssesRotary(*m.rope(sp.local_slice(sp.pad(position_ids, 0))), seq_len, samples)
        elif samples is not None:
            rotary_emb = UlyssesRotary(*m.rope(position_ids), seq_len, samples)
        else:
            rotary_emb = m.rope(position_ids)

        for i, block in enumerate(m.transformer_blocks):
            hidden = self._run(self.policy(i), block, hidden, block_temb[i], adaln_indices, rotary_emb)

        hidden = m.norm_out(hidden, temb, timestep_indices).to(get_parameter_dtype(m.proj_out))
        video_rows = m.proj_out(hidden)
        audio_rows = m.audio_proj_out(hidden)
        if sp.enabled:
            # Both heads' rows travel in one all-gather.
            both = sp.gather(torch.cat([video_rows, audio_rows.to(video_rows.dtype)], dim=-1))[:, :seq_len]
            video_rows, audio_rows = both.split([video_rows.shape[-1], audio_rows.shape[-1]], dim=-1)
        return video_rows.index_select(1, video_indices), audio_rows.index_select(1, audio_indices)
