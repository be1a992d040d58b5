"""What the ranks of `tests/runs/test_step_budgets.py` run: one counted step of a real trainer per variant.

`budget_steps` runs on each forked rank (`pack_ranks.run_on_ranks`): for each variant it builds a trainer
with `build_trainer`, trains step 1 (the warm-up: lazy set-up, the first prefetch) and counts step 2
through `Trainer.fit`, as a run does: every collective by process group and kind (`count_collectives`
under `mesh_groups`' names) and every call that is a device->host sync on a GPU (`SyncCounter`). A variant
may plant a regression (`PLANTS`) for its trainer's life: the budgets must see each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from helpers.pack_ranks import close_trainer


@dataclass(frozen=True)
class StepCount:
    """One rank's counted step: calls by `(group, kind)`, host syncs by where they were made, the model's
    transformer blocks, and the name each mesh group's calls are recorded under (a group over the same ranks
    as an earlier one takes its name: `GroupNames`)."""

    rank: int
    calls: dict[tuple[str, str], int]
    syncs: dict[str, int]
    blocks: int
    names: dict[str, str]


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _tables_per_block(original: Callable) -> Callable:
    """`block_tables` exchanging each block's table on its own: one exchange per block, not per forward."""

    def per_block(blocks, temb, rows, group):
        return [table for block in blocks for table in original([block], temb, rows, group)]

    return per_block


def _agreed_rows(original: Callable) -> Callable:
    """`block_tables` after the group agrees on its count of timesteps: an all-reduce read back per forward."""
    import torch.distributed as dist

    def agreed(blocks, temb, rows, group):
        count = torch.tensor([temb.shape[0]], dtype=torch.int64, device=temb.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group.shard)
        return original(blocks, temb, max(rows, int(count.item())), group)

    return agreed


def _gather_per_block(original: Callable) -> Callable:
    """`SequenceParallelH3._run` that all-gathers a small tensor over the shard group beside each block."""
    import torch.distributed as dist

    def run(self, policy, fn, *args):
        if fn in self.transformer.transformer_blocks and dist.get_world_size() > 1:
            one = torch.zeros(1)
            dist.all_gather_into_tensor(torch.zeros(dist.get_world_size()), one)
        return original(self, policy, fn, *args)

    return run


def _plant(name: str | None) -> contextlib.AbstractContextManager:
    from h3train.model import sp_forward

    if name is None:
        return contextlib.nullcontext()
    return {
        "tables_per_block": lambda: _patched(sp_forward, "block_tables", _tables_per_block),
        "agreed_rows": lambda: _patched(sp_forward, "block_tables", _agreed_rows),
        "gather_per_block": lambda: _patched(sp_forward.SequenceParallelH3, "_run", _gather_per_block),
    }[name]()


#: The planted regressions `budget_steps` knows, by name.
PLANTS = ("tables_per_block", "agreed_rows", "gather_per_block")


def budget_steps(config: str, variants: dict[str, tuple[list[str], str | None]]) -> dict[str, list[StepCount]]:
    """On each rank, per variant `(overrides, plant)`, step 2 of `config` counted (`StepCount`); rank 0 gets
    `{variant: [rank 0's, rank 1's, ...]}`."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.parallel.collectives import GroupNames, count_collectives, mesh_groups
    from h3train.run.assemble import build_trainer
    from h3train.tools.host_syncs import SyncCounter

    out: dict[str, list[StepCount]] = {}
    for name, (overrides, plant) in variants.items():
        with _plant(plant):
            trainer = build_trainer(load_config(config, [*overrides, "train.steps=2"]), hooks=[])
            try:
                trainer.train_step(1)
                trainer.step = 1
                groups = mesh_groups(trainer.ctx)
                counter = SyncCounter()
                try:
                    with count_collectives(functional=True, groups=groups) as counts:
                        counter.active = True
                        trainer.fit()
                finally:
                    counter.active = False
                    counter.restore()
                calls = {key: n for key, (n, _) in counts.per_group_kind().items()}
                blocks = len(trainer.model.transformer.transformer_blocks)
                named = GroupNames(groups)
                names = {name: named(group) for name, group in groups.items()}
                mine = StepCount(dist.get_rank(), calls, dict(counter.calls), blocks, names)
            finally:
                close_trainer(trainer)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out[name] = everyone
    dist.barrier()
    return out


def collective_order(
    config: str, variants: dict[str, tuple[list[str], str | None]]
) -> dict[str, list[tuple[str, str, str, int]]]:
    """On each rank, per variant `(overrides, plant)`, step 2 of `config`'s collectives in the order issued
    (`(entry, kind, group, tensor bytes)`, `count_collectives`); rank 0 gets its own, by variant."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.parallel.collectives import count_collectives, mesh_groups
    from h3train.run.assemble import build_trainer

    out: dict[str, list[tuple[str, str, str, int]]] = {}
    for name, (overrides, plant) in variants.items():
        with _plant(plant):
            trainer = build_trainer(load_config(config, [*overrides, "train.steps=2"]), hooks=[])
            try:
                trainer.train_step(1)
                with count_collectives(functional=True, groups=mesh_groups(trainer.ctx)) as counts:
                    trainer.train_step(2)
                out[name] = [(c.entry, c.kind, c.group, c.tensor_bytes) for c in counts.calls]
            finally:
                close_trainer(trainer)
    dist.barrier()
    return out
