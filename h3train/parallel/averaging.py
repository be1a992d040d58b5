"""Whether this run's process groups average when asked to, checked on the groups themselves.

FSDP2 reduces gradients with `ReduceOp.AVG`: a reduce-scatter over the sharding group
(`dp_shard x sp`) and, under HSDP, an all-reduce over `dp_replicate`. The Ulysses scale
(`parallel/ulysses.py`) relies on that average being exactly the mean. Not every backend keeps it:
torch 2.8's gloo sums in `reduce_scatter_tensor` when asked to average (its `all_reduce` averages),
which trains on gradients `dp_shard x sp` times too large without any error.

So at start-up each rank runs one tiny reduce-scatter and one all-reduce of known values on each
group FSDP2 reduces over: rank `r` of an `n`-rank group contributes `r + 1` everywhere, whose average
is `(n + 1) / 2` and whose sum is `n (n + 1) / 2`. Where a backend sums, the run tells FSDP2 to
reduce by SUM and divide by the data-parallel size itself (`set_force_sum_reduction_for_comms`,
applied in `model/fsdp.py`), which is the same average computed without the backend's AVG. A
backend that gives neither value is refused. A one-rank group averages trivially; a fake process
group (a rehearsal) moves no values and is not probed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclass(frozen=True)
class Averaging:
    """What the run's groups do with `ReduceOp.AVG`: `summed` names each collective that summed."""

    summed: tuple[str, ...] = ()

    @property
    def force_sum(self) -> bool:
        """Whether FSDP2 must reduce by SUM and divide by the data-parallel size itself."""
        return bool(self.summed)

    def describe(self, factor: int) -> str:
        """The start-up line of a run whose backend sums; `factor` is the data-parallel size."""
        return (
            f"gradient averaging: {'; '.join(self.summed)} summed when asked to average "
            f"(torch {torch.__version__}): FSDP2 reduces by SUM and divides by {factor} itself"
        )


def averaged(kind: str, group: dist.ProcessGroup, device: torch.device) -> float:
    """One `kind` collective with `ReduceOp.AVG` of the value `rank + 1` on `group`; the value returned."""
    n = group.size()
    value = float(dist.get_rank(group) + 1)
    if kind == "reduce-scatter":
        out = torch.zeros(1, device=device)
        # The call FSDP2 makes: `reduce_scatter_single` where torch has it (its older name warns there).
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(out, torch.full((n,), value, device=device), op=dist.ReduceOp.AVG, group=group)
    else:
        out = torch.full((1,), value, device=device)
        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
    return out.item()


def _probe(kind: str, group: dist.ProcessGroup, name: str, device: torch.device) -> str | None:
    """`None` when `kind` averages on `group`, a description when it sums; refuses anything else."""
    n = group.size()
    if n == 1:
        return None
    got = averaged(kind, group, device)
    mean, total = (n + 1) / 2, n * (n + 1) / 2
    if abs(got - mean) <= 1e-6 * mean:
        return None
    backend = dist.get_backend(group)
    if abs(got - total) <= 1e-6 * total:
        return f"{backend}'s {kind} over {name} ({n} ranks)"
    raise ConfigError(
        f"{backend}'s {kind} with ReduceOp.AVG over {name} ({n} ranks) gave {got:g}, neither the average "
        f"{mean:g} nor the sum {total:g}: gradients cannot be reduced on it; set parallel.backend to another backend"
    )


def check_averaging(groups: dict[str, dist.ProcessGroup], device: torch.device) -> Averaging:
    """Probe each `name -> group` FSDP2 reduces over: the sharding group (`dp_shard_sp`: a
    reduce-scatter and an all-reduce) and, under HSDP, the replicate group (`dp_replicate`: an all-reduce)."""
    if not groups or dist.get_backend(next(iter(groups.values()))) == "fake":
        return Averaging()
    # The replicate group only all-reduces (HSDP); the sharding group reduce-scatters the gradients.
    kinds = {name: ("all-reduce",) if name == "dp_replicate" else ("reduce-scatter", "all-reduce") for name in groups}
    found = (_probe(kind, groups[name], name, device) for name in groups for kind in kinds[name])
    return Averaging(tuple(f for f in found if f is not None))
