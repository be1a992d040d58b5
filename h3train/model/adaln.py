"""The AdaLN lookups of the diffusers model, with their gradients summed in float32.

Every transformer block projects the timestep embedding to a small table (one row per timestep and
modality, six modulation vectors each) and each packed row reads its row of it
(`index_select(0, adaln_indices)`); `norm_out` does the same per timestep. Autograd's backward of
`index_select` adds the gradients of every packed row into its table entry in the table's dtype: in
bfloat16 each of the thousands of rows that share an entry (about 4,600 per entry at the released
layout) is added with its own rounding, and the sum, the whole gradient of the AdaLN projections,
carries that noise (2e-2 relative L2 on block 0's `adaln_proj.linear.weight` at full width).

`gather_rows` reads the same rows (the forward is unchanged, bit for bit) and adds their gradients
into a float32 table, casting to the table's dtype once at the end. `accumulate_adaln_in_float32`
gives each block and `norm_out` of a `MiniMaxH3Transformer3DModel` a forward that is diffusers' own,
operation for operation, with that lookup: the model stays the diffusers class, its parameters,
state dict and module hooks untouched (the forward is set on the instance, as regional compilation
does). A float32 model's gradients are the same as diffusers' (one `index_add_`, as autograd's).
"""

from __future__ import annotations

import types

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormOut,
    MiniMaxH3TransformerBlock,
)
from torch import nn

# The backward widens the incoming gradient to float32 this many elements at a time (64 MiB): a
# full-width block's [41,774, 5,376] gradient is never copied whole.
CHUNK_ELEMENTS = 1 << 24


class _GatherRows(torch.autograd.Function):
    """`table.index_select(0, index)`, its backward summing into a float32 table."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.entries = table.shape[0]
        return table.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        shape = (ctx.entries, *grad.shape[1:])
        if grad.dtype in (torch.float32, torch.float64):
            # What autograd's own backward of `index_select` computes.
            return grad.new_zeros(shape).index_add_(0, index, grad), None
        table = grad.new_zeros(shape, dtype=torch.float32)
        rows = max(1, CHUNK_ELEMENTS // max(1, grad[0].numel()))
        for start in range(0, grad.shape[0], rows):
            table.index_add_(0, index[start : start + rows], grad[start : start + rows].float())
        return table.to(grad.dtype), None


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of `table` (`[E, ...]` -> `[len(index), ...]`), as `index_select(0, index)`; the
    gradient of `table` is accumulated in float32 and cast to its dtype once."""
    return _GatherRows.apply(table, index)


def block_forward(
    self: MiniMaxH3TransformerBlock,
    hidden_states: torch.Tensor,
    temb: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`MiniMaxH3TransformerBlock.forward` with the AdaLN rows read by `gather_rows`."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(temb)

    residual = hidden_states
    norm_hidden_states = self.norm1(hidden_states)
    norm_hidden_states = norm_hidden_states * (1.0 + gather_rows(scale_msa, adaln_indices)) + gather_rows(
        shift_msa, adaln_indices
    )
    attn_output = self.attn(norm_hidden_states, rotary_emb, attention_mask)
    hidden_states = residual + gather_rows(gate_msa, adaln_indices) * attn_output

    residual = hidden_states
    norm_hidden_states = self.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1.0 + gather_rows(scale_mlp, adaln_indices)) + gather_rows(
        shift_mlp, adaln_indices
    )
    ff_output = self.ff(norm_hidden_states)
    return residual + gather_rows(gate_mlp, adaln_indices) * ff_output


def norm_out_forward(
    self: MiniMaxH3AdaLayerNormOut, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor
) -> torch.Tensor:
    """`MiniMaxH3AdaLayerNormOut.forward` with the per-timestep rows read by `gather_rows`."""
    shift, scale = self.linear(nn.functional.silu(temb).to(get_parameter_dtype(self.linear))).chunk(2, dim=-1)
    hidden_states = self.norm(hidden_states)
    return hidden_states * (1.0 + gather_rows(scale, timestep_indices)) + gather_rows(shift, timestep_indices)


def accumulate_adaln_in_float32(transformer: MiniMaxH3Transformer3DModel) -> None:
    """Give every transformer block and `norm_out` of `transformer` the forward whose AdaLN lookup sums its
    gradient in float32 (module docstring). Before `torch.compile` wraps a block's forward; idempotent."""
    patched = [(block, block_forward) for block in transformer.transformer_blocks]
    patched.append((transformer.norm_out, norm_out_forward))
    for module, forward in patched:
        if getattr(module.forward, "__func__", None) is not forward:
            module.forward = types.MethodType(forward, module)
