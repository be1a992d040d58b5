"""`make demo`: train the tiny H3 on 2 CPU ranks with sp=2, then plot loss and grad_norm.

Everything is built locally (tiny random model, synthetic samples); nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "demo_out"


def run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main() -> int:
    run_dir = OUT / "train_sp2"
    run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "h3train", "train", "configs/tiny_fl2va.yaml", "parallel.sp=2", "train.steps=40",
        f"logging.dir={run_dir}")
    run(sys.executable, "-m", "h3train", "plot", str(run_dir / "metrics.jsonl"), "--out", str(run_dir / "loss.png"))
    print(f"\nmetrics: {run_dir / 'metrics.jsonl'}\nplot:    {run_dir / 'loss.png'}\nconfig:  {run_dir / 'config.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
