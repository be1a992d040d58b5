"""The interface every metrics sink has: `MetricsLogger` fans each call out to its sinks.

A sink does nothing it was not asked for: each method is a no-op unless overridden. Sinks run on
the main rank only, and a dashboard's failure turns that sink off, never the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class MetricSink:
    """One destination of the metrics rows: a file, the console or a dashboard."""

    def open(self, start_step: int) -> None:
        """Start before the first step after `start_step` (0 on a fresh run; the resume step else)."""

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """The training row of optimizer step `step`; a None value is one the step did not have."""

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        """A held-out evaluation after step `step` (0: before training)."""

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        """Rendered clips `{name: (mp4 path, caption)}` after step `step`."""

    def close(self, failed: bool = False) -> None:
        """Finish; `failed`: training raised. Safe to call more than once, and before `open`."""


def failure_reason(exc: BaseException) -> str:
    """`Type: first line of the message`, as a sink's one warning names its failure."""
    detail = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {detail[0]}" if detail else type(exc).__name__
