"""AdamW with decoupled weight decay off norms and biases, and warmup + constant/cosine/linear LR."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm scales and biases are not decayed: shrinking them changes the function, not its capacity."""
    # 1-D covers every norm scale; a name test would also catch 2-D projections such as norm_out.linear.
    return param.ndim < 2 or name.endswith(".bias")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the kernel `optim.implementation` names.

    `fused` is the default: one kernel per device and dtype, no host sync on a GPU, and over
    FSDP2's DTensors it dispatches once instead of once per parameter and operation.
    """
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if no_decay(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernel[cfg.implementation])


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of `optim.lr` for the update that ends optimizer step `step + 1` (0-based `step`)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
