"""Samples per second read from object storage against the same shards in a local folder.

Writes a synthetic fl2va dataset (`--samples` samples at the tiny config's text width), shards it into a
local folder and into a bucket of moto's S3 server on this machine (`tests/helpers/s3.py`, over loopback),
then reads every sample (`CachedDataset`, checked as a run reads it) through the run's prefetcher
(`data/prefetch.py`) at each `--depths` depth, on 1 and 2 ranks (processes reading disjoint halves at
once), from each. Each line: source, ranks, depth, samples/s over all ranks, MB/s; the last line the ratio
of the bucket to the folder at the deepest prefetch.

    .venv/bin/python scripts/storage_bench.py [--samples 64] [--depths 1 2 4 8]

A timing, not a test: it varies with the machine and its load; moto keeps objects in memory and answers
from one process, so the ratio is an upper bound of the request overhead, not a cloud store's latency.
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
from h3train.data.format import open_index  # noqa: E402
from h3train.data.prefetch import Prefetcher  # noqa: E402
from h3train.data.shards import write_shards  # noqa: E402
from h3train.data.synth import write_synthetic_dataset  # noqa: E402

from helpers.s3 import S3Server, applied_environ  # noqa: E402


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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="h3train-storage-bench-") as tmp, S3Server() as server:
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
        env = {**server.env(), "H3TRAIN_CACHE": str(root / "cache")}
        for source, path in (("folder", str(root / "local")), ("s3", url)):
            for world in (1, 2):
                for depth in args.depths:
                    samples_s, mb_s = _rate(path, world, depth, env)
                    rates[source, world, depth] = samples_s
                    print(f"{source:8} {world:5d} {depth:5d} {samples_s:10.1f} {mb_s:8.1f}", flush=True)
        deepest = max(args.depths)
        ratios = [rates["s3", w, deepest] / rates["folder", w, deepest] for w in (1, 2)]
        print(f"s3 / folder at prefetch {deepest}: 1 rank {ratios[0]:.3f}, 2 ranks {ratios[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
