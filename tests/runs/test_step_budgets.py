"""The step's deterministic budgets, counted on real steps: collectives per block and per group, host syncs.

Step 2 of the tiny Ref2VA model (2 transformer blocks, 1 refiner block) on the mixed dataset is counted
through `Trainer.fit` (`helpers/budget_ranks.py`) at dp 2, dp 2 x sp 2 and HSDP 2 x 2, each with the
AdaLN tables off and on (`model/adaln_tables.py`), every rank with samples of its own (other tasks,
lengths and counts of timesteps). The budgets, by process group and kind:

- Ulysses (sp 2): 4 all-to-alls per block (q/k/v and the output, forward and backward; nothing recomputed);
- FSDP2 over the shard group: each unit all-gathers in forward (the blocks, the refiner block, the float32
  islands, the root) and every block but the last again in backward; each unit reduce-scatters once;
- the AdaLN tables, served: one all-gather of the embeddings and one all-to-all of every block's table
  slices a forward, the same two back a backward, whatever the blocks; under HSDP one all-reduce of each
  projection's weight and bias gradients across replicas;
- the step: the gradient norm's all-reduce over the shard group, the step's sums over every rank, and
  one device->host sync (`SyncCounter`).

Each planted regression (`budget_ranks.PLANTS`) must break a budget: the tables exchanged per block, the
count of timesteps agreed and read back per forward, one more all-gather per block.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from helpers.budget_ranks import PLANTS, StepCount, budget_steps
from helpers.launch import run_env
from helpers.pack_ranks import mixed_overrides, run_on_ranks
from helpers.paths import ROOT

CONFIG = ROOT / "configs" / "tiny_ref2va.yaml"

LAYOUTS = {
    "dp2": (2, ("parallel.dp_shard=2",)),
    "dp2_sp2": (4, ("parallel.dp_shard=2", "parallel.sp=2")),
    "hsdp2x2": (4, ("parallel.dp_replicate=2", "parallel.dp_shard=2")),
}
REFINER_BLOCKS = yaml.safe_load(CONFIG.read_text())["model"]["config"]["num_refiner_layers"]
# The units beside the blocks: the float32 islands and the root.
OTHER_UNITS = 2


def budget(layout: str, tables: bool, blocks: int) -> Counter:
    """Calls of one step (one micro-batch with gradients, no CFG) by `(group, kind)` (module docstring)."""
    sp = 2 if "sp2" in layout else 1
    replicas = 2 if layout.startswith("hsdp") else 1
    units = blocks + REFINER_BLOCKS + OTHER_UNITS
    out: Counter = Counter()
    if sp > 1:
        out[("sp", "all_to_all")] = 4 * blocks
        out[("sp", "all_gather")] = 1  # the output heads' rows
    out[("dp_shard_sp", "all_gather")] = units + blocks + REFINER_BLOCKS - 1
    out[("dp_shard_sp", "reduce_scatter")] = units
    if tables:
        out[("dp_shard_sp", "all_gather")] += 1
        out[("dp_shard_sp", "all_to_all")] = 2
        out[("dp_shard_sp", "reduce_scatter")] += 1
        if replicas > 1:
            out[("dp_replicate", "all_reduce")] += 2 * blocks
    if replicas > 1:
        out[("dp_replicate", "all_reduce")] += units
    out[("dp_shard_sp", "all_reduce")] = 1  # the gradient norm
    out[("world", "all_reduce")] = 1  # the step's sums
    return out


def over_budget(count: StepCount, layout: str, tables: bool) -> list[str]:
    """What one rank's counted step spends beyond (or short of) its budgets."""
    want: Counter = Counter()
    for (group, kind), n in budget(layout, tables, count.blocks).items():
        want[(count.names[group], kind)] += n
    got = Counter({key: n for key, n in count.calls.items() if n})
    keys = sorted(set(want) | set(got))
    found = [f"{g} {k}: {got[(g, k)]} calls, budget {want[(g, k)]}" for g, k in keys if got[(g, k)] != want[(g, k)]]
    syncs = sum(count.syncs.values())
    if syncs != 1:
        found.append(f"{syncs} device->host syncs, budget 1: {count.syncs}")
    return found


def variants(data: Path, root: Path, parallel: tuple[str, ...], plants: bool) -> dict:
    common = [*mixed_overrides(data, root), "train.grad_accum=1", "model.activation_checkpointing=none"]
    out = {
        f"tables_{t}": ([*common, f"logging.dir={root / t}", *parallel, f"parallel.adaln_tables={t}"], None)
        for t in ("false", "true")
    }
    if plants:
        for plant in PLANTS:
            overrides = [*common, f"logging.dir={root / plant}", *parallel, "parallel.adaln_tables=true"]
            out[plant] = (overrides, plant)
    return out


@pytest.fixture(scope="module")
def counted(mixed_data, tmp_path_factory) -> dict[str, dict[str, list[StepCount]]]:
    root = tmp_path_factory.mktemp("budgets")
    out = {}
    for name, (nproc, parallel) in LAYOUTS.items():
        runs = variants(mixed_data, root / name, parallel, plants=name == "dp2_sp2")
        out[name] = run_on_ranks(budget_steps, nproc, str(CONFIG), runs, env=run_env(), timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["false", "true"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_step_keeps_its_budgets(counted, layout: str, tables: str) -> None:
    ranks = counted[layout][f"tables_{tables}"]
    for count in ranks:
        assert not over_budget(count, layout, tables == "true"), f"{layout} tables {tables} rank {count.rank}"
    per_block = ranks[0].calls.get(("sp", "all_to_all"), 0) / ranks[0].blocks
    print(f"{layout} tables {tables}: {per_block:g} Ulysses all-to-alls per block; calls {ranks[0].calls}")


@pytest.mark.slow
@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_regression_breaks_a_budget(counted, plant: str) -> None:
    for count in counted["dp2_sp2"][plant]:
        found = over_budget(count, "dp2_sp2", True)
        assert found, f"{plant} kept every budget on rank {count.rank}"
        print(f"{plant}, rank {count.rank}: {found}")
