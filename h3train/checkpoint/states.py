"""The checkpoint's `Stateful` components: the model, the optimizer, the LR schedule position, plain attributes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# -- the stateful components ----------------------------------------------------------------------


class ModelState:
    """The model's weights (sharded DTensors; DCP reshards them on load).

    `trainable_only` (LoRA runs): the parameters that train (adapters, `lora.train_modules`) and
    nothing of the frozen base, which a resume rebuilds from where a fresh start gets it (the
    pretrained folder or the seeded init; `h3train/lora/base.py`). Keys stay the live FQNs
    (`transformer.<module>.lora_A.default.weight`), so DCP reshards them like any other.
    """

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False) -> None:
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=True) if trainable_only else None
        self.trainable_only = trainable_only

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.trainable_only:
            set_model_state_dict(self.model, state)
            return
        wanted = set(self.state_dict())
        missing = sorted(wanted - set(state))
        if missing:
            raise KeyError(f"no value for trainable parameter {missing[0]} (and {len(missing) - 1} more)")
        # strict=False: the frozen base is deliberately absent; every trainable key was checked above.
        set_model_state_dict(self.model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


class OptimizerState:
    """The optimizer's moments and step counts, keyed by parameter FQN.

    Loading keeps the hyperparameters (lr, betas, eps, weight decay) as this run's config set them,
    so a changed `optim.*` on resume runs what `config.yaml` records. The LR itself is the schedule's.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(values)


class ScheduleState:
    """The LR schedule as a position (optimizer updates taken), rebuilt from this run's config on load.

    The schedule is a function of the config and the position, so a resume with a changed
    `optim.lr`, schedule, warmup or `train.steps` continues the new schedule at the same position;
    with an unchanged config the rebuilt learning rates equal the saved ones bit for bit.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"position": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = int(state["position"])
        sched = self.scheduler
        lrs = [base * fn(position) for fn, base in zip(sched.lr_lambdas, sched.base_lrs, strict=True)]
        restored = sched.state_dict()
        restored.update(last_epoch=position, _last_lr=lrs)
        sched.load_state_dict(restored)
        for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


class AttributeState:
    """Named attributes of an object (plain numbers) as a component: e.g. the trainer's step counters."""

    def __init__(self, owner: object, names: Iterable[str]) -> None:
        self.owner = owner
        self.names = tuple(names)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.owner, name) for name in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.names:
            setattr(self.owner, name, state[name])
