"""What the ranks of `tests/runs/test_traffic.py` run: steps of a real trainer, every collective recorded.

`recorded_steps` runs on each forked rank (`pack_ranks.run_on_ranks`): for each variant of overrides it
builds a trainer with `build_trainer`, trains steps 1 and 2 through `Trainer.train_step` with every
collective call recorded (`count_collectives(functional=True)`, by the mesh's group names), and beside
each step the bytes `plan.traffic.step_traffic` counts for the forwards this rank ran (their rows, and the
rows of their AdaLN tables' exchange, as the forward was told them).
Rank 0 returns every rank's `StepBytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from helpers.pack_ranks import close_trainer


@dataclass
class StepBytes:
    """One rank's step: recorded and counted `(sent, received)` per `(group, link)` and `(calls, sent)` per
    `(group, kind)`, the calls of no kind the plan counts (object collectives, barriers), and the forwards."""

    rank: int
    recorded: dict[tuple[str, str], tuple[int, int]]
    counted: dict[tuple[str, str], tuple[int, int]]
    recorded_kinds: dict[tuple[str, str], tuple[int, int]]
    counted_kinds: dict[tuple[str, str], tuple[int, int]]
    unplanned: list[str]
    forwards: list[tuple[int, int, bool]]
    block_gathered: int
    calls: list[tuple[str, str, str, int]]
    exchanges: list[tuple[str, str, str, str, int, int]]


# The ranks of one node the counted links assume: the 4 ranks are 2 nodes of 2.
RANKS_PER_NODE = 2


def _forward_recorder(model: torch.nn.Module, seen: list[tuple[int, int, bool]], samples: list[int]):
    """A forward pre-hook noting each model forward's rows, distinct timesteps and whether gradients are on,
    and the samples its tables' exchange is sized for (`pack_samples`, one unpacked)."""

    def note(module, args, kwargs):
        seen.append((int(kwargs["position_ids"].shape[0]), int(kwargs["timestep"].shape[0]), torch.is_grad_enabled()))
        samples.append(1 if kwargs.get("segments") is None else int(kwargs["pack_samples"]))

    return model.register_forward_pre_hook(note, with_kwargs=True)


def _one_step(trainer, step: int, ranks_per_node: int) -> StepBytes:
    import torch.distributed as dist

    from h3train.model.adaln_tables import table_rows
    from h3train.parallel.collectives import GroupNames, count_collectives, mesh_groups
    from h3train.plan.traffic import ForwardShape, group_link, step_traffic

    ctx = trainer.ctx
    groups = mesh_groups(ctx)
    names = GroupNames(groups)
    seen: list[tuple[int, int, bool]] = []
    samples: list[int] = []
    handle = _forward_recorder(trainer.model, seen, samples)
    try:
        with count_collectives(functional=True, groups=groups) as counts:
            trainer.train_step(step)
    finally:
        handle.remove()

    shard = groups["dp_shard_sp"]
    forwards = [
        ForwardShape(rows, table_rows(n), grad) for (rows, timesteps, grad), n in zip(seen, samples, strict=True)
    ]
    assert all(timesteps <= table_rows(n) for (_, timesteps, _), n in zip(seen, samples, strict=True))
    traffic = step_traffic(
        trainer.cfg, ctx.dims, ranks_per_node=ranks_per_node, forwards=forwards, shard_rank=dist.get_rank(shard)
    )

    def canonical(label: str) -> str:
        return names(groups[label])

    counted: dict[tuple[str, str], tuple[int, int]] = {}
    for (group, link), (sent, received) in traffic.per_group().items():
        key = (canonical(group), link)
        before = counted.get(key, (0, 0))
        counted[key] = (before[0] + sent, before[1] + received)
    counted_kinds: dict[tuple[str, str], tuple[int, int]] = {}
    for (group, kind), (calls, sent) in traffic.per_group_kind().items():
        key = (canonical(group), kind)
        before = counted_kinds.get(key, (0, 0))
        counted_kinds[key] = (before[0] + calls, before[1] + sent)
    recorded = {
        (group, group_link(group, ctx.dims, ranks_per_node)): wire for group, wire in counts.per_group().items()
    }
    unplanned = [call.entry for call in counts.calls if call.kind in ("object", "barrier")]
    return StepBytes(
        dist.get_rank(),
        recorded,
        counted,
        counts.per_group_kind(),
        counted_kinds,
        unplanned,
        seen,
        traffic.block_all_gather_bytes(),
        [(c.entry, c.kind, c.group, c.tensor_bytes) for c in counts.calls],
        [(e.what, e.kind, canonical(e.group), e.phase, e.calls, e.sent) for e in traffic.exchanges],
    )


def recorded_steps(config: str, variants: dict[str, list[str]], steps: int = 2) -> dict[str, list[list[StepBytes]]]:
    """On each rank, per variant of overrides, steps 1 to `steps` of `config` recorded (`StepBytes`); rank 0
    gets `{variant: [[step 1 of rank 0, of rank 1, ...], [step 2 ...], ...]}`."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    out: dict[str, list[list[StepBytes]]] = {}
    for name, overrides in variants.items():
        trainer = build_trainer(load_config(config, overrides), hooks=[])
        out[name] = []
        for step in range(1, steps + 1):
            mine = _one_step(trainer, step, RANKS_PER_NODE)
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            out[name].append(everyone)
        close_trainer(trainer)
    dist.barrier()
    dist.destroy_process_group()
    return out
