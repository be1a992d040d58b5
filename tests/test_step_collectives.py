"""Collectives per training step under the FSDP2 unit plan (`parallel/fsdp.py`), counted, not timed.

Two gloo ranks at sp = 2 train the tiny FL2VA model (2 blocks, 1 refiner block); the second step's
collectives are counted by wrapping the `torch.distributed` and functional-collective entry points.
The plan before it (one unit per float32 island, every unit but the root resharded after forward)
issued 17 all-gathers and 9 reduce-scatters here, 26 in all.
"""

from __future__ import annotations

import pytest
import yaml

from h3train.bench_memory import step_collectives
from h3train.parallel.collectives import fsdp_collectives_per_step, functional_all_to_alls_per_step

from reference import TINY_FL2VA


@pytest.mark.slow
def test_sp2_step_issues_the_planned_collectives() -> None:
    dims = yaml.safe_load(TINY_FL2VA.read_text())["model"]["config"]
    layers, refiner = dims["num_layers"], dims["num_refiner_layers"]
    counts = step_collectives(world=2, sp=2, config=TINY_FL2VA)

    planned = fsdp_collectives_per_step(layers, refiner, shard_size=2)
    assert counts.fsdp() == planned
    # Islands in one unit, the last block kept unsharded for backward: 12 where there were 26.
    assert sum(planned.values()) == 12
    # Ulysses: one fused q/k/v all-to-all and one back per block, each way.
    assert counts.kind("all_to_all") == functional_all_to_alls_per_step(layers, sp=2) == 4 * layers
    # The output heads travel back in one all-gather; the clip's norm in one all-reduce.
    assert counts["dist.all_gather"] == 1
    assert counts.kind("all_reduce") == 1
