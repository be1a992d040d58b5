"""A run cut short before its first checkpoint restarts under the same command; a changed config does not.

The first attempt dies (SIGKILL, `debug.fault=[kill@3]`) before step 3, long before its only checkpoint
(the last step's). The same command then runs again as `torchrun --max-restarts` starts it: one rank
with torchrun's variables and `TORCHELASTIC_RESTART_COUNT=1`, past which the fault does not strike. It
sets the attempt's rows aside as `<name>.abandoned-0` with one line, and trains from step 0. Both runs
measure the held-out loss at the start and after every step, so the rows set aside hold evaluations
of steps 0 to 2 that the restart measures again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3train.checkpoint import committed_checkpoints
from h3train.parallel.dims import free_port
from h3train.train.metrics import first_row, iter_rows

from helpers.launch import read_metrics, run_cli, run_env, run_forked, tiny_args
from helpers.ranks import torchrun_env

HELDOUT = ("--task", "fl2va", "--num-samples", "2", "--text-dim", "16")
EVENT_LOGS = ("data_errors.jsonl", "loss_spikes.jsonl")


def _args(run: Path, heldout: Path, *extra: str) -> list[str]:
    validation = ("validation.at_start=true", "validation.every=1", f"validation.dataset={heldout}")
    return tiny_args(run, "train.steps=4", "checkpoint.every=10", *validation, "debug.fault=[kill@3]", *extra)


def _snapshot(folder: Path) -> dict[str, bytes]:
    """The folder's files, without the run lock (a dead writer's is taken over and released)."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".h3train.lock")
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def heldout(trained_runs) -> Path:
    return trained_runs.dataset(*HELDOUT)


def test_the_same_command_restarts_from_step_0_and_a_changed_one_is_refused(tmp_path, heldout, capsys) -> None:
    run = tmp_path / "run"
    proc = run_forked(_args(run, heldout), check=False)
    assert proc.returncode != 0 and "step 3" not in proc.stdout, proc.stderr[-3000:]
    assert not committed_checkpoints(run / "checkpoints")
    old_text = (run / "metrics.jsonl").read_text()
    old = [json.loads(line) for line in old_text.splitlines()]
    assert [m["step"] for m in old if m.get("kind") is None] == [1, 2]
    # Event logs of the attempt, as a skipped sample or a loss spike would have left them.
    events = {name: f'{{"step": 2, "sample_id": "{name}"}}\n' for name in EVENT_LOGS}
    for name, text in events.items():
        (run / name).write_text(text)

    # Another config: refused in one line naming the change, and nothing moves.
    before = _snapshot(run)
    rc, _, err = run_cli(capsys, _args(run, heldout, "optim.lr=1e-2"))
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("h3train: error:")]
    assert len(lines) == 1, err[-3000:]
    assert (
        f"'{run}'" in lines[0] and "before its first checkpoint" in lines[0] and "(optim.lr 0.001 -> 0.01)" in lines[0]
    )
    assert f"h3train train {run / 'config.yaml'}" in lines[0] and "--overwrite" in lines[0]
    assert _snapshot(run) == before

    restart = torchrun_env(run_env(TORCHELASTIC_RESTART_COUNT="1"), 0, 1, str(free_port()))
    proc = run_forked(_args(run, heldout), env=restart)
    said = [line for line in proc.stdout.splitlines() if line.startswith("restart:")]
    assert len(said) == 1, proc.stdout[-3000:]
    assert "stopped after step 2, before its first checkpoint" in said[0] and "trains from step 0" in said[0]
    assert all(f"{name}.abandoned-0" in said[0] for name in ("metrics.jsonl", *EVENT_LOGS)), said[0]
    aside = run / "metrics.jsonl.abandoned-0"
    assert aside.read_text() == old_text
    for name, text in events.items():
        assert (run / f"{name}.abandoned-0").read_text() == text
        assert not (run / name).exists()

    rows = read_metrics(run)
    assert (rows[0]["step"], rows[0]["kind"]) == (0, "validation")
    assert [m["step"] for m in rows if m.get("kind") is None] == [1, 2, 3, 4]
    assert not any(m.get("resumed") for m in rows)
    # A fresh start from the same seed: the steps both attempts trained have the same numbers.
    assert [(m["step"], m.get("kind"), m.get("loss"), m.get("val/loss")) for m in rows[: len(old)]] == [
        (m["step"], m.get("kind"), m.get("loss"), m.get("val/loss")) for m in old
    ]
    assert [p.name for p in committed_checkpoints(run / "checkpoints")] == ["step_00000004"]
    # The held-out history: this run's rows in metrics.jsonl, once per step; the attempt's beside them.
    assert [m["step"] for m in iter_rows(run / "metrics.jsonl") if m.get("kind") == "validation"] == [0, 1, 2, 3, 4]
    assert first_row(run / "metrics.jsonl", "validation") == rows[0]
    assert [m["step"] for m in iter_rows(aside) if m.get("kind") == "validation"] == [0, 1, 2]
