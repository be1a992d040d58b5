"""Every rank of a launch plans against the same device: the least memory and the slowest card of the job.

`model.activation_checkpointing: auto` and `parallel.adaln_tables: auto` decide from the device's memory
(and the tables from its kind too); what they decide changes the collectives a step issues. Two gloo
ranks are given different cards (an H100 with 79.1 GiB, an A100 slice with 60), and each resolves the
released 16-GPU config as on CUDA: alone they would choose different policies; after the start's one
agreement (`agree_job_device`) they choose the same, those of the smaller card.
"""

from __future__ import annotations

import pytest

from h3train.parallel.collectives import count_collectives
from h3train.parallel.dims import ParallelDims

from helpers.paths import ROOT
from helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "h3_a100_16gpu.yaml"
# What each rank's card would report: a different kind and a different memory on each.
CARDS = (("h100", 79.1), ("a100", 60.0))


def _worker(rank: int, world: int) -> dict:
    import torch

    from h3train.config import load_config
    from h3train.run.blueprint import draw
    from h3train.run.preflight import JobDevice, agree_job_device, preflight

    checked = preflight(load_config(CONFIG, ["model.pretrained=/nonexistent/MiniMax-H3"]), planning=True)
    dims = ParallelDims.from_config(checked.cfg.parallel, 16)
    kind, memory = CARDS[rank]
    own = JobDevice(memory, kind)
    with count_collectives() as counts:
        job = agree_job_device(torch.device("cpu"), own)
    alone, agreed = (draw(checked, dims, device, device_kind="cuda") for device in (own, job))
    return {
        "calls": [(c.kind, c.entry) for c in counts.calls],
        "job": job,
        "own_policies": alone.policies,
        "policies": agreed.policies,
        "tables": agreed.cfg.parallel.adaln_tables,
    }


def test_ranks_with_different_cards_agree_on_the_smallest_and_choose_alike() -> None:
    results = run_ranks(_worker, 2)
    first, second = results
    # Alone, the two cards take different recompute: the step's collectives would differ between them.
    assert first["own_policies"] != second["own_policies"]
    # One all-reduce agrees the job's device: the least memory and the slower kind, on both ranks.
    for result in results:
        assert len(result["calls"]) == 1 and result["calls"][0][0] == "all_reduce", result["calls"]
        assert result["job"].memory_gib == pytest.approx(60.0) and result["job"].gpu_kind == "a100"
    assert first["policies"] == second["policies"] == second["own_policies"]
    assert first["tables"] == second["tables"] and isinstance(first["tables"], bool)
