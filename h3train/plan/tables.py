"""Whether a run serves the AdaLN tables (`parallel.adaln_tables`), from the memory plan and the step time.

With the tables served (`model/adaln_tables.py`) the blocks' projections (40 % of a block) leave the
FSDP2 units: each block gathers and reduce-scatters less, which FSDP2's prefetch hides behind compute
anyway where the step is compute-bound, and every forward adds one exchange of all the tables that
waits on the critical path (`plan/traffic.py`). `auto` (`choose_tables`) weighs both settings:

- where one of them fits the device's memory and the other does not, the one that fits;
- where both fit, the one whose estimated step (`step_time.planned_step`, each with the blocks'
  policies its own memory plan chose) is shorter; without the tables on a tie;
- where neither fits, the one of the smaller peak;
- not at all where the tables cannot be served: a shard group of one rank, or CPU offload.

`true` and `false` are kept as given; both settings' figures are computed either way, so `check`
prints them side by side (`tables_line`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .arithmetic import MemoryPlan
from .step_time import Rates, StepEstimate, planned_step

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config
    from ..parallel.dims import ParallelDims


@dataclass(frozen=True)
class TablesChoice:
    """`served`: whether the run serves the tables; `given`: `parallel.adaln_tables` as configured
    (`auto`, `true`, `false`); `plans` / `steps`: each setting's memory plan and, where it fits, its
    estimated step (keyed by served); `reason`: why, in a few words."""

    served: bool
    given: str
    plans: Mapping[bool, MemoryPlan]
    steps: Mapping[bool, StepEstimate | None]
    reason: str


def with_tables(cfg: Config, served: bool) -> Config:
    """`cfg` with `parallel.adaln_tables` set to `served` (a copy: the loaded config stays as it was)."""
    return replace(cfg, parallel=replace(cfg.parallel, adaln_tables=served))


def servable(cfg: Config, dims: ParallelDims) -> bool:
    """Whether the tables can be served on `dims`: a shard group of more than one rank, no CPU offload."""
    return dims.shard_size > 1 and not cfg.parallel.cpu_offload


def choose_tables(
    cfg: Config,
    dims: ParallelDims,
    model_dims: Mapping[str, Any],
    rates: Rates,
    *,
    ranks_per_node: int,
    plan_of: Callable[[Config, ParallelDims], MemoryPlan],
    transformer: nn.Module | None = None,
) -> TablesChoice:
    """Both settings' plans and steps, and the setting the run takes (module docstring). `plan_of(cfg, dims)`
    plans one setting's memory; `transformer`: the meta model the traffic count reads (None: built)."""
    given = cfg.parallel.adaln_tables
    plans: dict[bool, MemoryPlan] = {}
    steps: dict[bool, StepEstimate | None] = {}
    can = servable(cfg, dims)
    for served in (False, True) if can else (False,):
        setting = with_tables(cfg, served)
        plans[served] = plan_of(setting, dims)
        steps[served] = (
            planned_step(
                setting, dims, plans[served], model_dims, rates, ranks_per_node=ranks_per_node, transformer=transformer
            )
            if plans[served].fits
            else None
        )
    if isinstance(given, bool):
        served = given and can
        reason = "as configured" if served == given else "configured, but a shard group of one rank or CPU offload"
        return TablesChoice(served, str(given).lower(), plans, steps, reason)
    if not can:
        return TablesChoice(False, "auto", plans, steps, "a shard group of one rank or CPU offload serves none")
    on, off = steps[True], steps[False]
    if on is not None and off is not None:
        served = on.step_s < off.step_s
        reason = "the shorter estimated step" if served else "no shorter estimated step with them"
    elif on is not None or off is not None:
        served = on is not None
        reason = "what makes the run fit" if served else "the run fits only without them"
    else:
        served = plans[True].peak_bytes < plans[False].peak_bytes
        reason = "neither fits: the smaller peak"
    return TablesChoice(served, "auto", plans, steps, reason)


def _setting(choice: TablesChoice, served: bool) -> str:
    step = choice.steps.get(served)
    plan = choice.plans.get(served)
    if plan is None:
        return "not servable"
    peak = f"{plan.peak_bytes / 2**30:.1f} GiB"
    return f"~{step.step_s:,.2f} s a step, {peak}" if step is not None else f"does not fit ({peak})"


def tables_line(choice: TablesChoice) -> str:
    """`AdaLN tables: on (parallel.adaln_tables: auto, the shorter estimated step): with them ~..., without ...`."""
    word = "on" if choice.served else "off"
    return (
        f"AdaLN tables: {word} (parallel.adaln_tables: {choice.given}, {choice.reason}); with them "
        f"{_setting(choice, True)}, without {_setting(choice, False)}"
    )
