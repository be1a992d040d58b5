"""A start's blueprint drawn in a test as a start draws it, for a device the test names (CUDA's path on a CPU)."""

from __future__ import annotations

from h3train.config import Config
from h3train.parallel.dims import ParallelDims
from h3train.plan.step_time import DEFAULT_DEVICE
from h3train.run.blueprint import Blueprint, draw
from h3train.run.preflight import JobDevice, preflight


def blueprint_of(
    cfg: Config, device_kind: str, memory_gib: float, world_size: int = 1, gpu_kind: str = DEFAULT_DEVICE
) -> Blueprint:
    """`cfg`'s blueprint at `world_size` ranks on a `device_kind` device of `memory_gib` GiB (`gpu_kind`'s card),
    checked as `h3train check` checks it (`preflight` planning away from what is not here)."""
    checked = preflight(cfg, planning=True)
    mesh = ParallelDims.from_config(cfg.parallel, world_size)
    return draw(checked, mesh, JobDevice(memory_gib, gpu_kind), device_kind=device_kind)


def start_plan(cfg: Config, device_kind: str, memory_gib: float, world_size: int = 1) -> Blueprint:
    """What a start does with the blueprint's plan: print its lines (rank 0) and refuse a run over it on a GPU."""
    blueprint = blueprint_of(cfg, device_kind, memory_gib, world_size)
    blueprint.announce(is_main=True)
    return blueprint
