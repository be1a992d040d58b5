"""The denoising half of a stand-in MiniMax-H3 folder, and the index that makes the folder a diffusers pipeline.

`write_tiny_components` (`data/components.py`, `h3train tiny-components DIR`) writes a whole pipeline
folder in the released MiniMax-H3 layout, every weight tiny and random (about 10 MB, seconds):

    modular_model_index.json     what `MiniMaxH3ModularPipeline.from_pretrained(DIR)` reads
    transformer/                 MiniMaxH3Transformer3DModel (t2va / fl2va), `TINY_TRANSFORMER`
    transformer_ref/             the same architecture, other weights (ref2va)
    scheduler/ audio_scheduler/  MiniMaxH3Scheduler, the released shifts (12 video, 3 audio)
    vae/ audio_vae/ text_encoder/ tokenizer/ processor/   the encoders (`data/components.py`)
    h3train_encode_preset.json   the `h3train encode` settings the tiny models are meant for

The index names no repository (`pretrained_model_name_or_path` null): diffusers loads each component
from its subfolder of DIR, wherever DIR is, and a missing one is skipped rather than downloaded. Its
canvas configs are the preset's, so the pipeline generates on the canvas the data was encoded at.
The transformers are stored as the released ones are, bfloat16 with the float32 islands
(`_keep_in_fp32_modules`): a LoRA run freezes exactly these values as its bfloat16 base, so the
float32 model diffusers loads by default plus the exported LoRA is the trained model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

from ..model.build import build_seeded, fp32_island_names
from ..tasks.table import PARTITIONS

# configs/tiny_demo.yaml's model.config without `text_dim`, which is the tiny text encoder's width.
TINY_TRANSFORMER: dict[str, Any] = {
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "rope_freq_dim": 2,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 64,
    "freq_dim": 16,
    "time_embed_hidden_dim": 32,
    "time_embed_dim": 16,
}
# The released schedulers (`scheduler/`, `audio_scheduler/`): video and audio step the same base
# index through their own sigma shifts.
VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0

ENCODE_PRESET_FILE = "h3train_encode_preset.json"
# `h3train encode` settings (`EncodeSettings` fields) that keep the tiny models' data CPU-sized: 3:2
# clips land on a 64x96 canvas (4x6 latents, 2x3 rows per latent frame), each clip is cut to the
# largest 17 n + 5 frames within 2 s, and no minimum duration rejects short ones.
TINY_ENCODE_PRESET: dict[str, int | float] = {
    "short_edge": 64,
    "max_pixels": 64 * 96,
    "reference_short_edge": 64,
    "min_seconds": 0.0,
    "max_seconds": 2.0,
}
# The pipeline's canvas configs (its blocks' `ConfigSpec`s) and the encode setting each one mirrors.
CANVAS_CONFIGS = {
    "canvas_short_edge": "short_edge",
    "canvas_max_pixels": "max_pixels",
    "reference_image_short_edge": "reference_short_edge",
}


def tiny_transformer_config(text_dim: int) -> dict[str, Any]:
    """The stand-in transformers' constructor kwargs: `TINY_TRANSFORMER` reading prompts `text_dim` wide."""
    return {**TINY_TRANSFORMER, "text_dim": text_dim}


def write_stand_in_pipeline(root: str | os.PathLike, text_dim: int, seed: int) -> Path:
    """Write the transformers, schedulers, pipeline index and encode preset into `root` (beside the encoders).

    Partition i is the random init `h3train train` builds from `tiny_transformer_config(text_dim)` with
    `train.seed = seed + i`, rounded to the released dtypes. Returns `root`.
    """
    root = Path(root)
    config = tiny_transformer_config(text_dim)
    for i, name in enumerate(PARTITIONS):
        model = build_seeded(config, seed + i)
        islands = fp32_island_names(model)
        for child, module in model.named_children():
            # Parameterless children (the rotary table) are computed at load, not stored.
            if child not in islands and any(True for _ in module.parameters()):
                module.to(torch.bfloat16)
        model.save_pretrained(root / name)
    MiniMaxH3Scheduler(shift=VIDEO_SHIFT).save_pretrained(root / "scheduler")
    MiniMaxH3Scheduler(shift=AUDIO_SHIFT).save_pretrained(root / "audio_scheduler")
    _write_index(root)
    (root / ENCODE_PRESET_FILE).write_text(json.dumps(TINY_ENCODE_PRESET, indent=2) + "\n")
    return root


def _write_index(root: Path) -> None:
    """`modular_model_index.json`: every component the blocks load from pretrained, from `root/<name>`."""
    pipe = MiniMaxH3ModularPipeline()
    entries = {}
    for name in pipe.pretrained_component_names:
        _, _, spec = pipe.config[name]
        library, class_name = spec["type_hint"]
        entries[name] = (library, class_name, {**spec, "pretrained_model_name_or_path": None, "subfolder": name})
    canvas = {config: TINY_ENCODE_PRESET[setting] for config, setting in CANVAS_CONFIGS.items()}
    pipe.register_to_config(**entries, **canvas)
    pipe.save_config(root)
