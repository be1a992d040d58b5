"""Model FLOPs of one training step, term by term (the package docstring's count); the devices' bf16 peaks
are the plan's (`plan.step_time.PEAK_BF16_TFLOPS`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...plan.step_time import PEAK_BF16_TFLOPS, peak_tflops_for
from .case_setup import Rows

__all__ = ["PEAK_BF16_TFLOPS", "StepFlops", "peak_tflops_for", "step_flops"]


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one training step (forward + backward), term by term; see the module docstring."""

    blocks_linear: int
    blocks_attention: int
    refiner: int
    output_heads: int
    inputs: int
    timesteps: int

    @property
    def total(self) -> int:
        return (
            self.blocks_linear + self.blocks_attention + self.refiner + self.output_heads + self.inputs + self.timesteps
        )


def step_flops(dims: dict[str, Any], rows: Rows) -> StepFlops:
    """Analytic model FLOPs of `loss.backward()` after one forward over `rows` (module docstring formula)."""
    h, f = int(dims["hidden_size"]), int(dims["ffn_dim"])
    a = int(dims["num_attention_heads"]) * int(dims["attention_head_dim"])
    n, n_r = int(dims["num_layers"]), int(dims["num_refiner_layers"])
    e, d, q = int(dims["time_embed_dim"]), int(dims["time_embed_hidden_dim"]), int(dims["freq_dim"])
    p_v = int(dims["in_channels"]) * math.prod(int(p) for p in dims["patch_size"])
    p_a, text_dim = int(dims["audio_in_channels"]), int(dims["text_dim"])
    s, L, T = rows.seq_len, rows.text, rows.timesteps
    block_weights = 4 * h * a + 3 * h * f
    # Forward matmul FLOPs are 2 per weight per row; training triples them except where noted.
    fwd_inputs = 2 * h * (rows.video * p_v + rows.audio * p_a + L * text_dim)
    fwd_time_in = 2 * T * q * d
    fwd_time_rest = 2 * T * (d * e + n * 18 * e * h + 2 * e * h)
    return StepFlops(
        blocks_linear=3 * n * 2 * s * block_weights,
        blocks_attention=3 * n * 4 * s * s * a,
        refiner=3 * n_r * (2 * L * block_weights + 4 * L * L * a),
        output_heads=3 * 2 * s * h * (p_v + p_a),
        # Data-reading matmuls: forward plus weight gradient only.
        inputs=2 * fwd_inputs,
        timesteps=2 * fwd_time_in + 3 * fwd_time_rest,
    )
