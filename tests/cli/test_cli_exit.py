"""`h3train` leaves through `cli.run`: main()'s code, after the run's threads and exit handlers are done."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers.launch import h3train_command, run_env, run_process_group
from helpers.paths import TINY_FL2VA


@pytest.mark.parametrize("joined", [True, False], ids=["after_a_group", "without_a_group"])
@pytest.mark.parametrize(
    ("returned", "code"), [("3", 3), ("raise SystemExit('bad usage')", 1), ("raise RuntimeError('boom')", 1)]
)
def test_run_finishes_threads_and_exit_handlers_then_exits_with_mains_code(tmp_path, returned, code, joined) -> None:
    program = textwrap.dedent(
        f"""
        import atexit, pathlib, threading, time
        from h3train import cli
        from h3train.parallel import dims

        dims._joined_group = {joined}  # as init_distributed leaves it

        out = pathlib.Path({str(tmp_path)!r})
        atexit.register(lambda: (out / "atexit").write_text("ran"))

        def late_writer():
            time.sleep(0.3)
            (out / "thread").write_text("joined")

        def main():
            threading.Thread(target=late_writer).start()
            {"return " + returned if returned.isdigit() else returned}

        cli.main = main
        cli.run()
        """
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    if "SystemExit" in returned:
        assert "bad usage" in proc.stderr
    if "RuntimeError" in returned:
        assert "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr


def test_a_run_stopped_at_once_leaves_without_waiting_for_its_threads(tmp_path) -> None:
    # A second Ctrl-C: a checkpoint write in flight is left to end with the process, not waited for.
    program = textwrap.dedent(
        f"""
        import atexit, pathlib, threading, time
        from h3train import cli
        from h3train.commands import process
        from h3train.parallel import dims

        dims._joined_group = True

        out = pathlib.Path({str(tmp_path)!r})
        atexit.register(lambda: (out / "atexit").write_text("ran"))

        def slow_writer():
            time.sleep(60)
            (out / "thread").write_text("joined")

        def main():
            threading.Thread(target=slow_writer).start()
            process.CTRL_C.left_at_once = True
            return 130

        cli.main = main
        cli.run()
        """
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 130, proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "thread").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the error needs a machine without CUDA")
def test_under_torchrun_the_ranks_one_line_is_the_last_line(tmp_path) -> None:
    """torchrun ends with its report and its own traceback; the rank's line is repeated after them."""
    args = ["train", str(TINY_FL2VA), "parallel.backend=nccl", f"logging.dir={tmp_path / 'run'}"]
    proc = run_process_group(h3train_command(args, nproc=2), run_env(), timeout=120)
    assert proc.returncode != 0
    assert "ChildFailedError" in proc.stderr  # torchrun's report is still there, before the line
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    expected = "h3train: error: config key 'parallel.backend' is 'nccl' but CUDA is not available; use gloo or auto"
    assert lines[-1] == expected, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("env", "repeated"),
    [
        ({}, False),
        ({"TORCHELASTIC_RUN_ID": "r"}, True),
        ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}, False),
        ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"}, True),
    ],
    ids=["alone", "torchrun", "restarts_left", "last_attempt"],
)
def test_the_line_is_repeated_only_after_torchruns_last_attempt(monkeypatch, env, repeated) -> None:
    """With restarts left torchrun starts the ranks again: a repeated line would follow their output."""
    from h3train.commands import process

    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    started: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kwargs: started.append(cmd))
    process._repeat_after_launcher("h3train: error: the reason")
    assert bool(started) is repeated
    if repeated:
        assert started[0][-3:-1] == [str(os.getppid()), "h3train: error: the reason"]
