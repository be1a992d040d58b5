"""`python -m h3train.tools.nccl_bandwidth` on four gloo CPU ranks posing as two nodes of two."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from h3train.parallel.dims import free_port

from helpers.ranks import start_processes


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank % 2),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from h3train.tools.nccl_bandwidth import main

    main(["--backend", "gloo", "--sizes-mib", "1,2", "--iters", "2", "--warmup", "1", "--out", out])


@pytest.mark.slow
def test_bandwidth_of_every_collective_over_the_world_and_each_node() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bandwidth.json"
        start_processes(_rank_main, args=(4, free_port(), str(out)), nprocs=4)
        rows = json.loads(out.read_text())["rows"]
    kinds = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    expected = {(k, g, n, mib * 2**20) for k in kinds for g, n in (("world", 4), ("node", 2)) for mib in (1, 2)}
    assert {(r["collective"], r["group"], r["ranks"], r["bytes"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        n = r["ranks"]
        assert r["seconds"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        # nccl-tests' bus factors: (n-1)/n, and twice that for all-reduce.
        factor = 2 * (n - 1) / n if r["collective"] == "all_reduce" else (n - 1) / n
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factor)
