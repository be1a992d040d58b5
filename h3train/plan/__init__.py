"""Parameter and per-rank memory arithmetic for a full fine-tune, as `h3train check` prints it.

Pure functions over the transformer's constructor kwargs (`h3train.model.architecture.model_dims(cfg)`) and
the mesh sizes: nothing here builds a model or touches a process group, so the plan can be
printed on a laptop for a 64-GPU job.

Memory model of one rank (FSDP2 over `dp_shard x sp`, replicated over `dp_replicate`):

- Sharded, resident for the whole run (16 bytes per parameter, divided by `dp_shard * sp`):
  float32 master weights (4), float32 gradients (4), AdamW `exp_avg` + `exp_avg_sq` (4 + 4).
  `dp_replicate` does not divide them: HSDP replicas each hold a full sharded copy.
- Unsharded, transient: the all-gathered parameters of the largest FSDP unit (one transformer
  block) in the compute dtype, twice (the unit running and the one prefetched), plus that
  unit's unsharded float32 gradient before the reduce-scatter.
- Activations for the rank's `ceil(rows / sp)` rows (see `block_activation_row_bytes`), and the
  text refiner's over every text row, on every SP rank (`refiner_activation_bytes`).
- A fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation.

Between steps (`EvaluationPlan`), the held-out loss and the rendering of `validation.samples` hold the
sharded state without gradients, the two unsharded blocks, one no-grad forward over their longest rows
and, to decode, both VAEs; the plan's peak (`MemoryPlan.peak_bytes`) is the larger of that and a
training step, and `fits` is over it. On the host: the copy `checkpoint.async_save` stages a rank's
shards in (`staging_bytes`), any offloaded state and the VAEs, per rank and per node.

A LoRA run (`lora.rank > 0`, `AdapterCounts`) changes the sharded state: the frozen base is 2 bytes per
parameter in bfloat16 (4 in the float32 islands), with no gradient and no optimizer state; only the
adapters and `lora.train_modules` take the 16 bytes. The all-gathered blocks carry their adapters,
the unsharded gradient is that of a block's trainable parameters, the frozen base keeps less for the
backward (nothing only a weight's gradient reads: `frozen_base`), and each adapted Linear keeps its
rank-r `lora_A` output per row for the backward. `longest_fit_rows` solves the plan for the longest
packed sequence that fits, which the printout turns into clip seconds (`rows_to_seconds`).

Beside the memory, the time of a step (`step_time.py`): the step's FLOPs at a sustained rate per device
kind and the bytes `traffic.py` counts at each link's bandwidth, less what FSDP2's prefetch hides.
"""

from __future__ import annotations

from .activations import (
    BLOCK_POLICIES,
    StepPeak,
    activation_bytes,
    block_activation_row_bytes,
    block_policies,
    block_saved_row_bytes,
    cuda_fused_rms_norm,
    fused_norm_for,
    outside_stack_row_bytes,
    recompute_share,
    refiner_activation_bytes,
    refiner_block_row_bytes,
    step_peak,
)
from .arithmetic import (
    DEFAULT_DEVICE_MEMORY_GIB,
    DEFAULT_RESERVE_GIB,
    GIB,
    LORA_REFERENCE_SETUPS,
    SHORTEST_CLIP_S,
    EvaluationPlan,
    MemoryPlan,
    MeshSizes,
    ParameterCounts,
    choose_policies,
    longest_fit_rows,
    lora_fit_lines,
    parameter_counts,
    plan_memory,
    rows_to_seconds,
    trainable_state_bytes,
)
from .inputs import (
    adapter_counts,
    base_predictions_line,
    checkpoint_bytes,
    config_rows,
    config_sample_rows,
    dropped_line,
    estimate,
    refuse_over_plan,
    render_components_line,
    samples_lines,
)
from .printout import format_plan, summary, verdict
from .step_time import (
    DEFAULT_DEVICE,
    DEVICE_KINDS,
    Rates,
    StepEstimate,
    device_rates,
    format_layouts,
    format_step,
    layout_estimates,
    planned_step,
)

__all__ = [
    "GIB",
    "DEFAULT_DEVICE_MEMORY_GIB",
    "DEFAULT_RESERVE_GIB",
    "ParameterCounts",
    "MemoryPlan",
    "parameter_counts",
    "block_activation_row_bytes",
    "refiner_block_row_bytes",
    "outside_stack_row_bytes",
    "refiner_activation_bytes",
    "activation_bytes",
    "plan_memory",
    "BLOCK_POLICIES",
    "StepPeak",
    "block_policies",
    "block_saved_row_bytes",
    "choose_policies",
    "cuda_fused_rms_norm",
    "fused_norm_for",
    "recompute_share",
    "step_peak",
    "trainable_state_bytes",
    "longest_fit_rows",
    "rows_to_seconds",
    "SHORTEST_CLIP_S",
    "LORA_REFERENCE_SETUPS",
    "lora_fit_lines",
    "MeshSizes",
    "config_rows",
    "config_sample_rows",
    "estimate",
    "base_predictions_line",
    "adapter_counts",
    "checkpoint_bytes",
    "render_components_line",
    "format_plan",
    "summary",
    "verdict",
    "EvaluationPlan",
    "samples_lines",
    "dropped_line",
    "refuse_over_plan",
    "DEFAULT_DEVICE",
    "DEVICE_KINDS",
    "Rates",
    "StepEstimate",
    "device_rates",
    "planned_step",
    "format_step",
    "layout_estimates",
    "format_layouts",
]
