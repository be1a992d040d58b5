"""`MetricsLogger`: one call per row, fanned out to the sinks (JSONL, console, wandb, TensorBoard)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ...config import WandbConfig
from .console_sink import ConsoleSink
from .jsonl_sink import JsonlSink
from .sink import MetricSink
from .tensorboard_sink import TensorBoardSink
from .wandb_sink import WandbSink


class MetricsLogger:
    """Log one metrics dict per optimizer step to `metrics.jsonl`, the console and (optionally) wandb
    and TensorBoard; see each sink for what it writes.

    Only the main rank does anything; on every other rank each method is a no-op, so callers can
    make and call it unconditionally. Nothing is written until `open(start_step)` (or `with`, which
    opens at the constructor's `start_step`): `start_step` is the step the run goes on from, so a
    logger can be made before a resume has decided it. `sinks` are further destinations, after the
    built-in ones.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        is_main: bool,
        wandb_cfg: WandbConfig,
        run_config: dict[str, Any],
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = False,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.is_main = is_main
        self.log_dir = Path(log_dir)
        self.start_step = start_step
        self.console = ConsoleSink(total_steps, progress)
        jsonl = JsonlSink(self.log_dir)
        self.path = jsonl.path
        self._wandb = WandbSink(wandb_cfg, run_config, self.log_dir, jsonl.path)
        # In the order each row reaches them: the file first, so a row is recorded before it is shown.
        self.sinks: list[MetricSink] = []
        if is_main:
            self.sinks = [
                jsonl,
                self.console,
                self._wandb,
                TensorBoardSink(self.log_dir, tensorboard, jsonl.path),
                *sinks,
            ]
        self._opened = False
        self._closed = False
        self._failed = False

    @property
    def _opening_order(self) -> list[MetricSink]:
        # The console last: the others' start-up output would break its bar, and its clock should
        # not count their start-up. Closed in the reverse order.
        return sorted(self.sinks, key=lambda sink: sink is self.console)

    def open(self, start_step: int | None = None) -> MetricsLogger:
        """Open every sink for the steps after `start_step` (the constructor's when None); returns self."""
        if self._opened:
            return self
        self._opened = True
        if start_step is not None:
            self.start_step = start_step
        for sink in self._opening_order:
            sink.open(self.start_step)
        return self

    # -- the wandb sink's start, seen from the logger ------------------------------------------

    @property
    def _wandb_run(self) -> Any:
        """The wandb run rows go to (None while it starts and when off)."""
        return self._wandb.run

    @_wandb_run.setter
    def _wandb_run(self, run: Any) -> None:
        self._wandb.run = run

    @property
    def _wandb_held(self) -> list:
        """Rows held while wandb starts."""
        return self._wandb.held

    def _wandb_ready(self, final: bool = False) -> bool:
        """Whether wandb runs (`WandbSink.ready`)."""
        return self._wandb.ready(final)

    # -- logging -----------------------------------------------------------------------------

    def start_clock(self) -> None:
        """Time training from now: elapsed time, ETA and s/step on the console count from here.

        The trainer calls it right before its first step, after the start-up work (validation and
        rendering at step 0), which would otherwise inflate the first steps' time and the ETA.
        """
        self.console.start_clock()

    @property
    def elapsed_s(self) -> float:
        """Seconds since `start_clock` (or since the logger was made, before it is called)."""
        return self.console.elapsed_s

    def show(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """The console progress of optimizer step `step`: the bar, or a plain line every few steps.

        Called as soon as the step is done, so that what the step's hooks print (validation,
        rendering) comes after its line.
        """
        if not self.is_main or self._closed:
            return
        self.console.show(step, metrics)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Record `metrics` for optimizer step `step` (1-based: the step just completed).

        A None value is a quantity the step did not have: `null` in `metrics.jsonl`, left out of
        the dashboards. The console line is shown here unless `show` showed it already.
        """
        if not self.is_main or self._closed:
            return
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_validation(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record a held-out evaluation after step `step` (0: before training) as a row of its own.

        The row carries `"kind": "validation"`; training rows have no `kind`. wandb and TensorBoard
        get the values at the same step as the training row, so both curves share the x axis.
        """
        if not self.is_main or self._closed:
            return
        for sink in self.sinks:
            sink.log_validation(step, metrics)

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        """Log rendered clips `{name: (mp4 path, caption)}` as `samples/<name>` at step `step`.

        wandb gets each as a video with its caption, TensorBoard as an animated GIF with its sound
        and prompt. `metrics.jsonl` holds numbers only; the files stay where they were written.
        """
        if not self.is_main or self._closed or not videos:
            return
        for sink in self.sinks:
            sink.log_videos(step, videos)

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close every sink (the bar, TensorBoard, wandb, the file). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for sink in reversed(self._opening_order):
            sink.close(self._failed)

    def __enter__(self) -> MetricsLogger:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Marks the wandb run as failed when training raised.
        if exc_type is not None:
            self._failed = True
        self.close()
