"""Cost of checking a checkpoint's digests: seconds per GB for `h3train.infra.digest.digest_file`.

Writes a file of `--gb` random gigabytes, reads it once to warm the page cache, then times the digest
(median of `--repeats`). A checkpoint's verification reads each file once, split over the ranks, so
its wall time is about `size / ranks` times this figure, or the disk's rate where that is slower.

    python scripts/digest_report.py --gb 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from h3train.infra.digest import ALGORITHM, digest_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gb * 1024**3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.distcp"
        with open(path, "wb") as handle:
            left = size
            while left:
                chunk = os.urandom(min(left, 64 * 1024**2))
                handle.write(chunk)
                left -= len(chunk)
        digest_file(path)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            digest_file(path)
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    gb = size / 1024**3
    print(f"{ALGORITHM}: {seconds / gb:.3f} s/GB ({gb / seconds:.2f} GB/s) on one core, page cache warm")


if __name__ == "__main__":
    main()
