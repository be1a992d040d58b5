"""The optimizer kinds (`OPTIMIZER_KINDS`, chosen by `optim.name`), their param groups, and the LR schedule.

Every kind is AdamW with decoupled weight decay off norms and biases; a kind says what it stores
between steps: how it is built, the dtype the trainable weights are kept in, its state's bytes
(exact per shard, and per value at scale for the plan), what it needs installed, and whether its
update runs on fake tensors (`h3train check --rehearse`). `register_optimizer_kind` adds one and makes
it a choice of `optim.name`. The param groups, the LR schedule, clipping and the checkpoint's layout
are the same for all (a kind's state is whatever its `state_dict` holds; DCP saves and reshards it).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import OptimConfig, register_entry
from ..errors import ConfigError, one_of
from .lowbit import (
    QUANT_BLOCK,
    BF16AdamW,
    quantized_adamw,
    quantized_bytes_per_value,
    quantized_state_bytes,
    torchao_missing,
    warm_code_books,
)


class OptimizerKind:
    """One `optim.name`. Subclass, set `name`, override what differs, register an instance."""

    name: ClassVar[str]
    #: dtype the trainable parameters are stored in, outside the float32 islands.
    weights_dtype: ClassVar[torch.dtype] = torch.float32
    #: Why its update cannot run on fake tensors (its state then comes from `init_state`); None: it can.
    fake_update: ClassVar[str | None] = None

    def missing(self) -> str | None:
        """The one-line reason it cannot run here (a package not installed), or None."""
        return None

    def build(self, groups: list[dict[str, Any]], hyper: dict[str, Any], cfg: OptimConfig, seed: int) -> Any:
        """The optimizer over `groups`, with `hyper` (lr, betas, eps); `seed` keys any randomness."""
        raise NotImplementedError

    def state_bytes(self, numel: int) -> int:
        """Bytes of its state for one parameter shard of `numel` values, step counter aside."""
        return int(self.state_bytes_per_value() * numel)

    def state_bytes_per_value(self) -> float:
        """Bytes of its state per trainable value at scale, as the memory plan counts it."""
        return 8.0

    def before_rehearsal(self) -> None:
        """What must run on the host before a fake-tensor mode builds it."""


class AdamWKind(OptimizerKind):
    """`torch.optim.AdamW`, float32 moments, with the kernel `optim.implementation` names."""

    name = "adamw"

    def build(self, groups: list[dict[str, Any]], hyper: dict[str, Any], cfg: OptimConfig, seed: int) -> Any:
        kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        return torch.optim.AdamW(groups, **hyper, **kernel[cfg.implementation])


class QuantizedAdamWKind(OptimizerKind):
    """torchao's block-quantized moments (`lowbit.quantized_adamw`)."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]
        bits = name.removeprefix("adamw").removesuffix("bit")
        self.fake_update = (
            f"torchao's AdamW{bits}bit update is a torch.compile'd function, which does not run on fake tensors"
        )

    def missing(self) -> str | None:
        return torchao_missing(self.name)

    def build(self, groups: list[dict[str, Any]], hyper: dict[str, Any], cfg: OptimConfig, seed: int) -> Any:
        return quantized_adamw(self.name, groups, **hyper)

    def state_bytes(self, numel: int) -> int:
        return quantized_state_bytes(self.name, numel)

    def state_bytes_per_value(self) -> float:
        return quantized_bytes_per_value(self.name)

    def before_rehearsal(self) -> None:
        warm_code_books()


class BF16AdamWKind(OptimizerKind):
    """bfloat16 weights and moments, stochastically rounded (`lowbit.BF16AdamW`); float32 islands stay float32.

    Its state bytes are those of a bfloat16 shard; a float32 one keeps float32 moments (`AdamWKind`'s).
    """

    name = "adamw_bf16"
    weights_dtype = torch.bfloat16
    fake_update = "BF16AdamW's update reads its step count and rounding salts on the host (.item())"

    def build(self, groups: list[dict[str, Any]], hyper: dict[str, Any], cfg: OptimConfig, seed: int) -> Any:
        return BF16AdamW(groups, seed=seed, **hyper)

    def state_bytes_per_value(self) -> float:
        return 4.0


#: `optim.name` -> its kind, in registration order.
OPTIMIZER_KINDS: dict[str, OptimizerKind] = {}


def register_optimizer_kind(kind: OptimizerKind) -> OptimizerKind:
    """Add `kind` to the table and make its name a choice of `optim.name`."""
    return register_entry(OPTIMIZER_KINDS, kind, "optimizer kind", "optim.name")


for _kind in (AdamWKind(), *(QuantizedAdamWKind(n) for n in QUANT_BLOCK), BF16AdamWKind()):
    register_optimizer_kind(_kind)


def optimizer_kind(name: str) -> OptimizerKind:
    """The registered kind `optim.name` names."""
    if name not in OPTIMIZER_KINDS:
        raise ConfigError(f"config key 'optim.name' is {name!r}; {one_of(name, OPTIMIZER_KINDS)}")
    return OPTIMIZER_KINDS[name]


def state_bytes(name: str, numel: int) -> int:
    """`optimizer_kind(name).state_bytes(numel)`: `adamw_bf16` means a bfloat16 shard."""
    return optimizer_kind(name).state_bytes(numel)


def state_bytes_per_value(name: str) -> float:
    """`optimizer_kind(name).state_bytes_per_value()`."""
    return optimizer_kind(name).state_bytes_per_value()


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm scales and biases are not decayed: shrinking them changes the function, not its capacity."""
    # 1-D covers every norm scale; a name test would also catch 2-D projections such as norm_out.linear.
    return param.ndim < 2 or name.endswith(".bias")


def weights_dtype(cfg: OptimConfig) -> torch.dtype:
    """dtype the trainable parameters are stored in (outside the float32 islands): the kind's."""
    return optimizer_kind(cfg.name).weights_dtype


def build_optimizer(model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    """The `optim.name` kind over the trainable parameters, weight decay off norms and biases.

    `adamw`'s default kernel is `fused`: one kernel per device and dtype, no host sync on a GPU, and
    over FSDP2's DTensors it dispatches once instead of once per parameter and operation. `seed`
    keys `adamw_bf16`'s stochastic rounding (`train.seed`).
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
    return optimizer_kind(cfg.name).build(groups, hyper, cfg, seed)


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
