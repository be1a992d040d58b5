"""How evenly the DP ranks work, unpacked against packed and balanced, and what packing gains in rows/s.

1. **Imbalance of the cost model** (`data/step_composition.py`): a fixed-seed dataset whose packed lengths
   spread 1x to 8x (5,000 to 40,000 rows, the released model's range of clips), planned for `--steps`
   steps at `--dp` ranks and `--grad-accum` micro-batches per rank, once one sample per micro-batch in
   the sampler's order and once with `data.pack` (the longest sample's rows per micro-batch) and
   `data.balance`. Each step's imbalance is `max / mean - 1` of the ranks' costs; the report prints
   the mean over the steps (and the worst step).
2. **Rows trained per second** on the tiny model at dp = 2 (two CPU ranks over gloo): `h3train train`
   of a mixed-length synthetic dataset (`h3train synth --task mixed`), batch 1 against packed and
   balanced, from each run's `metrics.jsonl` (rows of every step over the steps' time, the first
   step left out as warm-up).

The last line reads `imbalance unpacked X %, packed + balanced Y %; rows/s packed / batch 1 Z`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from ..data.step_composition import StepComposer, attention_rows, mean_imbalance
from ..model.architecture import model_defaults

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_ref2va.yaml"


def _rows_per_second(folder: Path, extra: list[str], steps: int) -> float:
    """Rows trained per second of a 2-rank `h3train train` of the tiny model in `folder`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "h3train",
        "train",
        str(TINY),
        f"logging.dir={folder / 'run'}",
        "logging.progress=false",
        f"data.path={folder.parent / 'data'}",
        "data.create_synthetic=false",
        "task.name=mixed",
        f"train.steps={steps}",
        "train.grad_accum=2",
        "checkpoint.every=0",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, env=env, cwd=folder, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"h3train train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r.get("kind") != "validation"][1:]
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=4, help="DP ranks of the cost-model plans")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per rank and step")
    parser.add_argument("--steps", type=int, default=200, help="steps planned")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=12, help="steps of each tiny 2-rank run (0: skip)")
    parser.add_argument("--pack", type=int, default=600, help="data.pack of the tiny packed run, in rows")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    lengths = [int(5_000 * rng.uniform(1.0, 8.0)) for _ in range(10_000)]
    s0 = attention_rows(model_defaults())
    budget = max(lengths)
    rows_at = lambda p: lengths[p % len(lengths)]  # noqa: E731
    unpacked = mean_imbalance(StepComposer(args.dp, args.grad_accum, s0=s0), rows_at, args.steps)
    packed = mean_imbalance(StepComposer(args.dp, args.grad_accum, budget, True, s0), rows_at, args.steps)
    print(f"cost model: rows + rows^2 / {s0:,.0f} (the released architecture); lengths 5,000 to 40,000 rows")
    print(f"{args.dp} ranks x {args.grad_accum} micro-batches, {args.steps} steps:")
    print(
        f"  one sample per micro-batch     imbalance mean {100 * unpacked[0]:5.1f} %, worst {100 * unpacked[1]:5.1f} %"
    )
    print(f"  data.pack={budget:,} + balance  imbalance mean {100 * packed[0]:5.1f} %, worst {100 * packed[1]:5.1f} %")
    ratio = float("nan")
    if args.train_steps:
        from ..data.synthetic_dataset import write_synthetic_dataset

        with tempfile.TemporaryDirectory(prefix="h3train-balance-") as tmp:
            write_synthetic_dataset(Path(tmp) / "data", task="mixed", num_samples=64, text_dim=16)
            speeds = {}
            for name, extra in (
                ("batch 1", []),
                ("packed + balanced", [f"data.pack={args.pack}", "data.pack_oversize=alone", "data.balance=true"]),
            ):
                (Path(tmp) / name.replace(" ", "_")).mkdir()
                speeds[name] = _rows_per_second(Path(tmp) / name.replace(" ", "_"), extra, args.train_steps)
                print(f"tiny model, dp 2, {name}: {speeds[name]:,.0f} rows/s")
            ratio = speeds["packed + balanced"] / speeds["batch 1"]
    print(
        f"imbalance unpacked {100 * unpacked[0]:.1f} %, packed + balanced {100 * packed[0]:.1f} %; "
        f"rows/s packed / batch 1 {ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
