"""Time and size a dataset's index at a million samples: `index.jsonl` parsed against the compact index.

Writes a synthetic fl2va dataset of a few real samples (`write_synthetic_dataset`, text_dim 16 as in
`configs/tiny_fl2va.yaml`), then replaces its `index.jsonl` by one of `--samples` lines: the real lines
first, then the same lines again under new ids and file names, each file an empty one
(`tests/helpers/index_memory.py`: a check lists the folder without reading a header, a start opens only
the header of the first trained sample and of the longest, both real). Each figure comes
from a fresh Python process, measured from after its imports, as seconds and growth of its resident
set (VmRSS) in MiB:

- jsonl parse: `read_index`, every line parsed and checked into an `IndexEntry`;
- compact build: `open_index` with no compact index beside `index.jsonl` yet (parse, check, write);
- compact open: `CachedDataset(folder, "fl2va")` over the built one, what a start does (map, hash
  `index.jsonl`, task mask, lengths);
- check: `h3train check configs/tiny_fl2va.yaml data.source=cached data.path=FOLDER`, its wall time
  and peak RSS (`os.wait4`), on the big folder and on one of 10 samples written the same way (the
  fastest of `--repeats` runs each, both over a compact index already built).

The last line sums it up: `index 1M: jsonl parse X s Y MiB; compact build X s, open X s Y MiB; check
1M vs 10: +X s +Y MiB`.

    .venv/bin/python scripts/index_bench.py [--samples 1000000] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from h3train.data.dataset import CachedDataset  # noqa: E402
from h3train.data.dataset_index import open_index, read_index  # noqa: E402
from h3train.data.index_table import COMPACT_NAME  # noqa: E402
from h3train.data.location import INDEX_NAME  # noqa: E402

from helpers.index_memory import MIB, check_run, write_folder  # noqa: E402

SMALL = 10


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(kind: str, folder: Path) -> dict[str, float]:
    """Run one measurement in this process (a fresh one): seconds and VmRSS growth of `kind` on `folder`."""
    operations = {
        "jsonl": lambda: read_index(folder),
        "build": lambda: open_index(folder),
        "open": lambda: CachedDataset(folder, "fl2va"),
    }
    if kind == "build":
        (folder / COMPACT_NAME).unlink(missing_ok=True)
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    kept = operations[kind]()  # held, so what it keeps resident is counted
    seconds = time.perf_counter() - start
    after = _status_kib("VmRSS")
    del kept
    return {"seconds": seconds, "rss_mib": (after - before) / 1024}


def _in_fresh_process(kind: str, folder: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", kind, str(folder)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000, help="lines of the big index.jsonl")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each h3train check (the fastest counts)")
    parser.add_argument("--keep", type=Path, default=None, help="write the folders here and keep them")
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure[0], Path(args.measure[1]))))
        return 0

    with tempfile.TemporaryDirectory(prefix="index_bench_") as scratch:
        root = args.keep or Path(scratch)
        start = time.perf_counter()
        big = write_folder(root / "big", args.samples)
        small = write_folder(root / "small", SMALL)
        size = (big / INDEX_NAME).stat().st_size / MIB
        print(f"wrote {args.samples:,} index lines ({size:.0f} MiB) in {time.perf_counter() - start:.1f} s", flush=True)
        jsonl = _in_fresh_process("jsonl", big)
        print(f"index.jsonl parse (read_index): {jsonl['seconds']:.2f} s, +{jsonl['rss_mib']:.0f} MiB", flush=True)
        build = _in_fresh_process("build", big)
        compact = (big / COMPACT_NAME).stat().st_size / MIB
        print(
            f"compact index first build (open_index): {build['seconds']:.2f} s, +{build['rss_mib']:.0f} MiB, "
            f"{compact:.0f} MiB file",
            flush=True,
        )
        opened = _in_fresh_process("open", big)
        print(f"compact index warm open (CachedDataset): {opened['seconds']:.2f} s, +{opened['rss_mib']:.0f} MiB")
        open_index(small)  # both checks start warm
        # The fastest of a few runs each, taken in turns: a check is seconds of imports, which other work on
        # the machine stretches.
        runs = [(check_run(small), check_run(big)) for _ in range(args.repeats)]
        small_s, small_mib = min(pair[0] for pair in runs)
        big_s, big_mib = min(pair[1] for pair in runs)
        print(f"h3train check, {SMALL} samples: {small_s:.2f} s, peak {small_mib:.0f} MiB", flush=True)
        print(f"h3train check, {args.samples:,} samples: {big_s:.2f} s, peak {big_mib:.0f} MiB", flush=True)
        n = _count(args.samples)
        print(
            f"index {n}: jsonl parse {jsonl['seconds']:.1f} s {jsonl['rss_mib']:.0f} MiB; "
            f"compact build {build['seconds']:.1f} s, open {opened['seconds']:.2f} s {opened['rss_mib']:.0f} MiB; "
            f"check {n} vs {SMALL}: {big_s - small_s:+.2f} s {big_mib - small_mib:+.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
