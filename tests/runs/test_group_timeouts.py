"""Every process group the trainer creates carries `parallel.timeout_s`, the mesh's subgroups included.

`init_device_mesh` and `DeviceMesh._flatten` create their groups with the backend's default timeout
(10 min on NCCL, 30 on gloo), whatever the default group was given; a hung SP all-to-all would then
wait that long instead of the configured time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from h3train.parallel.dims import free_port

from helpers.ranks import start_processes

# Neither backend's default (600 s on NCCL, 1800 s on gloo), so a group that kept one is seen.
TIMEOUT_S = 123


def _backend_timeouts(group) -> list[float]:
    """The timeout in seconds that each backend of `group` holds (one per device type)."""
    return [group._get_backend(device).options._timeout.total_seconds() for device in group._device_types]


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from h3train.checkpoint.writer import Checkpointer
    from h3train.parallel.dims import ParallelContext, ParallelDims, init_distributed

    init_distributed("gloo", TIMEOUT_S)
    try:
        ctx = ParallelContext(ParallelDims(dp_replicate=1, dp_shard=2, sp=2, world_size=world), torch.device("cpu"))
        writer = Checkpointer(Path(out_dir) / "checkpoints", keep_last=1, is_main=rank == 0, async_save=True)
        groups = {
            "world": dist.group.WORLD,
            "sp": ctx.mesh["sp"].get_group(),
            "dp_shard": ctx.mesh["dp_shard"].get_group(),
            "dp_replicate": ctx.mesh["dp_replicate"].get_group(),
            "dp_shard_sp": ctx.fsdp_mesh.get_group(),  # the flattened shard axis (no HSDP here)
            "dp": ctx.dp_mesh.get_group(),
            "background save": writer._group,
        }
        sizes = {name: dist.get_world_size(group) for name, group in groups.items()}
        timeouts = {name: _backend_timeouts(group) for name, group in groups.items()}
        torch.save({"sizes": sizes, "timeouts": timeouts}, Path(out_dir) / f"rank{rank}.pt")
        writer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_group_of_a_dp2_sp2_mesh_has_the_configured_timeout() -> None:
    world = 4
    with tempfile.TemporaryDirectory() as out_dir:
        start_processes(_rank_main, args=(world, free_port(), out_dir), nprocs=world)
        results = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
    expected_sizes = {"world": 4, "sp": 2, "dp_shard": 2, "dp_replicate": 1, "dp_shard_sp": 4, "dp": 2}
    for rank, result in enumerate(results):
        assert {k: v for k, v in result["sizes"].items() if k in expected_sizes} == expected_sizes, rank
        assert result["sizes"]["background save"] == world
        wrong = {
            name: timeouts
            for name, timeouts in result["timeouts"].items()
            if not timeouts or any(t != TIMEOUT_S for t in timeouts)
        }
        assert not wrong, f"rank {rank}: groups without parallel.timeout_s={TIMEOUT_S}: {wrong}"
