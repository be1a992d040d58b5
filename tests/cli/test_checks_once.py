"""A start checks its config once: the value checks as it loads, then the checks beyond the values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from h3train.cli import main
from h3train.config import load
from h3train.data import source
from h3train.run import checks

from helpers.launch import tiny_args
from helpers.paths import TINY_FL2VA


def _counted(calls: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return counting


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often a start runs the value checks, the checks beyond them, and a table entry's own check."""
    counted: Counter[str] = Counter()
    monkeypatch.setattr(load, "check_values", _counted(counted, "values", load.check_values))
    # `validate_samples` closes the checks beyond the values: it runs once for each time they all run.
    monkeypatch.setattr(checks, "validate_samples", _counted(counted, "beyond", checks.validate_samples))
    entry = source.SyntheticData.check
    monkeypatch.setattr(source.SyntheticData, "check", _counted(counted, "data source", entry))
    return counted


def test_train_checks_its_config_once(calls: Counter[str], tmp_path: Path) -> None:
    args = tiny_args(tmp_path / "run", "train.steps=1", "checkpoint.every=0", "validation.every=0")
    assert main(args) == 0
    assert calls == {"values": 1, "beyond": 1, "data source": 1}


def test_check_checks_its_config_once(calls: Counter[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(TINY_FL2VA)]) == 0
    assert "config ok" in capsys.readouterr().out
    assert calls == {"values": 1, "beyond": 1, "data source": 1}
