"""A dataset folder whose index lists many samples, and the peak memory of `h3train check` on it.

Shared by `scripts/index_bench.py` and the test that holds check's memory to a budget
(`tests/cli/test_check_index_memory.py`). Imports h3train alone, so the script can import it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from h3train.data.index_table import COMPACT_NAME
from h3train.data.location import INDEX_NAME
from h3train.data.synthetic_dataset import write_synthetic_dataset

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_fl2va.yaml"
REAL_SAMPLES = 4
MIB = 2**20

# Set in the environment of `check_run(planted=True)`: the check then holds every index entry as a Python
# object, as a regression that reads the index row by row would, so a test can see its budget exceeded.
PLANT = "H3TRAIN_TEST_PLANT_ROWS"
_PLANTED_CHECK = f"""
import os, sys
from h3train.data.index_table import IndexTable
if os.environ.get({PLANT!r}):
    held, rows_of = [], IndexTable.rows_of
    def planted(self, tasks):
        if not held:  # once: every dataset the check builds maps this one table
            held.append(list(self))
        return rows_of(self, tasks)
    IndexTable.rows_of = planted
from h3train.cli import run
sys.argv[0] = "h3train"
run()
"""


def write_folder(folder: Path, samples: int) -> Path:
    """A synthetic fl2va dataset whose `index.jsonl` lists `samples` entries, without its compact index.

    The first `REAL_SAMPLES` are real samples (text_dim 16, as `configs/tiny_fl2va.yaml`); the others repeat
    their lines under new ids and file names, each file an empty one: `check` without `--strict` lists the
    folder but reads no header, and a start opens only the first trained sample and the longest, both real.
    """
    write_synthetic_dataset(folder, task="fl2va", num_samples=REAL_SAMPLES, seed=0, text_dim=16)
    real = [json.loads(line) for line in (folder / INDEX_NAME).read_text().splitlines()]
    templates = [json.dumps({**row, "id": "@ID@", "file": "@ID@.safetensors"}) for row in real]
    with open(folder / INDEX_NAME, "w", encoding="utf-8") as handle:
        for row in real:
            handle.write(json.dumps(row) + "\n")
        for i in range(len(real), samples):
            sample_id = f"bench-{i:07d}"
            handle.write(templates[i % len(real)].replace("@ID@", sample_id) + "\n")
            os.close(os.open(folder / f"{sample_id}.safetensors", os.O_CREAT | os.O_WRONLY, 0o644))
    (folder / COMPACT_NAME).unlink(missing_ok=True)  # built from the four-line index
    return folder


# Runs the command of its arguments and prints that process's peak RSS (KiB). A child's `ru_maxrss` counts
# the memory of the process it was started from (Linux keeps the larger across `exec`): started from this
# small interpreter rather than from the caller (a test process that built a million-row index), the
# figure is the check's own.
_PEAK_OF = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def check_run(folder: Path, planted: bool = False) -> tuple[float, float]:
    """Wall seconds and peak RSS in MiB (`os.wait4`: that process alone) of `h3train check CONFIG
    data.source=cached data.path=folder`, in a fresh process; `planted`: with the regression `PLANT` names.
    Raises `RuntimeError` naming the folder when the check fails."""
    entry = ["-c", _PLANTED_CHECK] if planted else ["-m", "h3train"]
    command = [sys.executable, *entry, "check", str(CONFIG), "data.source=cached", f"data.path={folder}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RANK", None)
    env["WORLD_SIZE"] = "1"
    env.pop(PLANT, None)
    if planted:
        env[PLANT] = "1"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK_OF, *command], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"h3train check failed on '{folder}' (exit {done.returncode}): {done.stderr.strip()}")
    return seconds, int(done.stdout.split()[-1]) / 1024
