#!/usr/bin/env python
"""Check that the test suite catches each convention mutation in `MUTATIONS`.

For every mutation: copy `h3train/` into a temporary folder, patch one piece of its source text,
and run the tests that guard it with that copy first on `PYTHONPATH`. The package is installed
editable from this checkout, and `python -c` / `-m` put the working directory first on `sys.path`
(the launched runs of the slow tests start `python -m h3train` from the checkout), so the tests run
with `PYTHONSAFEPATH=1`: no process of the run puts its working directory ahead of the copy. A
subprocess started from the checkout prints `h3train.__file__`, and so does the pytest process,
and the script stops unless both are the mutated copy. The unmutated copy must pass the same tests
first. A mutation is caught when at least one test fails. Exit status 1 if any mutation survives.

    .venv/bin/python scripts/check_mutations.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "h3train"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # inside h3train/
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    slow: bool = False  # also run the `slow` tests among them (multi-process launches)


CONVENTIONS = "tests/runs/test_conventions.py"
LAYOUTS = "tests/unit/test_layouts_match_diffusers.py"
CFG = "tests/unit/test_cfg_objective.py"
ENCODE_ROWS = "tests/cli/test_encode.py::test_audio_rows_are_the_pipelines"
# Two SP ranks under torchrun against the unsharded reference, text dropout on (slow).
SP_DROPOUT = "tests/runs/test_conventions.py::test_text_dropout_agrees_across_sp_ranks_in_training"
TIMES = "t_video = 1.0 - shift_sigma(sigma, tcfg.video_shift)\n    t_audio = 1.0 - shift_sigma(sigma, tcfg.audio_shift)"

MUTATIONS = (
    Mutation(
        "time direction flipped (t = sigma instead of 1 - sigma)",
        "objective.py",
        TIMES,
        TIMES.replace("1.0 - ", ""),
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "time direction flipped in the noising (x_t = (1 - t) x0 + t noise)",
        "objective.py",
        "return _FORWARD_PROCESS.scale_noise(x0, t_rows, noise)",
        "return _FORWARD_PROCESS.scale_noise(noise, t_rows, x0)",
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "velocity sign flipped (v = noise - x0)",
        "objective.py",
        "    return x0 - noise\n",
        "    return noise - x0\n",
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "anchors not noised (conditioning rows at t = 1.0 in the noising)",
        "objective.py",
        "t_rows_video[:ncv] = CONDITION_VIDEO_T",
        "t_rows_video[:ncv] = 1.0",
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "anchor level 0.999 -> 1.0 (rows and timesteps)",
        "tasks/layout.py",
        'CONDITION_VIDEO_T: float = _pipeline_constant("keyframe_noise_aug")',
        "CONDITION_VIDEO_T: float = 1.0",
        (CONVENTIONS, LAYOUTS, CFG),
    ),
    Mutation(
        "video/audio shifts swapped (objective)",
        "objective.py",
        TIMES,
        TIMES.replace("video_shift", "SHIFT").replace("audio_shift", "video_shift").replace("SHIFT", "audio_shift"),
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "video/audio shifts swapped (config defaults)",
        "config/schema.py",
        "    video_shift: float = 12.0\n    audio_shift: float = 3.0\n",
        "    video_shift: float = 3.0\n    audio_shift: float = 12.0\n",
        (CONVENTIONS, CFG),
    ),
    Mutation(
        "audio rows packed frame-major (dataset / synthetic rows)",
        "tasks/layout.py",
        "return latents.permute(0, 2, 1).reshape(-1, latents.shape[1])",
        "return latents.permute(2, 0, 1).reshape(-1, latents.shape[1])",
        (CONVENTIONS, LAYOUTS, CFG),
    ),
    Mutation(
        "audio rows unpacked frame-major (encoder)",
        "encode/clip.py",
        "return rows.reshape(channels, -1, rows.shape[-1]).transpose(1, 2).contiguous()",
        "return rows.reshape(-1, channels, rows.shape[-1]).permute(1, 2, 0).contiguous()",
        (ENCODE_ROWS,),
    ),
    Mutation(
        "text dropout keyed by the process rank",
        "objective.py",
        'key = zlib.crc32(f"{seed}:{step}:{sample_id}".encode())',
        "key = zlib.crc32(f\"{seed}:{step}:{sample_id}:{__import__('os').environ.get('RANK', '0')}\".encode())",
        (CONVENTIONS, CFG, SP_DROPOUT),
        slow=True,
    ),
    Mutation(
        "text dropout seeded from the distributed rank",
        "objective.py",
        "    if p <= 0.0:\n        return False\n",
        "    if p <= 0.0:\n        return False\n"
        "    if torch.distributed.is_initialized():\n        seed += torch.distributed.get_rank()\n",
        (CONVENTIONS, CFG, SP_DROPOUT),
        slow=True,
    ),
)

# Printed by the subprocess before the tests run: proof of which copy of the package it imported.
PROBE = "import h3train, sys; sys.stdout.write('h3train imported from ' + h3train.__file__ + '\\n')"


def _environment(copy_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy_root), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONSAFEPATH"] = "1"
    return env


def _failed_tests(output: str, cwd: Path) -> list[str]:
    """Failing tests by function, `tests/x.py::test_y (n cases)`, paths relative to the checkout."""
    counts: dict[str, int] = {}
    for node in re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE):
        path, _, name = node.partition("::")
        test = f"{os.path.relpath(os.path.normpath(cwd / path), ROOT)}::{name.split('[')[0]}"
        counts[test] = counts.get(test, 0) + 1
    return [f"{test} ({n} case{'s' if n > 1 else ''})" for test, n in sorted(counts.items())]


def run_mutation(mutation: Mutation, copy_root: Path) -> tuple[bool, list[str], str]:
    """Apply `mutation` to a fresh copy under `copy_root`; return (caught, failing tests, imported package).

    `mutation.old == mutation.new` runs the copy unchanged (the baseline).
    """
    target = copy_root / "h3train"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    if mutation.old != mutation.new:
        source = (target / mutation.file).read_text()
        if source.count(mutation.old) != 1:
            raise SystemExit(
                f"mutation '{mutation.name}': the text to patch is not found once in h3train/{mutation.file}"
            )
        (target / mutation.file).write_text(source.replace(mutation.old, mutation.new))

    env = _environment(copy_root)
    # From the checkout, where the editable install and the working directory would both win.
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    imported = probe.stdout.strip().removeprefix("h3train imported from ")
    if Path(imported).resolve().parent != target.resolve():
        raise SystemExit(f"mutation '{mutation.name}': the subprocess imported {imported}, not the mutated copy")
    # The same probe inside the process that runs the tests.
    cmd = [sys.executable, "-c", f"{PROBE}; import pytest; sys.exit(pytest.main(sys.argv[1:]))"]
    cmd += ["-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml")]
    cmd += [] if mutation.slow else ["-m", "not slow"]
    cmd += [str(ROOT / test) for test in mutation.tests]
    proc = subprocess.run(cmd, cwd=copy_root, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    first = output.splitlines()[0] if output else ""
    if not first.startswith("h3train imported from ") or Path(first.split()[-1]).resolve().parent != target.resolve():
        raise SystemExit(f"mutation '{mutation.name}': pytest did not import the mutated copy ({first})")
    failed = _failed_tests(output, copy_root)
    if proc.returncode not in (0, 1):
        failed = failed or [f"pytest exit {proc.returncode}: {output.strip().splitlines()[-1]}"]
    return proc.returncode != 0, failed, imported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="substrings of mutation names to run")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name}: h3train/{m.file} -> {' '.join(m.tests)}")
        return 0
    survivors = []
    with tempfile.TemporaryDirectory(prefix="h3train-mutations-") as tmp:
        # The unmutated copy must pass the same tests, or a "caught" mutation proves nothing.
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        baseline = Mutation("baseline (no mutation)", "", "", "", tests, slow=any(m.slow for m in chosen))
        failing, failed, imported = run_mutation(baseline, Path(tmp) / "baseline")
        print(f"{'FAILING' if failing else 'PASSING'} {baseline.name}: {len(tests)} test targets, imported {imported}")
        for test in failed:
            print(f"    failed: {test}")
        if failing:
            print("the unmutated package fails these tests; fix that first")
            return 2
        for number, mutation in enumerate(chosen):
            caught, failed, imported = run_mutation(mutation, Path(tmp) / f"mutation{number}")
            print(f"{'CAUGHT ' if caught else 'SURVIVED'} {mutation.name}  [h3train/{mutation.file}]")
            print(f"    imported {imported}")
            for test in failed:
                print(f"    failed: {test}")
            if not caught:
                survivors.append(mutation.name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutations caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
