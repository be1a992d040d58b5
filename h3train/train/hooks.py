"""The trainer's extension points: model transforms and step hooks.

A feature that changes what is trained (adapters, frozen modules) is a **model transform**: a
callable run on the bare `MiniMaxH3Transformer3DModel` after it is built (randomly, from the meta
device, or before pretrained shards are loaded) and before the sequence-parallel wrapper and FSDP2
see it. A transform edits the module in place (adds submodules, sets `requires_grad`); it runs on
every rank and must do the same thing on each (seed any initialisation), because FSDP2 shards what
the transform leaves. Only parameters with `requires_grad` reach the optimizer, the clip and the
logged `grad_norm`. A transform that adds parameters to a model built on the meta device cannot give
them values there; it may also have `after_load(model)`, which the trainer calls on a fresh start
once the sharded model is materialised and holds its pretrained or random base values, before the
optimizer exists (a resume takes every value from the checkpoint instead).

A feature that watches or follows training (evaluation, EMA, profiling) is a **step hook**: a
`TrainerHook` whose methods the loop calls on every rank, in registration order. Hooks may run
collectives, since every rank calls them at the same points. A hook with state to keep across a
resume also implements `state_dict()` / `load_state_dict()` (DCP's `Stateful`) and joins the
checkpoint under its `name`: `Trainer.add_hook` registers it in `Trainer.checkpoint_state`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from torch import nn

from ..config import Config

if TYPE_CHECKING:
    from .trainer import Trainer

ModelTransform = Callable[[MiniMaxH3Transformer3DModel, Config], None]
"""`transform(transformer, cfg)`: edit the unsharded transformer in place before sharding."""


class TrainerHook:
    """Called by `Trainer.fit` on every rank; each method does nothing unless overridden."""

    #: Key of this hook's state in the checkpoint, when it has `state_dict` / `load_state_dict`.
    name: str = ""

    def on_attach(self, trainer: Trainer) -> None:
        """When added to the trainer, before any resume: the model is built, sharded and filled."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of this process (after any resume: `trainer.step` is the last done)."""

    def before_step(self, trainer: Trainer, step: int) -> None:
        """Before optimizer step `step` (1-based) starts loading its micro-batches."""

    def after_step(self, trainer: Trainer, step: int, stats: Mapping[str, float]) -> Mapping[str, float] | None:
        """After step `step` updated (or skipped); returned values join the step's logged metrics."""
        return None

    def on_fit_end(self, trainer: Trainer) -> None:
        """After the last step of this process, also after a preemption; not after an error, when a
        peer may be gone and a collective would hang."""


class ProfilerHook(TrainerHook):
    """`debug.profile_steps: [first, last]`: a torch.profiler trace of those steps, one file per rank.

    The trace is Chrome/Perfetto JSON at `<logging.dir>/profile/steps_<first>-<last>_rank<r>.json`,
    with each step in a `h3train step N` range, CPU activity always and CUDA kernels on GPUs.
    """

    def __init__(self, first: int, last: int, out_dir: Path, rank: int) -> None:
        self.first, self.last = first, last
        self.path = out_dir / f"steps_{first}-{last}_rank{rank}.json"
        self._profiler: torch.profiler.profile | None = None
        self._range: torch.profiler.record_function | None = None

    def before_step(self, trainer: Trainer, step: int) -> None:
        if step == self.first or (self._profiler is None and self.first < step <= self.last):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self._profiler.__enter__()
        if self._profiler is not None:
            self._range = torch.profiler.record_function(f"h3train step {step}")
            self._range.__enter__()

    def after_step(self, trainer: Trainer, step: int, stats: Mapping[str, float]) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._profiler is not None and step >= self.last:
            self._finish()

    def on_fit_end(self, trainer: Trainer) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._profiler is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._profiler is not None
        if self.path.exists():
            # A resumed run that profiles the same steps again keeps the first trace.
            self.path = self.path.with_name(f"{self.path.stem}.{_next_free(self.path)}.json")
        self._profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.path))
        self._profiler = None


def _next_free(path: Path) -> int:
    n = 1
    while path.with_name(f"{path.stem}.{n}.json").exists():
        n += 1
    return n


def trace_step_ranges(path: Path) -> list[str]:
    """Names of the `h3train step N` ranges in a trace written by `ProfilerHook`."""
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("h3train step ")})


def model_transforms(cfg: Config) -> list[ModelTransform]:
    """The transforms a config asks for, in the order they apply. Full fine-tuning has none."""
    transforms: list[ModelTransform] = []
    if cfg.lora.rank > 0:
        from ..lora.adapters import LoraTransform

        transforms.append(LoraTransform(cfg))
    return transforms


def after_load(transforms: Sequence[ModelTransform], model: nn.Module) -> None:
    """Call each transform's `after_load(model)`, where it has one (see the module docstring)."""
    for transform in transforms:
        finish = getattr(transform, "after_load", None)
        if callable(finish):
            finish(model)


def step_hooks(cfg: Config, rank: int) -> list[TrainerHook]:
    """The step hooks a config asks for, in the order they run."""
    hooks: list[TrainerHook] = []
    if cfg.debug.profile_steps:
        first, last = cfg.debug.profile_steps
        hooks.append(ProfilerHook(first, last, Path(cfg.logging.dir) / "profile", rank))
    if cfg.train.ema.decay:
        from .ema import EmaHook

        hooks.append(EmaHook(cfg.train.ema.decay))
    if cfg.validation.dataset and (cfg.validation.every or cfg.validation.at_start):
        from .validation import HeldOutLoss

        hooks.append(HeldOutLoss(cfg))
    if cfg.validation.samples:
        from ..render.hook import SampleRenderer

        hooks.append(SampleRenderer(cfg))
    return hooks
