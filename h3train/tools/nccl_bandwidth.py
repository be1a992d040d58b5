"""Bus bandwidth of the collectives a training step issues, over the job's ranks and within a node.

    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m h3train.tools.nccl_bandwidth [--sizes-mib 16,256] [--iters 10] [--out PATH]

FSDP2 all-gathers parameters and reduce-scatters gradients over the shard group, Ulysses
all-to-alls over the SP group (inside a node when sp divides the GPUs per node), and the step
all-reduces a few scalars. Each is timed here on bfloat16 buffers of each size, over every rank
(`world`) and over this node's ranks (`node`, `LOCAL_WORLD_SIZE` of them), after `--warmup`
untimed calls, as the slowest rank's mean of `--iters` calls.

Figures follow nccl-tests: `size` is the bytes of the full buffer (the gathered output, the
scattered input, the reduced or exchanged tensor), algorithm bandwidth `algbw = size / time`, and
bus bandwidth `busbw = algbw * (n - 1) / n` for all-gather, reduce-scatter and all-to-all and
`algbw * 2 (n - 1) / n` for all-reduce, n the group's ranks: what each link carries, to compare
with the fabric's rating (NVLink within a node, InfiniBand between nodes). Rank 0 prints one line
per collective, group and size, and writes them all to `--out` as JSON. Over gloo on CPU ranks it
runs the same way (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.dims import init_distributed, new_group

# Bus bandwidth over algorithm bandwidth, for a group of n ranks (nccl-tests' PERFORMANCE.md).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}


def _collective(kind: str, numel: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """One call of `kind` on a full buffer of `numel` bfloat16 values (rounded to the group size)."""
    n = dist.get_world_size(group)
    full = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    part = torch.zeros(numel // n, dtype=torch.bfloat16, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    if kind == "reduce_scatter":
        # The call FSDP2 makes: `reduce_scatter_single` where torch has it (its older name warns there).
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: reduce_scatter(part, full, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    return lambda: dist.all_reduce(full, group=group)


def _seconds(
    call: Callable[[], None], group: dist.ProcessGroup, device: torch.device, warmup: int, iters: int
) -> float:
    """The slowest rank's mean seconds per call."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def measure(sizes_mib: list[float], warmup: int, iters: int, device: torch.device) -> list[dict[str, Any]]:
    """Every collective, group and size: rows of `{collective, group, ranks, bytes, seconds, algbw_gbs, busbw_gbs}`.

    Every rank creates the node groups of every node (one group creation per node, in node order),
    as `new_group` requires; bandwidths are in GB/s (1e9 bytes).
    """
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"world size {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
    groups: dict[str, dist.ProcessGroup] = {"world": dist.group.WORLD}
    if 1 < local < world:
        nodes = [new_group(ranks=list(range(start, start + local))) for start in range(0, world, local)]
        groups["node"] = nodes[dist.get_rank() // local]
    rows = []
    for name, group in groups.items():
        n = dist.get_world_size(group)
        for mib in sizes_mib:
            numel = max(n, int(mib * 2**20) // 2 // n * n)
            for kind, factor in BUS_FACTOR.items():
                seconds = _seconds(_collective(kind, numel, group, device), group, device, warmup, iters)
                size = numel * 2
                algbw = size / seconds / 1e9
                rows.append(
                    {
                        "collective": kind,
                        "group": name,
                        "ranks": n,
                        "bytes": size,
                        "seconds": seconds,
                        "algbw_gbs": algbw,
                        "busbw_gbs": algbw * factor(n),
                    }
                )
    return rows


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['collective']:<15} {row['group']:<6} {row['ranks']:>4} ranks {row['bytes'] / 2**20:>9.1f} MiB "
        f"{row['seconds'] * 1e3:>10.3f} ms  algbw {row['algbw_gbs']:>8.2f} GB/s  busbw {row['busbw_gbs']:>8.2f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3train.tools.nccl_bandwidth", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,256", help="comma list of buffer sizes in MiB (default 16,256)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per collective and size (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--backend", default="auto", help="nccl, gloo or auto (nccl with CUDA) (default auto)")
    parser.add_argument("--timeout-s", type=int, default=600, help="collective timeout in seconds (default 600)")
    parser.add_argument("--out", default=None, help="write every row to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0 or args.iters < 1 or args.warmup < 0:
        parser.error("--sizes-mib needs positive sizes, --iters at least 1, --warmup at least 0")
    _, device = init_distributed(args.backend, args.timeout_s)
    try:
        rows = measure(sizes, args.warmup, args.iters, device)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        for row in rows:
            print(format_row(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"device": str(device), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
