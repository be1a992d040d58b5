"""What a fresh Python process of h3train costs before it does any work: seconds of wall time and CPU.

Every rank that `torchrun` or `launch.sh` starts, and every `python -m h3train` a test or a user runs, is
a fresh interpreter that imports torch and the diffusers model class anew; a rank forked from a process
that has imported them (the suite's fork server, `tests/helpers/ranks.py`) does not. This prints, for
each of these starts, the run of least CPU of `--repeats` (wall time, and user + system CPU of the
process and what it waited for, `getrusage`):

- torch: `python -c "import torch"`;
- model class: `python -c "from diffusers import MiniMaxH3Transformer3DModel"` (torch, diffusers and what
  diffusers imports: transformers, peft, torchao);
- check: `python -m h3train check configs/tiny_fl2va.yaml`, a whole start-up and its plan, no step;
- torchrun 2: `torchrun --standalone --nproc_per_node=2 -m h3train check configs/tiny_fl2va.yaml`
  (the launcher and two ranks; CPU summed over the three).

The last line sums it up: `start cost: model class X s CPU (torch alone Y s); a 2-rank torchrun launch
Z s CPU before its first step`.

    .venv/bin/python scripts/start_cost.py [--repeats 3] [--only torch,check]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_fl2va.yaml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

STARTS: dict[str, list[str]] = {
    "torch": [sys.executable, "-c", "import torch"],
    "model class": [sys.executable, "-c", "from diffusers import MiniMaxH3Transformer3DModel"],
    "check": [sys.executable, "-m", "h3train", "check", TINY],
    "torchrun 2": [*TORCHRUN, "-m", "h3train", "check", TINY],
}


def measure(command: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, the process and the children it waited for) of
    one run of `command`; raises if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each start; the fastest is kept")
    parser.add_argument("--only", default=",".join(STARTS), help=f"a comma-separated subset of: {', '.join(STARTS)}")
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in STARTS]
    if unknown or args.repeats < 1:
        parser.error(f"--only takes names from {', '.join(STARTS)}; --repeats at least 1")
    results = {}
    for name in names:
        runs = [measure(STARTS[name]) for _ in range(args.repeats)]
        wall, cpu = min(runs, key=lambda run: run[1])
        results[name] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
        print(f"{name:12s} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    print(json.dumps(results))
    if {"torch", "model class", "torchrun 2"} <= results.keys():
        print(
            f"start cost: model class {results['model class']['cpu_s']:.1f} s CPU (torch alone "
            f"{results['torch']['cpu_s']:.1f} s); a 2-rank torchrun launch {results['torchrun 2']['cpu_s']:.1f} s "
            "CPU before its first step"
        )


if __name__ == "__main__":
    main()
