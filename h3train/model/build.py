"""Build `diffusers.MiniMaxH3Transformer3DModel`: from a local pretrained folder or a config.

Master weights are float32 whatever `model.dtype` says; the compute dtype is applied by FSDP2's
mixed-precision policy (see `parallel/fsdp.py`), which keeps the `_keep_in_fp32_modules` islands
in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel

from ..config import Config, default_subfolder, model_config_dict


def build_model(cfg: Config, seed: int) -> MiniMaxH3Transformer3DModel:
    """A float32 model on the CPU, identical on every rank (same seed or same files)."""
    if cfg.model.pretrained:
        folder = Path(cfg.model.pretrained)
        model = MiniMaxH3Transformer3DModel.from_pretrained(
            folder, subfolder=cfg.model.subfolder or default_subfolder(cfg), torch_dtype=torch.float32,
            local_files_only=True,
        )
    else:
        # The default RNG is seeded here and restored, so model init never shifts other draws.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = MiniMaxH3Transformer3DModel(**model_config_dict(cfg))
    return model.float()


def fp32_island_names(model: MiniMaxH3Transformer3DModel) -> list[str]:
    """Top-level submodules diffusers keeps in float32 (`_keep_in_fp32_modules`) that own parameters."""
    keep = model._keep_in_fp32_modules or []
    return [
        name
        for name, module in model.named_children()
        if any(k in name for k in keep) and any(True for _ in module.parameters())
    ]
