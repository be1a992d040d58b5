"""The sums of one optimizer step that travel in its one all-reduce, named rather than placed.

`StepTotals` says what each entry of the reduced tensor holds: `pack` lays the named values out in
one flat float64 tensor, `unpack` reads them back by the same names, so no caller indexes it.
`StepReduction` is the step's reduction as the trainer is given it: `all_reduce_to_host` on a real
process group; a rehearsal on fake tensors, which cannot be read on the host, gives its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
import torch.distributed as dist

# Marks a field summed on the device; the others are counted on the host.
_ON_DEVICE = {"device": True}


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, with no wait for the device: a host tensor goes to CUDA pinned and non-blocking.

    A copy from pageable host memory makes the host wait for every kernel queued before it (CUDA's
    sync debug mode reports it as a sync); torch's host allocator keeps a pinned buffer until its copy is done.
    """
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class StepTotals:
    """One step's sums over every rank (the all-reduce is a SUM).

    The loss terms are summed over micro-batches on the device (the audio terms of silent clips
    zeroed); the counts on the host. `preempting` / `interrupting` count the ranks asked to stop by a
    preemption signal / by Ctrl-C: summed flags, so above 0 wherever any rank got the signal (their
    MAX), and every rank agrees on the stop.
    """

    loss: float = field(metadata=_ON_DEVICE)
    loss_video: float = field(metadata=_ON_DEVICE)
    loss_audio: float = field(metadata=_ON_DEVICE)
    loss_video_fm: float = field(metadata=_ON_DEVICE)
    loss_audio_fm: float = field(metadata=_ON_DEVICE)
    audio_samples: float
    rows: float
    cfg_scale_video: float
    cfg_scale_audio: float
    data_errors: float
    preempting: float
    interrupting: float

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every field, in the order of the packed tensor: the device's sums, then the host's counts."""
        return (*cls.loss_names(), *cls.count_names())

    @classmethod
    def loss_names(cls) -> tuple[str, ...]:
        """The fields summed on the device, in packed order."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("device"))

    @classmethod
    def count_names(cls) -> tuple[str, ...]:
        """The fields counted on the host, in packed order (after the device's)."""
        return tuple(f.name for f in fields(cls) if not f.metadata.get("device"))

    @classmethod
    def loss_terms(cls, **terms: torch.Tensor) -> torch.Tensor:
        """The device terms named by `loss_names` as one float64 tensor, in packed order."""
        return torch.stack([terms[name] for name in cls.loss_names()]).double()

    @classmethod
    def pack(cls, losses: torch.Tensor, counts: Mapping[str, float]) -> torch.Tensor:
        """`losses` (from `loss_terms`, on the device) then `counts` by name: one flat float64 tensor.

        The counts go to the device by `to_device`, which does not wait for the backward.
        """
        host = torch.tensor([float(counts[name]) for name in cls.count_names()], dtype=torch.float64)
        return torch.cat([losses.to(torch.float64), to_device(host, losses.device)])

    @classmethod
    def unpack(cls, values: Sequence[float]) -> StepTotals:
        """The totals from the first `len(names())` values of a packed tensor read back to the host."""
        names = cls.names()
        if len(values) < len(names):
            raise ValueError(f"a packed step reduction has {len(names)} values, got {len(values)}")
        return cls(**dict(zip(names, values)))


@dataclass(frozen=True)
class ReducedStep:
    """What the step's reduction brings to the host: `totals` over every rank, `scalars` and this rank's
    micro-batch `losses` as they were given (unreduced), in the same order."""

    totals: StepTotals
    scalars: list[float]
    losses: list[float]


class StepReduction(Protocol):
    """The step's one reduction and its one device->host copy (`all_reduce_to_host` says what each input is)."""

    def __call__(
        self,
        device_sums: torch.Tensor,
        counts: Mapping[str, float],
        scalars: Sequence[torch.Tensor],
        losses: Sequence[torch.Tensor],
    ) -> ReducedStep: ...


def all_reduce_to_host(
    device_sums: torch.Tensor,
    counts: Mapping[str, float],
    scalars: Sequence[torch.Tensor],
    losses: Sequence[torch.Tensor],
) -> ReducedStep:
    """`StepTotals.pack(device_sums, counts)` summed over every rank of the default group (one all-reduce),
    then read back with `scalars` and `losses` in one copy to the host.

    `device_sums` float64 `[len(StepTotals.loss_names())]` on the device; `counts` by their
    `StepTotals.count_names()`; `scalars` 0-d tensors (they may live on the host: parameters offloaded
    to the CPU) and `losses` 0-d, both copied unreduced.
    """
    reduced = StepTotals.pack(device_sums, counts)
    dist.all_reduce(reduced)
    device = device_sums.device
    local = torch.stack([*(t.to(device, torch.float64) for t in scalars), *(loss.double() for loss in losses)])
    values = torch.cat([reduced, local]).tolist()
    rest = values[len(StepTotals.names()) :]
    n = len(scalars)
    return ReducedStep(StepTotals.unpack(values), rest[:n], rest[n:])
