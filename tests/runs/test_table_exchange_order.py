"""No AdaLN table exchange sits among the block units' collectives, recomputed blocks included.

FSDP2 issues each block unit's all-gather (forward, and again in backward: the prefetch) and reduce-scatter
on the shard group's communicator, which NCCL runs in issue order. The tables' exchanges share it
(`model/adaln_tables.py`). Were a block to exchange its own table, a block recomputed in backward
(`selective`, `full`) would issue it between the previous block's reduce-scatter and the next block's
prefetch. Two gloo ranks train the tiny Ref2VA model with the tables on under each policy; step 2's
collectives are recorded in the order issued (`helpers.budget_ranks.collective_order`). A table exchange
is a functional collective on the shard group (recorded as `op.*`: FSDP2 issues `torch.distributed`'s);
none may come after one of FSDP2's reduce-scatters and before one of its all-gathers (a prefetch).
"""

from __future__ import annotations

import pytest

from helpers.budget_ranks import collective_order
from helpers.launch import run_env
from helpers.pack_ranks import mixed_overrides, run_on_ranks
from helpers.paths import ROOT

CONFIG = ROOT / "configs" / "tiny_ref2va.yaml"
POLICIES = ("selective", "full")


def _is_table(call: tuple[str, str, str, int]) -> bool:
    entry, _, group, _ = call
    return group == "dp_shard_sp" and entry.startswith("op.")


def _is_fsdp(call: tuple[str, str, str, int], kind: str) -> bool:
    entry, found, group, _ = call
    return group == "dp_shard_sp" and entry.startswith("dist.") and found == kind


@pytest.fixture(scope="module")
def orders(mixed_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    runs = {
        f"{policy}{'_planted' if plant else ''}": (
            [
                *mixed_overrides(mixed_data, root / f"{policy}{plant or ''}"),
                "parallel.dp_shard=2",
                "parallel.adaln_tables=true",
                "train.grad_accum=1",
                f"model.activation_checkpointing={policy}",
            ],
            plant,
        )
        for policy in POLICIES
        for plant in (None,)
    }
    return run_on_ranks(collective_order, 2, str(CONFIG), runs, env=run_env())


def _misplaced(calls: list[tuple[str, str, str, int]]) -> list[tuple[int, int]]:
    """(table exchange, earlier reduce-scatter) pairs where an all-gather follows the exchange."""
    tables = [i for i, c in enumerate(calls) if _is_table(c)]
    scatters = [i for i, c in enumerate(calls) if _is_fsdp(c, "reduce_scatter")]
    gathers = [i for i, c in enumerate(calls) if _is_fsdp(c, "all_gather")]
    return [(t, s) for t in tables for s in scatters if s < t and any(g > t for g in gathers)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_no_table_exchange_between_the_block_units_collectives(orders, policy: str) -> None:
    calls = orders[policy]
    tables = [i for i, c in enumerate(calls) if _is_table(c)]
    scatters = [i for i, c in enumerate(calls) if _is_fsdp(c, "reduce_scatter")]
    gathers = [i for i, c in enumerate(calls) if _is_fsdp(c, "all_gather")]
    # Every block's tables: one all-gather and one all-to-all forward, one all-to-all and one reduce-scatter
    # back, however many blocks and whichever recompute.
    assert sorted(calls[i][1] for i in tables) == ["all_gather", "all_to_all", "all_to_all", "reduce_scatter"]
    assert scatters and gathers
    assert not _misplaced(calls), f"{policy}: table exchanges after a reduce-scatter: {_misplaced(calls)}: {calls}"
    print(policy, [("table" if i in tables else c[1]) for i, c in enumerate(calls)])
