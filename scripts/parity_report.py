"""Print how far sharded runs are from the unsharded diffusers reference.

For each layout: run one step of `h3train train` with a debug dump, recompute it with plain
`MiniMaxH3Transformer3DModel.forward`, and print the loss ratio, the grad_norm ratio and the worst
per-parameter relative L2 gradient error. Usage: `python scripts/parity_report.py [--out DIR] [--only NAME ...]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# The launch-and-compare helpers are the tests' own (`tests/helpers`), imported as `helpers.*` as
# the tests import them (`pythonpath` of pytest in pyproject.toml).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.paths import ROOT, TINY_FL2VA  # noqa: E402
from helpers.reference import parity_step  # noqa: E402

TINY_REF2VA = ROOT / "configs" / "tiny_ref2va.yaml"
LAYOUTS = [
    ("fl2va sp=2 (51 rows, odd)", TINY_FL2VA, 2, ["parallel.sp=2"], 1),
    ("fl2va sp=4 (heads == sp)", TINY_FL2VA, 4, ["parallel.sp=4"], 1),
    ("fl2va sp=2 cfg s=3 k=0.5", TINY_FL2VA, 2, ["parallel.sp=2", "cfg.scale=3", "cfg.curvature_power=0.5"], 1),
    ("fl2va hsdp 2x(sp=2)", TINY_FL2VA, 4, ["parallel.dp_replicate=2", "parallel.sp=2"], 2),
    ("ref2va sp=4", TINY_REF2VA, 4, ["parallel.sp=4"], 1),
    ("ref2va sp=2 cfg sigma", TINY_REF2VA, 2, ["parallel.sp=2", "cfg.scale=2.5", "cfg.schedule=sigma"], 1),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--only", nargs="+", default=None, help="substrings of the layout names to run (default: all)")
    args = parser.parse_args()
    chosen = [
        (i, layout) for i, layout in enumerate(LAYOUTS) if args.only is None or any(s in layout[0] for s in args.only)
    ]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)}: no layout matches; the layouts: {[n for n, *_ in LAYOUTS]}")
    root = Path(args.out or tempfile.mkdtemp(prefix="h3train-parity-"))
    print(f"{'layout':32} {'loss ratio':>12} {'grad_norm ratio':>16} {'worst rel L2':>13}  parameter")
    for i, (name, config, nproc, extra, dp) in chosen:
        result = parity_step(config, extra, root / f"case{i}", nproc, dp)
        worst, param = result.worst()
        print(
            f"{name:32} {result.loss / result.ref_loss:12.9f} {result.grad_norm / result.ref_norm:16.9f} "
            f"{worst:13.3e}  {param}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
