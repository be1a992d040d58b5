"""The ranks of a multi-rank test run, forked from one server that has imported h3train already.

A rank that torchrun starts is a fresh interpreter: before its first line of h3train it imports
torch, diffusers (which pulls peft, transformers and torch._dynamo) and h3train, about 5-6 CPU
seconds, most of what a tiny rank costs. Tests about a multi-rank run's numbers and files (parity,
resume, export) start their ranks here instead: a `forkserver` imports those modules once per test
process, and each rank is a fork of that server which sets what torchrun sets for its workers
(`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and runs
`h3train.cli.run`, the function `python -m h3train` runs. As torchrun does, the first rank that
fails takes the others down with it.

Tests about the launcher itself (signals sent from outside, restarts, what a node prints, the launch
scripts) keep launching torchrun (`launch.run_h3train`).

The same server runs a test's own function on several gloo ranks (`run_ranks`, `start_processes`, in
place of spawned processes) and a Python script of `scripts/` (`fork_script`).

At its top this module imports only the standard library: the server unpickles `_rank_main` from it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What the server imports once: the command line and everything a training rank loads.
PRELOAD = [
    "torch",
    "diffusers",
    "h3train.cli",
    "h3train.run.preflight",
    "h3train.run.assemble",
    "h3train.train.trainer",
]

# How long the other ranks get to stop after one failed, before they are killed.
_GRACE_S = 10.0

# The variable that makes torch's process groups check each collective's op and shapes across ranks.
# torch reads it when `torch.distributed` is imported, which the server did before a rank's environment
# was set: each rank reads it again.
COLLECTIVE_CHECKS = "TORCH_DISTRIBUTED_DEBUG"


def collective_checks() -> dict[str, str]:
    """`{COLLECTIVE_CHECKS: "DETAIL"}` where this torch can check FSDP2's collectives on gloo; else empty.

    torch 2.8's checking wrapper lacks the coalesced all-gather FSDP2's backward issues on gloo
    (`allgather_into_tensor_coalesced`), so there the groups run unchecked.
    """
    from importlib.metadata import version

    major, minor = (int(part) for part in version("torch").split(".")[:2])
    return {COLLECTIVE_CHECKS: "DETAIL"} if (major, minor) > (2, 8) else {}


# Set to 1 in a run's environment: its ranks' collectives sum where asked to average, as torch 2.8's
# gloo reduce-scatter does (`h3train/parallel/averaging.py`).
SUMS_AVERAGE = "H3TRAIN_TEST_SUMS_AVERAGE"


def _sum_when_averaging() -> None:
    """Make this process's reduce-scatters and all-reduces sum when they are asked to average."""
    import torch.distributed as dist

    def summing(collective):
        def call(*args, **kwargs):
            if kwargs.get("op") == dist.ReduceOp.AVG:
                kwargs["op"] = dist.ReduceOp.SUM
            return collective(*args, **kwargs)

        return call

    for name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"):
        if hasattr(dist, name):
            setattr(dist, name, summing(getattr(dist, name)))


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def torchrun_env(env: dict[str, str], rank: int, nproc: int, port: str) -> dict[str, str]:
    """`env` with what torchrun sets for worker `rank` of `nproc` on one node (its rendezvous at `port`)."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _as_launched(env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """A forked process as a launched one: its own stdout and stderr files, default signal handlers,
    exactly `env`, `cwd`; torch's threads and debug level read from that environment."""
    for path, fd in ((out, 1), (err, 2)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    import torch.distributed

    # The server imported torch before OMP_NUM_THREADS and the debug level were set for this process.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    torch.distributed.set_debug_level_from_env()


def _rank_main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: the environment and streams of a torchrun worker, then `h3train.cli.run` (never returns)."""
    _as_launched(env, cwd, out, err)
    if env.get(SUMS_AVERAGE) == "1":
        _sum_when_averaging()
    sys.argv = ["h3train", *args]
    from h3train.cli import run

    run()


def _script_main(script: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """`python SCRIPT ARGS` in a fork of the server: a rank's streams and environment (`_rank_main`), the
    script's folder first on `sys.path`, then the script as `__main__`. Its `SystemExit` is the exit code;
    an exception it raises prints its traceback and exits 1, as the interpreter does."""
    import runpy

    _as_launched(env, cwd, out, err)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def fork_script(
    script: Path, args: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in a process forked from the server, which has imported what the scripts of
    `scripts/` import (torch, diffusers, h3train) once for the test process: the script's own lines run
    in a fresh process, without a fresh interpreter's imports. stdout and stderr as `subprocess.run`
    captures them; on a timeout the process is killed and `subprocess.TimeoutExpired` raised."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="h3train-script-") as tmp:
        out, err = f"{tmp}/out", f"{tmp}/err"
        proc = ctx.Process(target=_script_main, args=(str(script), list(args), dict(env), str(cwd), out, err))
        proc.start()
        code = _wait([proc], timeout, [str(script), *args])
        stdout, stderr = _read(Path(out)), _read(Path(err))
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code, stdout, stderr)


def fork_ranks(
    args: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """`h3train ARGS` on `nproc` forked ranks of one node (one: a process alone); stdout and stderr are
    the ranks', in rank order.

    The return code is the first failed rank's (0 when all succeed). On a timeout every rank is
    killed and `subprocess.TimeoutExpired` raised.
    """
    # Imported here, in the test process: the server loads this module for `_rank_main` alone.
    from h3train.parallel.dims import free_port

    ctx = _context()
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="h3train-ranks-") as tmp:
        procs = []
        for rank in range(nproc):
            # One process is `python -m h3train` alone: it sets none of torchrun's variables.
            rank_env = env if nproc == 1 else torchrun_env(env, rank, nproc, port)
            out, err = f"{tmp}/{rank}.out", f"{tmp}/{rank}.err"
            proc = ctx.Process(target=_rank_main, args=(list(args), rank_env, str(cwd), out, err))
            proc.start()
            procs.append(proc)
        code = _wait(procs, timeout, args)
        stdout = "".join(_read(Path(tmp, f"{rank}.out")) for rank in range(nproc))
        stderr = "".join(_read(Path(tmp, f"{rank}.err")) for rank in range(nproc))
    return subprocess.CompletedProcess(["h3train", *args], code, stdout, stderr)


def _process_main(rank: int, env: dict[str, str], errors: str, fn: Callable, args: tuple) -> None:
    """`fn(rank, *args)` in a fork of the server, in the environment of the test that started it; a failure
    leaves its traceback in `errors/<rank>` for `start_processes` to raise."""
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed

    torch.distributed.set_debug_level_from_env()
    try:
        fn(rank, *args)
    except BaseException:
        Path(errors, str(rank)).write_text(traceback.format_exc())
        raise


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, timeout: float = 600) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, start_method="spawn")` on processes forked from
    the server: `fn(rank, *args)` in each, without a spawned interpreter's imports of torch, diffusers
    and h3train. `fn` must be importable (a module-level function of a test module or of h3train). The
    first process that fails raises here with its traceback, after the others are stopped."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="h3train-processes-") as errors:
        env = dict(os.environ)
        procs = [ctx.Process(target=_process_main, args=(rank, env, errors, fn, tuple(args))) for rank in range(nprocs)]
        for proc in procs:
            proc.start()
        code = _wait(procs, timeout, [fn.__qualname__])
        if code != 0:
            said = [Path(errors, str(rank)) for rank in range(nprocs)]
            tracebacks = "\n".join(f"process {p.name}:\n{p.read_text()}" for p in said if p.is_file())
            raise AssertionError(f"{fn.__qualname__} exited {code} on a forked process\n{tracebacks}")


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """`h3train.tools.bench_memory.run_ranks` on forked processes (`start_processes`): `fn(rank, world, *args)`
    in `world` CPU processes over gloo; each rank's return value."""
    import torch

    from h3train.parallel.dims import free_port
    from h3train.tools.bench_memory import rank_main

    with tempfile.TemporaryDirectory() as out_dir:
        start_processes(rank_main, args=(world, free_port(), out_dir, fn, args), nprocs=world)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _wait(procs: list, timeout: float, args: list[str]) -> int:
    """Wait for every rank; the first failure stops the others (SIGTERM, then SIGKILL after a grace)."""
    deadline = time.monotonic() + timeout
    failed_at = None
    code = 0
    while any(p.is_alive() for p in procs):
        for p in procs:
            if p.exitcode not in (None, 0) and failed_at is None:
                code, failed_at = p.exitcode, time.monotonic()
                for q in procs:
                    if q.is_alive():
                        q.terminate()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            if now > deadline:
                raise subprocess.TimeoutExpired(["h3train", *args], timeout)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
        if code == 0 and p.exitcode:
            code = p.exitcode
    return code
