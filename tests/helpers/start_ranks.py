"""What the ranks of `tests/runs/test_collective_order_under_load.py` run: a run's start and first step, with
chosen ranks late at the start's data step, every collective of each rank recorded in order.

`start_orders` runs on each forked rank (`pack_ranks.run_on_ranks`). For each round it builds a trainer with
`build_trainer` and trains it to the end (one step), as `h3train train` does, while `count_collectives`
records every collective; the round's late ranks enter the start's data step (`assemble._create_synthetic_dataset`,
where rank 0 writes `data.create_synthetic`'s dataset) only once rank 0 has written the dataset's index. That
is the order a loaded machine makes by chance, made on purpose: a rank that took a branch from the files it
saw there would see the dataset and its peers would not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from helpers.pack_ranks import close_trainer

#: One recorded collective: `(entry, kind, group size, tensor bytes)` (`parallel.collectives.CollectiveCall`).
Call = tuple[str, str, int, int]

# How long a late rank waits for rank 0's index: a start that writes none (or writes it only after a
# collective the late rank would have to join) goes on after this, in the order it has then.
_LATE_WAIT_S = 30.0
_POLL_S = 0.02


def _late_until_written(original: Callable, late: frozenset[int]) -> Callable:
    """`_create_synthetic_dataset` that the ranks in `late` enter only once each folder of `data.path` holds
    an index."""
    from h3train.config import dataset_specs
    from h3train.data.location import INDEX_NAME

    def entered_late(cfg: Any, ctx: Any, text_dim: int) -> None:
        if ctx.rank in late:
            indexes = [Path(spec.path) / INDEX_NAME for spec in dataset_specs(cfg.data)]
            deadline = time.monotonic() + _LATE_WAIT_S
            while not all(index.is_file() for index in indexes) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        return original(cfg, ctx, text_dim)

    return entered_late


@contextlib.contextmanager
def _late_ranks(late: frozenset[int]) -> Iterator[None]:
    from h3train.run import assemble

    with mock.patch.object(
        assemble, "_create_synthetic_dataset", _late_until_written(assemble._create_synthetic_dataset, late)
    ):
        yield


def start_orders(config: str, rounds: dict[str, tuple[list[str], list[int]]]) -> dict[str, list[list[Call]]]:
    """On each rank, per round `(overrides, late ranks)`, the collectives of `config`'s start and training in
    the order issued; rank 0 gets `{round: [rank 0's calls, rank 1's, ...]}`."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.parallel.collectives import count_collectives
    from h3train.run.assemble import build_trainer

    out: dict[str, list[list[Call]]] = {}
    for name, (overrides, late) in rounds.items():
        with _late_ranks(frozenset(late)), count_collectives(functional=True) as counts:
            trainer = build_trainer(load_config(config, overrides))
            try:
                trainer.fit()
            finally:
                close_trainer(trainer)
        mine = [(c.entry, c.kind, c.group_size, c.tensor_bytes) for c in counts.calls]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out[name] = everyone
    dist.barrier()
    return out
