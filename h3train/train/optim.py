"""AdamW with decoupled weight decay off norms and biases, and warmup + constant/cosine/linear LR.

`optim.name` chooses what the optimizer stores between steps (`lowbit.py` for the kinds below
float32); the param groups, the LR schedule, clipping and the checkpoint's layout are the same for all.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig
from .lowbit import BF16AdamW, quantized_adamw


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm scales and biases are not decayed: shrinking them changes the function, not its capacity."""
    # 1-D covers every norm scale; a name test would also catch 2-D projections such as norm_out.linear.
    return param.ndim < 2 or name.endswith(".bias")


def weights_dtype(cfg: OptimConfig) -> torch.dtype:
    """dtype the trainable parameters are stored in (outside the float32 islands): bfloat16 for
    `adamw_bf16`, whose update is rounded onto bfloat16 weights, float32 master weights otherwise."""
    return torch.bfloat16 if cfg.name == "adamw_bf16" else torch.float32


def build_optimizer(model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    """The `optim.name` AdamW over the trainable parameters; `adamw` with the kernel `optim.implementation` names.

    `fused` is the default: one kernel per device and dtype, no host sync on a GPU, and over
    FSDP2's DTensors it dispatches once instead of once per parameter and operation. `seed` keys
    `adamw_bf16`'s stochastic rounding (`train.seed`).
    """
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if no_decay(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    hyper = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if cfg.name == "adamw_bf16":
        return BF16AdamW(groups, seed=seed, **hyper)
    if cfg.name != "adamw":
        return quantized_adamw(cfg.name, groups, **hyper)
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(groups, **hyper, **kernel[cfg.implementation])


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
