"""Which model transforms a config asks for.

The one choice of the composition root (`run/assemble.py`) that the memory plan (`h3train/plan/`) needs as
well, to count what an adapter adds and what a checkpoint holds; it lives below both of them.
"""

from __future__ import annotations

from ..config import Config
from ..model.adapter import ModelTransform


def model_transforms(cfg: Config) -> list[ModelTransform]:
    """The transforms a config asks for, in the order they apply. Full fine-tuning has none."""
    transforms: list[ModelTransform] = []
    if cfg.lora.rank > 0:
        from .adapters import LoraTransform

        transforms.append(LoraTransform(cfg))
    return transforms
