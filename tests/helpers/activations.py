"""The activations a forward keeps against the memory plan's activation line, for one configuration.

`activations` builds a tiny-config model at a width (`WIDTHS`) with an adapter variant (`VARIANTS`), runs
the forward and loss of one large synthetic sample (`SAMPLE`) and returns (planned, measured) bytes on
this rank; `TOLERANCE` is how far the plan may be from the measure.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from h3train.config import load_config
from h3train.data.source import build_source
from h3train.infra.quiet import known_notices
from h3train.lora.transforms import model_transforms
from h3train.model.architecture import model_dims
from h3train.model.build import build_model, fp32_island_names
from h3train.model.quant import INTEGER_CODES_SHARD
from h3train.model.sp_forward import SequenceParallelH3
from h3train.objective import micro_batch_inputs
from h3train.ops.attention import resolve_attention_backend
from h3train.parallel.dims import ParallelDims
from h3train.parallel.ulysses import SequenceParallel
from h3train.plan import estimate
from h3train.plan.activations import _frozen_parts, output_stage_row_bytes
from h3train.tools.bench_memory import saved_activation_bytes

from helpers.paths import ROOT, TINY_FL2VA

TOLERANCE = 0.10

KINDS = {"full": TINY_FL2VA, "lora": ROOT / "configs" / "tiny_lora.yaml"}

# The other adapters and the quantized base, on tiny_lora: (config key overrides) per kind.
# The quantized base is int8 where this torch's FSDP2 shards integer codes, else float8 (1 byte as well).
QUANT = "int8" if INTEGER_CODES_SHARD else "float8"

VARIANTS = {
    "dora": ["lora.use_dora=true"],
    "lokr": ["lora.kind=lokr"],
    f"lora_{QUANT}": [f"lora.base_quant={QUANT}"],
}

# Adapters on one output projection only: nothing before it keeps activations.
HEADS_ONLY = {"video_only": ["lora.target_modules=[video_only]"], "audio_only": ["lora.target_modules=[audio_only]"]}

VARIANTS.update(HEADS_ONLY)

# Two widths of the tiny configs' architecture (4 heads, 2 blocks, 1 refiner block).
WIDTHS = {
    "h128": {"hidden_size": 128, "attention_head_dim": 32, "ffn_dim": 384},
    "h256": {"hidden_size": 256, "attention_head_dim": 64, "ffn_dim": 768},
}

# 160 text rows, 2 keyframes and 6 latent frames of 6 x 8 rows, 2 x 40 audio rows: 624 packed rows.
SAMPLE = {
    "text_len": 160,
    "vision_tokens": 40,
    "num_latent_frames": 6,
    "latent_height": 12,
    "latent_width": 16,
    "num_audio_latents": 40,
}


def config(kind: str, width: str, *overrides: str):
    model = [f"model.config.{k}={v}" for k, v in WIDTHS[width].items()]
    return load_config(KINDS.get(kind, KINDS["lora"]), [*model, *VARIANTS.get(kind, []), *overrides])


def recompute_bytes(forward: SequenceParallelH3, inputs: dict) -> int:
    """What one block keeps when the checkpointed backward recomputes it: the last block on the inputs
    it sees in this forward, its input needing a gradient as every block's but the first does."""
    block = forward.transformer.transformer_blocks[-1]
    seen = {}
    handle = block.register_forward_pre_hook(lambda module, args: seen.setdefault("args", args))
    with torch.no_grad():
        forward(**inputs)
    handle.remove()
    hidden, temb, adaln_indices, rotary = seen["args"]
    hidden = hidden.detach().requires_grad_()
    args = {"hidden_states": hidden, "temb": temb, "adaln_indices": adaln_indices, "rotary_emb": rotary}
    # The recomputed output is dropped: the backward reads only what the block saved.
    return saved_activation_bytes(block, args) - hidden.numel() * hidden.element_size()


def as_computed(transformer: torch.nn.Module, dtype: str) -> None:
    """The parameters in the dtypes FSDP2's mixed precision computes with (`model/fsdp.py`): `model.dtype`,
    the float32 islands float32, whatever they are stored in (a LoRA run's base is bfloat16)."""
    islands = tuple(f"{name}." for name in fp32_island_names(transformer))
    for name, param in transformer.named_parameters():
        # FSDP2 casts every floating-point parameter, float8 codes too; int8 codes it gathers as stored.
        if param.dtype.is_floating_point:
            param.data = param.data.to(torch.float32 if name.startswith(islands) else getattr(torch, dtype))


@functools.cache
def case_config(kind: str, width: str, dtype: str, ckpt: str):
    """A case's config; its sp is the mesh's (`estimate`'s argument), so the sp = 1 and 2 cases share it."""
    sample = [f"data.synthetic.{k}={v}" for k, v in SAMPLE.items()]
    return config(kind, width, *sample, f"model.dtype={dtype}", f"model.activation_checkpointing={ckpt}")


def activations(kind: str, width: str, dtype: str, ckpt: str, sp: int) -> tuple[int, int]:
    """(planned, measured) activation bytes of one case on this rank."""
    cfg = case_config(kind, width, dtype, ckpt)
    transformer = build_model(cfg, cfg.train.seed)
    for transform in model_transforms(cfg):
        transform(transformer, cfg)
    as_computed(transformer, dtype)
    with known_notices():
        transformer.set_attention_backend(resolve_attention_backend(cfg.model.attention_backend, "cpu", dtype))
    group = dist.group.WORLD if sp > 1 else None
    forward = SequenceParallelH3(transformer, SequenceParallel(group), activation_checkpointing=ckpt)
    ti = micro_batch_inputs(cfg, build_source(cfg, transformer.config.text_dim)[0], step=1, slot=0)
    measured = saved_activation_bytes(forward, ti)
    # The CPU's kernels (the composite RMSNorm), which the measured forward runs.
    dims = model_dims(cfg)
    plan = estimate(dims, ParallelDims(1, 1, sp, sp), cfg, device="cpu")
    # No block is recomputed when nothing before the output projections trains: none kept anything.
    planned = plan.activation_bytes - plan.transient_bytes
    if ckpt == "full" and not (plan.lora is not None and plan.lora.heads_only):
        measured += recompute_bytes(forward, ti.model_inputs)
        # Measured: everything the forward keeps plus one recomputed block. The plan frees the output stage
        # before the stack's backward recomputes (its backward runs first): add it back to compare alike.
        frozen_outside = _frozen_parts(dims, plan.lora)[1]
        planned += plan.local_rows * output_stage_row_bytes(dims, cfg.model.dtype, frozen_outside)
    # What the forward keeps; the backward's own transients (`StepPeak.transient`) are not saved tensors.
    return planned, measured
