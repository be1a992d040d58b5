"""The benchmarked model and sample: the reduced dimensions, a clip's geometry, its synthetic FL2VA samples and rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel

from ...config import Config, check_values
from ...model.architecture import model_kwargs
from ...objective import TrainingInputs
from ...ops.attention import ATTENTION_BACKENDS
from ...tasks.synthetic import Clip, clip_data

REDUCED_DIMS: dict[str, Any] = {
    "num_attention_heads": 4,
    "attention_head_dim": 16,  # >= 2 * 3 * rope_freq_dim rotated channels
    "rope_freq_dim": 2,
    "hidden_size": 64,
    "num_refiner_layers": 1,
    "ffn_dim": 128,
    "text_dim": 32,
    "freq_dim": 16,
    "time_embed_hidden_dim": 64,
    "time_embed_dim": 32,
}


FULL_CLIP = Clip(frames=124, height=768, width=1344, text_len=2048, vision_tokens=1024)
REDUCED_CLIP = Clip(frames=22, height=128, width=192, text_len=32, vision_tokens=16)


@dataclass(frozen=True)
class Rows:
    """Row counts of one packed sequence: `seq_len = text + video + audio`; video includes keyframes."""

    seq_len: int
    text: int
    video: int
    keyframe: int
    audio: int
    timesteps: int


def rows_of(ti: TrainingInputs) -> Rows:
    inputs = ti.model_inputs
    return Rows(
        seq_len=int(inputs["position_ids"].shape[0]),
        text=int(inputs["text_indices"].numel()),
        video=int(inputs["video_indices"].numel()),
        keyframe=int((ti.loss_mask_video == 0).sum()),
        audio=int(inputs["audio_indices"].numel()),
        timesteps=int(inputs["timestep"].numel()),
    )


def build_bench_model(dims: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int):
    """A seeded random model built on `device`, cast to `dtype` except the `_keep_in_fp32_modules`.

    Not the bench's step (that is the trainer's): the FLOP-count test and `bench_memory`'s
    activation measurements need the bare model without a trainer around it.
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**dims)
    keep = model._keep_in_fp32_modules or []
    for name, child in model.named_children():
        # Substring match, as diffusers applies the list (`proj_in` also covers `audio_proj_in`).
        child.to(torch.float32 if any(k in name for k in keep) else dtype)
    return model


def set_backend(model: MiniMaxH3Transformer3DModel, backend: str) -> None:
    """`model.set_attention_backend` without diffusers' per-call "experimental feature" warning."""
    from ...infra.quiet import known_notices

    with known_notices():
        model.set_attention_backend(backend)


def _parameter_count(dims: dict[str, Any]) -> int:
    """Parameters of `MiniMaxH3Transformer3DModel(**dims)`, counted on the meta device (no memory)."""
    from ...model.build import meta_transformer

    return sum(p.numel() for p in meta_transformer(dims).parameters())


# The model the checks train on CUDA: every kernel at a real head size, built in seconds.
CHECK_DIMS: dict[str, Any] = {
    "num_attention_heads": 8,
    "attention_head_dim": 128,
    "hidden_size": 1024,
    "num_refiner_layers": 1,
    "ffn_dim": 2816,
    "text_dim": 1024,
    "time_embed_hidden_dim": 1024,
    "time_embed_dim": 512,
    "num_layers": 2,
}
# 512x896 x 39 frames: 12 latent frames of 16 x 28 rows, 2 keyframes, stereo audio, 256 text rows: 6,658 rows.
CHECK_CLIP = Clip(frames=39, height=512, width=896, text_len=256, vision_tokens=128)


# `--gradient-checkpointing` as `model.activation_checkpointing`.
CHECKPOINTING = {"auto": "auto", "on": "full", "selective": "selective", "off": "none"}


def trainer_config(
    dims: dict[str, Any],
    clip: Clip,
    dtype: str,
    checkpointing: str,
    backend: str,
    seed: int,
    log_dir: Path,
    compile_blocks: bool = False,
) -> Config:
    """The `Config` of one bench case: `dims` trained on `clip`'s synthetic samples, one rank, sp = 1,
    `checkpointing` its `model.activation_checkpointing`, `compile_blocks` its `model.compile` (off unless
    asked: the kernels compare eager, and a compile costs each backend's build a minute).

    A kernel that is not a `model.attention_backend` choice (`math`) is built as `native` and set by
    `run_case` once the trainer is built.
    """
    defaults = model_kwargs({})
    changed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dims.items() if defaults.get(k) != v}
    cfg = Config()
    cfg.model = dataclasses.replace(
        cfg.model,
        config={**changed, "num_layers": int(dims["num_layers"])},
        dtype=dtype,
        activation_checkpointing=checkpointing,
        compile=compile_blocks,
        attention_backend=backend if ATTENTION_BACKENDS[backend].trains else "native",
    )
    cfg.task.name = "fl2va"
    cfg.data = dataclasses.replace(cfg.data, source="synthetic", synthetic=clip_data(clip, num_samples=2))
    cfg.parallel.sp = 1
    cfg.train = dataclasses.replace(cfg.train, steps=1000, grad_accum=1, seed=seed)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=0, resume="none")
    cfg.logging = dataclasses.replace(cfg.logging, dir=str(log_dir), progress=False)
    check_values(cfg)
    return cfg
