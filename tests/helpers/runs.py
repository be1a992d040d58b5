"""Trained runs that tests share: each distinct run trains once per test process, whichever test asks first.

`trained_runs` (a session fixture, `tests/conftest.py`) is a `TrainedRuns`. A test asks it for a run by
what makes the run: its config, its overrides, its ranks and how they start. The folder it gets back is
shared with every other test that asks for the same run: a test that writes into it copies it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helpers.launch import run_forked, tiny_args, train
from helpers.paths import TINY_FL2VA


@dataclass(frozen=True)
class TrainedRun:
    dir: Path
    stdout: str  # what its forked ranks printed; empty for a run in this process


class TrainedRuns:
    """Runs keyed by (config, overrides, ranks, forked) and synthetic datasets keyed by their arguments, each
    made on first use under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[tuple, TrainedRun] = {}
        self._datasets: dict[tuple[str, ...], Path] = {}
        self._started = 0

    def get(self, *overrides: str, config: Path = TINY_FL2VA, nproc: int = 1, forked: bool = False) -> TrainedRun:
        """The run of `h3train train CONFIG` with `tiny_args` and `overrides`, on `nproc` ranks: forked ranks
        (`run_forked`) when `forked` or `nproc > 1`, else this process (`train`). A run that fails fails
        the test that asked first; the next to ask trains it again."""
        key = (str(config), overrides, nproc, forked)
        if key not in self._runs:
            # A new folder for each start: a run that failed leaves its folder to the test that saw it fail.
            self._started += 1
            folder = self.root / f"{Path(config).stem}-{self._started}"
            args = tiny_args(folder, *overrides, config=config)
            stdout = run_forked(args, nproc=nproc).stdout if forked or nproc > 1 else train(args)
            self._runs[key] = TrainedRun(folder, stdout)
        return self._runs[key]

    def dataset(self, *synth_args: str) -> Path:
        """The synthetic dataset `h3train synth --out FOLDER SYNTH_ARGS` writes, written on first use."""
        if synth_args not in self._datasets:
            from h3train.cli import main

            folder = self.root / f"data-{len(self._datasets) + 1}"
            assert main(["synth", "--out", str(folder), *synth_args]) == 0
            self._datasets[synth_args] = folder
        return self._datasets[synth_args]
