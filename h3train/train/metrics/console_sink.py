"""The console's view of training: a tqdm bar on a TTY, else a plain line every few steps."""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from .record import MEMORY_KEY, training_record
from .sink import MetricSink

# Without a TTY the bar is replaced by plain lines; this caps how many a run prints.
_MAX_PLAIN_LINES = 50
# The headline: each modality's loss (never their sum, which halves on a step without sound), in
# this order, and the name each is shown under. `loss` only for rows that have neither. Under CFG the
# headline is the flow-matching loss, the one held-out reports (`val/loss_video`), and the calibrated
# objective the step trains on follows it.
_LOSS_KEYS = {"loss_video": "video", "loss_audio": "audio"}
_CFG_LOSS_KEYS = {
    "loss_video_fm": "video",
    "loss_audio_fm": "audio",
    "loss_video": "cfg_video",
    "loss_audio": "cfg_audio",
}
_TRACKED = tuple(_CFG_LOSS_KEYS)
# Keys shown after the losses, in this order, when present, and the name each is shown under.
_CONSOLE_KEYS = {"grad_norm": "grad_norm", "lr": "lr", MEMORY_KEY: "peak_mem", "samples": "samples"}


def format_duration(seconds: float) -> str:
    """`H:MM:SS` (hours keep counting past 24), as the console shows elapsed time and ETA."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RecentLosses:
    """Each modality's mean loss over the last `window` steps, over only the steps that had it.

    A step without sound logs `loss_audio` null; averaging it as 0 (or the total `loss`, which then
    holds the video loss alone) would draw a sawtooth and a false fall. A NaN stays in its mean: a
    non-finite step shows as one.
    """

    def __init__(self, window: int) -> None:
        self._steps: deque[dict[str, float | None]] = deque(maxlen=max(1, window))

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Take one step's row (`loss_video`, `loss_audio`; a missing or null one is a step without it)."""
        self._steps.append({k: float(v) if _is_number(v := metrics.get(k)) else None for k in _TRACKED})

    def means(self) -> dict[str, float | None]:
        """`loss_video`, `loss_audio` (and under CFG `loss_video_fm`, `loss_audio_fm`): the mean over the
        window's steps that had it, None when none did."""
        out: dict[str, float | None] = {}
        for key in _TRACKED:
            values = [v for step in self._steps if (v := step[key]) is not None]
            out[key] = sum(values) / len(values) if values else None
        return out


def _format_value(key: str, value: Any) -> str:
    if value is None:
        # Absent from the step (e.g. no clip with sound): not a number, so not shown as one.
        return "-"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key == "lr":
        return f"{value:.3e}"
    if key == MEMORY_KEY:
        return f"{value:.2f}GiB"
    if key == "samples":
        return f"{value:.0f}"
    return f"{value:.4g}" if key == "grad_norm" else f"{value:.4f}"


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        # stderr may be replaced by an object without isatty, or already closed.
        return False


class ConsoleSink(MetricSink):
    """The bar (a TTY and `progress`) or plain stderr lines, at most about 50 per run:
    `step 20/40 video=0.1234 audio=0.5678 grad_norm=0.8123 lr=1.000e-03 peak_mem=1.52GiB samples=16 (0.31 s/step,
    elapsed 0:00:06, eta 0:00:06)`.

    `video` and `audio` are `RecentLosses` over the last steps as many as the plain lines are apart (one
    in a run of up to 50 steps; the bar uses the same window): `audio` averages only the steps with sound, and reads
    `audio=-` when none of them had any. Under CFG they are the flow-matching losses (`loss_*_fm`, what
    held-out reports), followed by the calibrated objective as `cfg_video` and `cfg_audio`.
    `grad_norm`, `lr`, `peak_mem` and `samples` (trained over all DP ranks) are the step's own. A row
    without either modality loss shows its `loss`. Elapsed time counts from `start_clock` (the first
    step of this process, so a resumed run times its own steps) and the ETA extrapolates its mean time
    per step to `total_steps`. `show` prints a step's line as soon as the step is done; `log` prints it
    when `show` did not.
    """

    def __init__(self, total_steps: int, progress: bool) -> None:
        self.total_steps = total_steps
        self.progress = progress
        self.start_step = 0
        self._bar: tqdm | None = None
        self._plain_every = 1
        self._plain_last_time = self._clock_start = time.monotonic()
        self._plain_last_step = self._shown_step = 0
        self._losses = RecentLosses(1)

    def open(self, start_step: int) -> None:
        self.start_step = start_step
        self._plain_every = max(1, math.ceil(max(1, self.total_steps - start_step) / _MAX_PLAIN_LINES))
        self._plain_last_step = self._shown_step = start_step
        self._losses = RecentLosses(self._plain_every)
        # s/step should measure training, not the other sinks' start-up.
        self.start_clock()
        if self.progress and _stderr_is_tty():
            self._bar = tqdm(
                total=self.total_steps,
                initial=start_step,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def start_clock(self) -> None:
        """Time training from now: elapsed time, ETA and s/step count from here."""
        self._clock_start = self._plain_last_time = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        """Seconds since `start_clock` (or since the sink was made, before it is called)."""
        return time.monotonic() - self._clock_start

    def show(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The progress of optimizer step `step`: the bar, or a plain line every few steps (once per step)."""
        if step <= self._shown_step:
            return
        self._shown_step = step
        self._losses.add(metrics)
        shown = [(k, metrics[k]) for k in _CONSOLE_KEYS if k in metrics]
        if any(k in metrics for k in _LOSS_KEYS):
            means = self._losses.means()
            keys = _CFG_LOSS_KEYS if "loss_video_fm" in metrics else _LOSS_KEYS
            losses = [f"{name}={_format_value(k, means[k])}" for k, name in keys.items()]
        else:
            losses = [f"loss={_format_value('loss', metrics['loss'])}"] if "loss" in metrics else []
        if self._bar is not None:
            others = [f"{_CONSOLE_KEYS[k]}={_format_value(k, v)}" for k, v in shown if k != "lr"]
            postfix = " ".join(losses + others)
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            return
        done = step - self.start_step
        if not (done == 1 or done % self._plain_every == 0 or step >= self.total_steps):
            return
        now = time.monotonic()
        per_step = (now - self._plain_last_time) / max(1, step - self._plain_last_step)
        self._plain_last_time, self._plain_last_step = now, step
        elapsed = now - self._clock_start
        eta = elapsed / max(1, done) * max(0, self.total_steps - step)
        fields = " ".join(losses + [f"{_CONSOLE_KEYS[k]}={_format_value(k, v)}" for k, v in shown])
        timing = f"{per_step:.2f} s/step, elapsed {format_duration(elapsed)}, eta {format_duration(eta)}"
        print(f"step {step}/{self.total_steps} {fields} ({timing})", file=sys.stderr, flush=True)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        record = training_record(step, values)
        self.show(record["step"], record)

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        shown = " ".join(f"{k}={v:.4f}" for k, v in values.items() if "@" not in k and isinstance(v, float))
        message = f"validation after step {step}: {shown}"
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
