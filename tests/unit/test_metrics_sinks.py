"""A metrics sink from outside the package joins the built-in ones behind the one interface."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from h3train.config import WandbConfig
from h3train.train.metrics import MetricSink, MetricsLogger


class Recording(MetricSink):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def open(self, start_step: int) -> None:
        self.calls.append(("open", start_step))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        self.calls.append(("log", step, dict(values)))

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        self.calls.append(("validation", step, dict(values)))

    def close(self, failed: bool = False) -> None:
        self.calls.append(("close", failed))


def test_a_sink_from_outside_gets_every_row_after_the_built_in_ones(tmp_path: Path) -> None:
    sink = Recording()
    logger = MetricsLogger(tmp_path, True, WandbConfig(enabled=False), {}, 4, progress=False, sinks=[sink])
    with logger.open(2):
        logger.log(3, {"loss": 0.5})
        logger.log_validation(3, {"loss": 0.25})
    assert sink.calls == [
        ("open", 2),
        ("log", 3, {"loss": 0.5}),
        ("validation", 3, {"loss": 0.25}),
        ("close", False),
    ]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "loss": 0.5, "resumed": True}, {"step": 3, "kind": "validation", "loss": 0.25}]


def test_other_ranks_open_no_sink(tmp_path: Path) -> None:
    sink = Recording()
    with MetricsLogger(tmp_path, False, WandbConfig(), {}, 4, sinks=[sink]) as logger:
        logger.log(1, {"loss": 0.5})
    assert sink.calls == [] and not (tmp_path / "metrics.jsonl").exists()
