"""EMA of the trainable parameters, sharded exactly like them.

`train.ema.decay = d` (0: off) keeps `ema <- d * ema + (1 - d) * param` after every optimizer update
that was taken (a skipped non-finite step leaves it as it is), starting from the weights the run
starts from. Each shadow is a float32 DTensor with its parameter's mesh and placements, so each
rank updates its own shard with no communication. The shadows are the checkpoint component `ema`
(keyed by the parameter FQNs, so DCP reshards them on a resume under another layout; a resume of a
checkpoint written without an EMA starts it from the resumed weights), `h3train
export --ema` writes them in place of the weights, and `validation.use_ema` evaluates with them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ..parallel.shards import local_tensor
from .hooks import TrainerHook, TrainerView

EMA_COMPONENT = "ema"


class EmaHook(TrainerHook):
    """Updates after each taken step; joins the checkpoint as `ema`.

    It is the run's `EvaluationWeights` (`swapped_in`), through which `validation.use_ema` evaluates.
    """

    name = EMA_COMPONENT
    # Switched on when resuming a checkpoint written without one, the EMA starts from the resumed weights.
    fresh_if_missing = True

    def __init__(self, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params: dict[str, torch.nn.Parameter] = {}
        self.shadow: dict[str, torch.Tensor] = {}
        self._skipped_before = 0
        self._trainer: TrainerView | None = None

    def on_attach(self, trainer: TrainerView) -> None:
        self._trainer = trainer
        # Before any resume, which then overwrites the shadows in place.
        self.params = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.shadow = {name: p.detach().clone().float() for name, p in self.params.items()}

    def start_fresh(self) -> None:
        """Restart the average at the current weights."""
        with torch.no_grad():
            for name, shadow in self.shadow.items():
                local_tensor(shadow).copy_(local_tensor(self.params[name]))

    def state_dict(self) -> dict[str, Any]:
        return dict(self.shadow)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise KeyError(f"no EMA for {missing[0]} (and {len(missing) - 1} more)")
        with torch.no_grad():
            for name, shadow in self.shadow.items():
                if state[name] is not shadow:
                    shadow.copy_(state[name])

    def before_step(self, trainer: TrainerView, step: int) -> None:
        self._skipped_before = trainer.skipped_steps

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        if trainer.skipped_steps != self._skipped_before:
            return
        names = list(self.shadow)
        with torch.no_grad():
            torch._foreach_lerp_(
                [local_tensor(self.shadow[n]) for n in names],
                [local_tensor(self.params[n]).float() for n in names],
                1.0 - self.decay,
            )

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The trainable parameters hold the EMA inside the block and their own values again after it."""
        if self._trainer is not None:
            # After a skipped step, validation runs before the next update: a background save may
            # still be copying these parameters (`TrainerView.wait_staged`).
            self._trainer.wait_staged()
        with torch.no_grad():
            saved = {n: local_tensor(p).clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                local_tensor(p).copy_(local_tensor(self.shadow[n]))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    local_tensor(p).copy_(saved[n])
