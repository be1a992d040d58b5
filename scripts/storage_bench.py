"""Samples per second read from object storage against the same shards in a local folder.

Writes a synthetic fl2va dataset (`--samples` samples at the tiny config's text width), shards it into a
local folder and into a bucket of moto's S3 server on this machine (`tests/helpers/s3.py`, over loopback),
then reads every sample (`CachedDataset`, checked as a run reads it) through the run's prefetcher
(`data/prefetch.py`) at each `--depths` depth, on 1 and 2 ranks (processes reading disjoint halves at
once), from each: the folder, the bucket (`s3`), and the bucket behind a proxy that holds each request
`--latency-ms` before forwarding it (`s3+lat`: a remote store's time to first byte, which moto on
loopback does not have). Each line: source, ranks, depth, samples/s over all ranks, MB/s; the last lines
the ratio of each bucket source to the folder at each source's best depth, and the deepest prefetch's
rate over depth 1's behind the latency.

    .venv/bin/python scripts/storage_bench.py [--samples 64] [--depths 1 2 4 8] [--latency-ms 20]

A timing, not a test: it varies with the machine and its load; moto keeps objects in memory and answers
from one process, so on loopback each read costs CPU time of the same cores the readers use, and a
deeper prefetch cannot hide it; behind the latency it can.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from h3train.data.dataset import CachedDataset  # noqa: E402
from h3train.data.dataset_index import open_index  # noqa: E402
from h3train.data.prefetch import Prefetcher  # noqa: E402
from h3train.data.shard_files import write_shards  # noqa: E402
from h3train.data.synthetic_dataset import write_synthetic_dataset  # noqa: E402

from helpers.s3 import FaultProxy, S3Server, applied_environ  # noqa: E402


def _read(path: str, rank: int, world: int, depth: int, out: multiprocessing.Queue) -> None:
    """Read this rank's share of the dataset at `path` through a prefetcher of `depth`; put (samples, bytes, s)."""
    dataset = CachedDataset(path, "fl2va")
    indices = list(range(rank, len(dataset), world))
    sizes = sum(dataset.entries[i].length for i in indices)
    start = time.perf_counter()
    with Prefetcher(lambda i: dataset[i], indices, depth=depth) as loaded:
        count = sum(1 for _ in loaded)
    out.put((count, sizes, time.perf_counter() - start))


def _rate(path: str, world: int, depth: int, env: dict[str, str]) -> tuple[float, float]:
    """(samples/s, MB/s) of `world` processes reading the dataset at `path` at once."""
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    with applied_environ(env):
        procs = [ctx.Process(target=_read, args=(path, r, world, depth, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    samples = sum(r[0] for r in results)
    data = sum(r[1] for r in results)
    wall = max(r[2] for r in results)
    return samples / wall, data / wall / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="h3train-storage-bench-") as tmp,
        S3Server() as server,
        FaultProxy(server, latency_s=args.latency_ms / 1e3) as slow,
    ):
        root = Path(tmp)
        os.environ["H3TRAIN_CACHE"] = str(root / "cache")
        folder = write_synthetic_dataset(root / "folder", task="fl2va", num_samples=args.samples, seed=1, text_dim=16)
        table = open_index(folder)
        total = sum((folder / table[i].file).stat().st_size for i in range(len(table)))
        shard = max(total // 8, 1)
        write_shards(folder, root / "local", shard)
        url = f"s3://{server.make_bucket()}/bench"
        with applied_environ(server.env()):
            write_shards(folder, url, shard)
        print(f"{args.samples} samples, {total / 1e6:.1f} MB, 8 shards; moto at {server.endpoint}")
        print(f"{'source':8} {'ranks':>5} {'depth':>5} {'samples/s':>10} {'MB/s':>8}")
        rates = {}
        cache = {"H3TRAIN_CACHE": str(root / "cache")}
        sources = (
            ("folder", str(root / "local"), {**server.env(), **cache}),
            ("s3", url, {**server.env(), **cache}),
            ("s3+lat", url, {**slow.env(), **cache}),
        )
        for source, path, env in sources:
            for world in (1, 2):
                for depth in args.depths:
                    samples_s, mb_s = _rate(path, world, depth, env)
                    rates[source, world, depth] = samples_s
                    print(f"{source:8} {world:5d} {depth:5d} {samples_s:10.1f} {mb_s:8.1f}", flush=True)
        best = {(src, w): max(rates[src, w, d] for d in args.depths) for src, _, _ in sources for w in (1, 2)}
        for source in ("s3", "s3+lat"):
            ratios = [best[source, w] / best["folder", w] for w in (1, 2)]
            print(f"{source} / folder, each at its best depth: 1 rank {ratios[0]:.3f}, 2 ranks {ratios[1]:.3f}")
        deepest, shallowest = max(args.depths), min(args.depths)
        gains = [rates["s3+lat", w, deepest] / rates["s3+lat", w, shallowest] for w in (1, 2)]
        print(
            f"s3+lat ({args.latency_ms:g} ms a request), prefetch {deepest} / prefetch {shallowest}: "
            f"1 rank {gains[0]:.2f}x, 2 ranks {gains[1]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
