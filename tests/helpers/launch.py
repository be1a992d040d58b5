"""Runs of h3train as users start them, and what those runs leave behind.

A run starts in this process (`train`, `run_cli`), on ranks forked from a server that has imported
h3train (`run_forked`, `helpers.ranks`), or as a user launches it, under torchrun in a session of its
own (`run_h3train`, `start_in_session`). The recomputation of its numbers is `helpers.reference`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from h3train.checkpoint import step_dir_name

from helpers.paths import ROOT, TINY_FL2VA
from helpers.ranks import collective_checks, fork_ranks

# -- a tiny run: its arguments and the folders it writes -------------------------------------------


def tiny_overrides(log_dir: Path | str, *overrides: str) -> list[str]:
    """The overrides of a run in `log_dir` without a progress bar, then `overrides` (a later one wins)."""
    return [f"logging.dir={log_dir}", "logging.progress=false", *overrides]


def tiny_args(log_dir: Path | str, *overrides: str, config: Path | str = TINY_FL2VA) -> list[str]:
    """`train CONFIG` and `tiny_overrides(log_dir, *overrides)`: `h3train`'s arguments for a run of `config`
    (for `h3train.cli.main`, `run_h3train` and `h3train_command`)."""
    return ["train", str(config), *tiny_overrides(log_dir, *overrides)]


def checkpoint_dir(log_dir: Path | str, step: int) -> Path:
    """The checkpoint that a run in `log_dir` saves at `step` (under the default `checkpoint.dir`)."""
    return Path(log_dir) / "checkpoints" / step_dir_name(step)


def dump_dir(log_dir: Path | str, step: int) -> Path:
    """The folder of `debug.dump_step=step` of a run in `log_dir`."""
    return Path(log_dir) / "dump" / f"step_{step}"


# -- launching h3train -------------------------------------------------------------------------------


def h3train_command(args: list[str], nproc: int = 1, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m h3train ARGS`, or under `torchrun --standalone` when nproc > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "h3train", *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*torchrun, *launcher_args, "-m", "h3train", *args]


def run_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a launched run: one thread per rank, wandb offline, unbuffered output, and
    process groups that check every collective across their ranks.

    `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`ranks.collective_checks`) wraps each gloo group so that, before
    every collective, its ranks compare the op, shapes and dtypes: a rank that issues a collective its
    peers do not fails there with `Detected mismatch between collectives`, where NCCL on a cluster
    would hang.
    """
    env = os.environ if base is None else base
    return {
        **collective_checks(),
        **env,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def run_h3train(
    args: list[str],
    nproc: int = 1,
    timeout: float = 180,
    check: bool = True,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
):
    """Run `h3train ARGS` as a user launches it (see `h3train_command`), in the environment of `run_env`."""
    proc = run_process_group(h3train_command(args, nproc, launcher_args), env or run_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"h3train {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def torchrun_error_line(stderr: str) -> str:
    """The one `h3train: error:` line of a run that torchrun launched and that failed cleanly.

    A rank prints it once; after torchrun's own report (its traceback and table) it is printed again,
    as the last line of stderr.
    """
    ours = [line for line in stderr.splitlines() if line.startswith("h3train: error: ")]
    assert len(ours) == 2 and ours[0] == ours[1], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ours[0], stderr[-3000:]
    return ours[0]


# Mount a tmpfs of $1 bytes on $2, run the rest, then copy what the tmpfs holds to $3 (it goes with
# the namespace) and exit with the run's code.
_ON_SMALL_DISK = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; d="$2"; k="$3"; shift 3; "$@"; rc=$?; ' + (
    'cp -a "$d/." "$k"; exit $rc'
)


@functools.cache
def _namespaces() -> str | None:
    """Why this machine cannot mount a private tmpfs (None: it can)."""
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt || mount -t tmpfs tmpfs /tmp"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available: {exc}"
    return None if proc.returncode == 0 else f"no private mount namespace here: {proc.stderr.strip()}"


def on_small_disk(folder: Path, size: int, args: list[str], nproc: int = 1) -> tuple[subprocess.CompletedProcess, Path]:
    """`h3train ARGS` with a tmpfs of `size` bytes mounted on `folder`, in a mount namespace of its own
    (`unshare -rm`), so that writes there fail with ENOSPC as on a full disk. Returns the run and a copy
    of what the tmpfs held (`<folder>.kept`; the tmpfs goes with the namespace). A machine that cannot
    make such a namespace skips the test, saying why."""
    reason = _namespaces()
    if reason is not None:
        pytest.skip(reason)
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder.with_name(folder.name + ".kept")
    kept.mkdir()
    cmd = ["unshare", "-rm", "sh", "-c", _ON_SMALL_DISK, "sh", str(size), str(folder), str(kept)]
    proc = run_process_group([*cmd, *h3train_command(args, nproc)], run_env(), timeout=240)
    assert proc.returncode != 97, proc.stderr
    return proc, kept


def run_forked(
    args: list[str], nproc: int = 1, timeout: float = 180, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`h3train ARGS` in `nproc` fresh processes forked from a server that has imported h3train (`ranks`):
    one as `python -m h3train` runs, more as torchrun's workers of one node run. For what a run
    computes and writes; tests of the launch itself (signals sent from outside, restarts, what a node
    prints, scripts) use `run_h3train`."""
    proc = fork_ranks(args, nproc, env or run_env(), ROOT, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"h3train {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def train(args: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> str:
    """`h3train ARGS` to completion: one process in this one (`h3train.cli.main`, no interpreter to start,
    no imports to repeat), more as forked ranks (`run_forked`, in `env`). A run that signals itself
    (`debug.fault=[sigterm@...]`, `kill...`) must use `run_forked`. Returns the forked ranks' stdout
    (empty for a run in this process)."""
    if nproc > 1:
        return run_forked(args, nproc=nproc, env=env).stdout
    from h3train.cli import main

    assert main(args) == 0, f"h3train {' '.join(args)} failed"
    return ""


def run_process_group(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own; on timeout kill the whole session (torchrun's workers too)."""
    with start_in_session(cmd, env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# The signals a test sends to a process it launched (or a run sends itself through `debug.fault`).
SENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def default_signals() -> None:
    """`preexec_fn` of a launched process: the default disposition for `SENT_SIGNALS`, whatever pytest's is.

    An ignored signal stays ignored through fork and exec, and pytest may be started with SIGINT ignored
    (a background job of a non-interactive shell, some CI runners) or SIGHUP (`nohup`). bash cannot trap
    a signal that was ignored when it started, and Python installs no KeyboardInterrupt handler then: a
    Ctrl-C test would train on unsignalled. Each launched process gets what an interactive shell gives it.
    """
    for signum in SENT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def start_in_session(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` in ROOT in a session of its own (so that `os.killpg` reaches torchrun's workers), with the
    default disposition of every signal a test sends (`default_signals`) and stdout and stderr piped as text."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )


def signal_after_steps(
    proc: subprocess.Popen, log_dir: Path, signum: int, steps: int = 1, timeout: float = 120, group: bool = False
) -> tuple[str, str]:
    """Once `log_dir/metrics.jsonl` holds `steps` lines, send `signum` to `proc` (with `group`, to its whole
    process group, as a terminal's Ctrl-C reaches torchrun and its workers); return its (stdout, stderr).

    On a timeout or a failed assertion the process's whole session is killed.
    """
    metrics = Path(log_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
            assert proc.poll() is None and time.monotonic() < deadline, "training never logged a step"
            time.sleep(0.1)
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def checkpoint_tensors(checkpoint: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a DCP checkpoint whose keys start with `prefix` (e.g. `model.`), read in this
    process, keyed without the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }
    dcp.load(out, storage_reader=reader, no_dist=True)
    return {k.removeprefix(prefix): v for k, v in out.items()}


def checkpoint_tensor_bytes(checkpoint: Path) -> int:
    """Bytes of the tensors a DCP checkpoint holds, by its metadata (shapes and dtypes; DCP's framing aside)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * m.properties.dtype.itemsize for m in metadata.values() if hasattr(m, "size"))


def run_cli(capsys, args: list[str]) -> tuple[int, str, str]:
    """`h3train ARGS` in this process: its exit code, stdout and stderr; a traceback on stderr fails."""
    from h3train.cli import main

    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return rc, out, err


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines() if line]
