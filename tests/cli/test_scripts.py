"""Every file of `scripts/` runs: each on its smallest real case, or with `--help` where the smallest real
case is heavy (minutes on two CPU cores, or a GPU or a Slurm cluster), and what it prints is checked.

`CASES` holds one entry per script, found by listing the folder: a new script without an entry, or
an entry whose script is gone, fails here. A shell script is parsed (`bash -n`) before it runs.

A shell script, and a Python one that launches ranks, runs as a user starts it, in a session of its
own. A Python script that launches none runs as `python SCRIPT` runs it, in a process forked from a
server that has imported torch, diffusers and h3train (`helpers.ranks.fork_script`): those imports,
most of what a `--help` costs, are made once per test process.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.launch import run_env, run_process_group
from helpers.paths import ROOT
from helpers.ranks import fork_script

SCRIPTS = ROOT / "scripts"
SHELL = (".sh", ".sbatch")
SUFFIXES = (".py", *SHELL)
# The layout the parity report runs here: two ranks, sp=2, its odd row count split unevenly.
PARITY_LAYOUT = "fl2va sp=2 (51 rows, odd)"


@dataclass(frozen=True)
class Case:
    """A script's arguments (`{tmp}` stands for the test's folder), its exit status, and a check of its
    output: `check(stdout, stderr, tmp)` raises when the output is wrong."""

    argv: tuple[str, ...]
    check: Callable[[str, str, Path], None]
    returncode: int = 0
    slow: bool = False  # it launches ranks
    timeout: float = 300


def _help_of(*options: str) -> Callable[[str, str, Path], None]:
    """The check of an argparse `--help`: its usage line and each of `options`."""

    def check(out: str, err: str, tmp: Path) -> None:
        assert out.startswith("usage: "), out[:2000]
        for option in options:
            assert option in out, f"{option} missing from\n{out}"

    return check


def _balance(out: str, err: str, tmp: Path) -> None:
    assert out.startswith("cost model: rows + rows^2 / "), out
    assert re.search(r"^  one sample per micro-batch +imbalance mean +[\d.]+ %, worst +[\d.]+ %$", out, re.M), out
    last = re.fullmatch(
        r"imbalance unpacked ([\d.]+) %, packed \+ balanced ([\d.]+) %; rows/s packed / batch 1 nan",
        out.strip().splitlines()[-1],
    )
    assert last, out
    unpacked, packed = map(float, last.groups())
    assert 0 < packed < unpacked, out


def _bench_lora(out: str, err: str, tmp: Path) -> None:
    lines = out.splitlines()
    model = next(i for i, line in enumerate(lines) if line.startswith("model: h3train bench --reduced ("))
    assert lines[model + 1].split() == ["full", "LoRA", "r=4", "LoRA", "/", "full"], out
    rows = {}
    for line in lines[model + 2 : model + 6]:
        label, full, lora, ratio = re.fullmatch(r"(.{28}) *(\S+) +(\S+) +(\S+)", line).groups()
        rows[label.strip()] = float(full.replace(",", "")), float(lora.replace(",", "")), float(ratio)
    assert list(rows) == [
        "trainable parameters",
        "optimizer state bytes",
        "step time, wall (ms)",
        "step time, CPU (ms)",
    ]
    # LoRA trains a small part of the model, so its AdamW state is that much smaller.
    for label in ("trainable parameters", "optimizer state bytes"):
        full, lora, ratio = rows[label]
        assert 0 < lora < full / 10 and ratio == pytest.approx(lora / full, abs=1e-4), (label, out)
    assert out.strip().splitlines()[-1] == "(step times: medians of 1 alternating steps after a warm-up)", out


def _bench_optim(out: str, err: str, tmp: Path) -> None:
    from h3train.tools.bench_optim import KINDS, TRAINABLE_BASES

    assert re.search(r"^model: h3train bench --reduced at width 16 \(1 heads x 16, ffn 32\), 1 blocks, ", out, re.M), (
        out
    )
    number = r" +([\d.,]+)"
    # kind; state B/param measured, exact, plan; weights+grad B/param; opt step, train step: ms, x adamw; loss
    kinds = {m[1]: m.groups()[1:] for m in re.finditer(rf"^(\w+){number * 9}$", out, re.M)}
    assert list(kinds) == list(KINDS), out
    measured, exact, plan, weights, _, opt_ratio, _, step_ratio, _ = map(float, kinds["adamw"])
    assert (exact, plan, weights, opt_ratio, step_ratio) == (8.0, 8.0, 8.0, 1.0, 1.0), out
    assert 8.0 <= measured < 8.1, out  # two float32 moments, and the step counters
    assert all(math.isfinite(float(row[-1])) for row in kinds.values()), out
    # base, base bytes, x bf16, opt step ms, train step ms, x bf16, loss
    bases = {m[1]: m.groups()[1:] for m in re.finditer(rf"^(\w+){number * 6}$", out, re.M)}
    assert list(bases) == list(TRAINABLE_BASES) and float(bases["none"][1]) == 1.0, out
    assert "released model" not in out, out  # --no-plan


def _check_mutations(out: str, err: str, tmp: Path) -> None:
    lines = out.strip().splitlines()
    assert lines, err
    for line in lines:
        name, files, tests = re.fullmatch(r"(.+): (\S+(?: \S+)*) -> (\S+(?: \S+)*)", line).groups()
        for path in files.split():
            assert (ROOT / path).is_file(), f"{name}: no {path}"
        for test in tests.split():
            assert (ROOT / test.split("::")[0]).is_file(), f"{name}: no {test}"


def _demo(out: str, err: str, tmp: Path) -> None:
    assert out.startswith("usage: demo.py [-h]"), out
    assert "`make demo`: the whole path on CPU" in out, out


def _digest(out: str, err: str, tmp: Path) -> None:
    found = re.fullmatch(r"(\w+): ([\d.]+) s/GB \(([\d.]+) GB/s\) on one core, page cache warm", out.strip())
    assert found, out
    seconds, rate = float(found[2]), float(found[3])
    assert seconds > 0 and rate == pytest.approx(1 / seconds, rel=0.05), out


def _start_cost(out: str, err: str, tmp: Path) -> None:
    costs = json.loads(out.strip().splitlines()[-1])
    assert list(costs) == ["torch"], out
    assert costs["torch"]["cpu_s"] > 0 and costs["torch"]["wall_s"] > 0, out


def _storage_bench(out: str, err: str, tmp: Path) -> None:
    rows = re.findall(r"^(folder|s3|s3\+lat)\s+([12])\s+1\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    sources = ("folder", "s3", "s3+lat")
    assert {(source, ranks) for source, ranks, _, _ in rows} == {(s, r) for s in sources for r in "12"}, out
    assert all(float(rate) > 0 for _, _, rate, _ in rows), out
    for source in ("s3", r"s3\+lat"):
        assert re.search(rf"^{source} / folder, each at its best depth: 1 rank [\d.]+, 2 ranks [\d.]+$", out, re.M), out
    gain = r"^s3\+lat \(5 ms a request\), prefetch 1 / prefetch 1: 1 rank 1.00x, 2 ranks 1.00x$"
    assert re.search(gain, out, re.M), out


def _gpu_check(out: str, err: str, tmp: Path) -> None:
    # Without CUDA it asks `h3train bench` for the reduced CPU check; --help reaches bench's parser.
    assert "usage: h3train bench" in out and "--checks" in out, out
    assert re.search(r"^gpu_check: \d+ s, exit 0$", out, re.M), out
    assert not (tmp / "check.json").exists()


def _launch(out: str, err: str, tmp: Path) -> None:
    assert err.startswith("Launch `h3train train` on this node under torchrun"), err
    assert "Usage: scripts/launch.sh CONFIG [key=value ...]" in err and "MASTER_ADDR" in err, err


def _parity(out: str, err: str, tmp: Path) -> None:
    header, *rows = out.strip().splitlines()
    assert header.split() == ["layout", "loss", "ratio", "grad_norm", "ratio", "worst", "rel", "L2", "parameter"]
    assert [row[:32].strip() for row in rows] == [PARITY_LAYOUT], out
    loss, norm, worst, param = rows[0][32:].split()
    for ratio in (float(loss), float(norm)):
        assert abs(ratio - 1) <= 1e-6, out
    # Which parameter is worst is float32 rounding's choice; it must be one of the model's.
    names = set(load_file(tmp / "case0" / "dump" / "step_1" / "grads.safetensors"))
    assert math.isfinite(float(worst)) and float(worst) <= 1e-5 and param in names, out
    assert (tmp / "case0" / "dump" / "step_1" / "grads.safetensors").is_file()


def _slurm(out: str, err: str, tmp: Path) -> None:
    assert err.strip() == "usage: sbatch --nodes=N scripts/slurm.sbatch CONFIG [key=value ...]", err


CASES: dict[str, Case] = {
    # The cost-model half: the 2-rank runs of the rows/s half (--train-steps) take about 90 s.
    "balance_report.py": Case(("--steps", "20", "--train-steps", "0"), _balance),
    # Its smallest case (--steps 1 --saves 2) builds a trainer and saves twice: about 35 s.
    "bench_async_save.py": Case(("--help",), _help_of("--width", "--layers", "--saves", "--json")),
    "bench_lora.py": Case(("--repeats", "1"), _bench_lora),
    "bench_optim.py": Case(
        ("--width", "16", "--layers", "1", "--warmup", "1", "--steps", "1", "--eager", "--no-plan"), _bench_optim
    ),
    # --inference-steps 2 --heldout 1 --repeats 1 takes about 55 s (a held-out pass and two renders).
    "bench_validation.py": Case(("--help",), _help_of("--inference-steps", "--heldout", "--repeats")),
    # Each mutation runs tests on a patched copy of the package (minutes); --list names them.
    "check_mutations.py": Case(("--list",), _check_mutations),
    # Encodes clips and trains 40 steps on two ranks (minutes), with no option to shrink it.
    "demo.py": Case(("--help",), _demo),
    "digest_report.py": Case(("--gb", "0.01", "--repeats", "1"), _digest),
    # Trains a teacher, a student and four fine-tunes (minutes); test_distill_study runs a small study.
    "distill_study.py": Case(("--help",), _help_of("--teacher-steps", "--distill-steps", "--finetune-steps")),
    # Without CUDA it runs the bench and every trainer check on CPU ranks (test_bench runs it, marked slow).
    "gpu_check.sh": Case(("--help", "--out", "{tmp}/check.json"), _gpu_check),
    # Each figure comes from fresh interpreters and two `h3train check` runs: about 2 minutes at 1,000 samples.
    "index_bench.py": Case(("--help",), _help_of("--samples", "--repeats", "--keep")),
    # Runs training under torchrun, one rank per GPU (test_packaging and test_bad_input launch it).
    "launch.sh": Case(("--help",), _launch, returncode=2),
    # One of its six layouts (each launches ranks and recomputes the step unsharded; all six: minutes);
    # test_sp_parity checks sharded parity itself.
    "parity_report.py": Case(("--out", "{tmp}", "--only", PARITY_LAYOUT), _parity, slow=True),
    # Needs Slurm (scontrol, srun); without a config it prints its usage.
    "slurm.sbatch": Case((), _slurm, returncode=2),
    # Four samples read once each way, at one prefetch depth: moto's server start is most of it.
    "storage_bench.py": Case(("--samples", "4", "--depths", "1", "--latency-ms", "5"), _storage_bench),
    # One start, torch's import alone (the model class's and the launches': a minute more).
    "start_cost.py": Case(("--repeats", "1", "--only", "torch"), _start_cost),
    # Its smallest report (--repeats 1 --counted 1) runs an sp=1 and an sp=2 torchrun: about 3 minutes.
    "step_report.py": Case(("--help",), _help_of("--repeats", "--counted", "--out")),
}


def _scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def _params() -> list:
    names = sorted({*_scripts(), *CASES})
    return [pytest.param(n, marks=[pytest.mark.slow] if n in CASES and CASES[n].slow else []) for n in names]


def _command(script: Path, argv: list[str]) -> list[str]:
    if script.suffix in SHELL:
        return ["bash", str(script), *argv]
    return [sys.executable, str(script), *argv]


@pytest.mark.parametrize("name", _params())
def test_script_runs_its_case(name: str, tmp_path: Path) -> None:
    script = SCRIPTS / name
    if name not in CASES:
        pytest.fail(
            f"scripts/{name} has no case: add it to CASES in {Path(__file__).relative_to(ROOT)}, its smallest real "
            "run (or --help where that takes minutes or needs a GPU or a cluster) and a check of what it prints"
        )
    if not script.is_file():
        pytest.fail(f"scripts/{name} is gone: remove its entry from CASES in {Path(__file__).relative_to(ROOT)}")
    case = CASES[name]
    if script.suffix in SHELL:
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert parsed.returncode == 0, parsed.stderr
    argv = [a.replace("{tmp}", str(tmp_path)) for a in case.argv]
    # gpu_check.sh runs `h3train` with $PYTHON: this lane's interpreter.
    env = run_env(PYTHON=sys.executable)
    if script.suffix in SHELL or case.slow:
        done = run_process_group(_command(script, argv), env, case.timeout)
    else:
        done = fork_script(script, argv, env, ROOT, case.timeout)
    assert done.returncode == case.returncode, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    case.check(done.stdout, done.stderr, tmp_path)
