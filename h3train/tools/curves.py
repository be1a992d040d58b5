"""Render a run's `metrics.jsonl` into a PNG: losses (held-out loss beside them), gradient norm, learning rate.

The loss panel draws the video and the audio loss, each over the steps that have it (`loss_curves`);
their sum `loss` is left out, since a step without sound logs about half of it and its curve falls
while neither modality does. Each training curve is drawn raw (faint) under its exponential moving
average (`SMOOTHING`); held-out rows (`"kind": "validation"`) are points; a dotted vertical line
marks each step where the run was resumed.

Under CFG (rows with `loss_video_fm`) the loss panel draws the flow-matching losses (`loss_video_fm`,
`loss_audio_fm`: the console's `video=` / `audio=`) beside the held-out loss, which is flow matching
too, and the calibrated objective the step trains on (`loss_video`, `loss_audio`, an order of magnitude
larger) gets an axis of its own below it, with its held-out counterpart (`val/loss_*_cfg`).
Usage: `python -m h3train.tools.curves runs/x/metrics.jsonl runs/x/metrics.png`.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Drawn through the Agg canvas directly rather than pyplot, so plotting never touches (or is
# affected by) the process-wide pyplot backend and works on machines without a display.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..errors import UsageError
from ..train.metrics import iter_rows

# The loss panel's curves; a file with neither (no modality losses logged) draws `loss` instead.
_LOSS_KEYS = ("loss_video", "loss_audio")
_TOTAL_KEY = "loss"
# Under CFG: the flow-matching losses, which the loss panel draws instead (`_LOSS_KEYS` are then the objective's).
_FM_KEYS = ("loss_video_fm", "loss_audio_fm")
# Each training loss -> the held-out key that measures the same quantity, drawn as points beside it.
_HELD_OUT = {
    "loss": "val/loss",
    "loss_video": "val/loss_video",
    "loss_audio": "val/loss_audio",
    "loss_video_fm": "val/loss_video",
    "loss_audio_fm": "val/loss_audio",
}
# Under CFG the objective's curves are measured by the calibrated held-out loss instead.
_HELD_OUT_CFG = {"loss_video": "val/loss_video_cfg", "loss_audio": "val/loss_audio_cfg"}
# Weight of the past in the smoothed curves: s_i = SMOOTHING * s_(i-1) + (1 - SMOOTHING) * x_i over
# the logged values (nulls skipped), divided by 1 - SMOOTHING^i so the curve starts at the first value
# rather than at 0 (TensorBoard's smoothing at 0.9: about the last 10 values).
SMOOTHING = 0.9
# How faint the raw curve is under its smoothed one.
_RAW_ALPHA = 0.25
# The marker's key in a training row: the first step a resumed run logged (`metrics.RESUMED_KEY`).
_RESUMED_KEY = "resumed"


def _as_float(value: Any) -> float:
    """A plottable number; null (a non-finite value in strict JSON) or non-numeric entries become NaN."""
    if isinstance(value, bool) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_metrics(metrics_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics file, skipping lines that are not JSON objects with a `step`.

    Raises `UsageError` (one line, exit 2) when the file is missing or cannot be read.
    """
    path = Path(metrics_path)
    if path.is_dir():
        raise UsageError(
            f"metrics file '{path}' is a folder; pass the run's metrics.jsonl, e.g. '{path / 'metrics.jsonl'}'"
        )
    if not path.is_file():
        raise UsageError(f"metrics file '{path}' does not exist; pass a run's <logging.dir>/metrics.jsonl")
    try:
        records = list(iter_rows(path))
    except OSError as exc:
        raise UsageError(f"metrics file '{path}' cannot be read: {exc.strerror or exc}") from None
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`; null entries (non-finite values written as strict JSON) are skipped."""
    points = [(r["step"], _as_float(r[key])) for r in records if r.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def smoothed(values: list[float], factor: float = SMOOTHING) -> list[float]:
    """The debiased exponential moving average of `values` (see `SMOOTHING`); NaN entries stay NaN and are skipped."""
    out: list[float] = []
    average = weight = 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        average = factor * average + (1.0 - factor) * value
        weight = factor * weight + (1.0 - factor)
        out.append(average / weight)
    return out


@dataclass(frozen=True)
class Curve:
    """One training curve: the steps that logged a value of its key, those values, and their `smoothed`."""

    steps: list[int]
    values: list[float]
    smoothed: list[float]


def is_cfg(records: list[dict[str, Any]]) -> bool:
    """Whether the rows are of a CFG run: they log the flow-matching losses apart (`loss_*_fm`)."""
    return any(r.get(k) is not None for r in records for k in _FM_KEYS)


def loss_curves(records: list[dict[str, Any]], keys: tuple[str, ...] | None = None) -> dict[str, Curve]:
    """The loss panel's curves by key: `loss_video` and `loss_audio` (under CFG `loss_video_fm` and
    `loss_audio_fm`), each with a point only at the steps that logged it (a step without sound logs its
    audio loss null) and smoothed over those steps alone; `loss` instead when the rows hold neither.
    `keys`: those curves instead. A key with no finite value has no curve."""
    if keys is None:
        wanted = _FM_KEYS if is_cfg(records) else _LOSS_KEYS
        keys = tuple(k for k in wanted if any(r.get(k) is not None for r in records)) or (_TOTAL_KEY,)
    curves = {}
    for key in keys:
        steps, values = _series(records, key)
        if any(math.isfinite(v) for v in values):
            curves[key] = Curve(steps, values, smoothed(values))
    return curves


def _draw_losses(ax: Any, curves: dict[str, Curve], validation: list[dict[str, Any]], held_out: dict[str, str]) -> None:
    """Draw `curves` on `ax` and, as points in each one's colour, the held-out key `held_out` names for it."""
    for key, curve in curves.items():
        color = _draw(ax, key, curve, linewidth=1.3).get_color()
        steps, values = _series(validation, held_out[key])
        if any(math.isfinite(v) for v in values):
            # In the colour of the training loss it measures, edged in black to tell it from that curve.
            ax.plot(
                steps,
                values,
                label=f"{held_out[key]} (held out)",
                linestyle="none",
                marker="o",
                markersize=5,
                markeredgecolor="black",
                color=color,
            )


def resume_steps(records: list[dict[str, Any]]) -> list[int]:
    """The steps training rows resumed from: `step - 1` of each row marked `"resumed": true` and of each
    row whose step does not follow the previous row's (a gap: the rows in between are not in the file)."""
    found: set[int] = set()
    previous = None
    for record in records:
        step = record["step"]
        if record.get(_RESUMED_KEY) is True or (previous is not None and step != previous + 1):
            found.add(step - 1)
        previous = step
    return sorted(found)


def plot_metrics(metrics_path: str | os.PathLike[str], out_png: str | os.PathLike[str]) -> Path:
    """Plot the losses (`loss_video`, `loss_audio`; `loss` when neither is logged), `grad_norm`, `lr` against step.

    Writes one PNG with four stacked axes (five under CFG; the last: samples per step) sharing the step axis
    and returns its path. A null value
    (a non-finite one in strict JSON, or a loss the step did not have) is skipped. Raises `UsageError` (a
    `ValueError`) naming the file if it is missing, holds no step records, or no `loss` values, or if the
    PNG cannot be written.
    """
    fig = metrics_figure(metrics_path)
    out = Path(out_png)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=110)
    except OSError as exc:
        raise UsageError(f"--out '{out}': cannot write the plot there ({exc.strerror or exc})") from None
    return out


def metrics_figure(metrics_path: str | os.PathLike[str]) -> Figure:
    """The figure `plot_metrics` writes: losses (held-out points beside them), under CFG the calibrated
    objective on an axis of its own (the second), grad_norm, lr, samples per step; legends outside."""
    path = Path(metrics_path)
    everything = read_metrics(path)
    records = [r for r in everything if r.get("kind") is None]
    validation = [r for r in everything if r.get("kind") == "validation"]
    if not records:
        raise UsageError(
            f"metrics file '{path}' holds no step records (JSON lines with a 'step'); pass a run's "
            "<logging.dir>/metrics.jsonl once it has logged a step"
        )
    curves = loss_curves(records)
    if not curves:
        raise UsageError(f"metrics file '{path}' has no finite 'loss' values to plot")

    cfg = is_cfg(records)
    fig = Figure(figsize=(10, 12 if cfg else 10), layout="constrained")
    FigureCanvasAgg(fig)
    if cfg:
        axes = fig.subplots(5, 1, sharex=True, height_ratios=(2.2, 1.6, 1.2, 1.0, 1.0))
        ax_loss, ax_cfg, ax_grad, ax_lr, ax_samples = axes
    else:
        axes = fig.subplots(4, 1, sharex=True, height_ratios=(2.2, 1.2, 1.0, 1.0))
        ax_loss, ax_grad, ax_lr, ax_samples = axes

    # Each held-out key beside the training loss it measures: the total only when it is the curve drawn.
    _draw_losses(ax_loss, curves, validation, _HELD_OUT)
    ax_loss.set_ylabel("flow-matching loss" if cfg else "loss")
    ax_loss.set_title(f"{path}  (smoothed: EMA {SMOOTHING:g}; raw faint)", fontsize="medium")
    if cfg:
        objective = loss_curves(records, tuple(k for k in _LOSS_KEYS if any(r.get(k) is not None for r in records)))
        _draw_losses(ax_cfg, objective, validation, _HELD_OUT_CFG)
        ax_cfg.set_ylabel("CFG objective")

    if _smoothed_curve(ax_grad, records, "grad_norm", color="tab:red") is not None:
        finite = [v for v in _series(records, "grad_norm")[1] if math.isfinite(v)]
        # Gradient norms span orders of magnitude (spikes, clipping), so a log axis reads better.
        if all(v > 0 for v in finite):
            ax_grad.set_yscale("log")
    else:
        ax_grad.text(0.5, 0.5, "no grad_norm logged", ha="center", va="center", transform=ax_grad.transAxes)
    ax_grad.set_ylabel("grad_norm")

    steps, values = _series(records, "lr")
    if any(math.isfinite(v) for v in values):
        # The schedule is exact, not noisy: drawn as it is.
        ax_lr.plot(steps, values, color="tab:green", linewidth=1.2, label="lr")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    else:
        ax_lr.text(0.5, 0.5, "no lr logged", ha="center", va="center", transform=ax_lr.transAxes)
    ax_lr.set_ylabel("lr")
    _samples_axis(ax_samples, records)
    ax_samples.set_xlabel("step")

    resumes = resume_steps(records)
    for ax in axes:
        for i, step in enumerate(resumes):
            label = "resumed" if i == 0 and ax is ax_loss else None
            ax.axvline(step, color="0.35", linestyle=":", linewidth=1.0, label=label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            # Outside the axes, on the right: a legend never covers the curves.
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")
    return fig


def _samples_axis(ax: Any, records: list[dict[str, Any]]) -> None:
    """Samples per step (all DP ranks), titled with the steps an epoch took where the run logged its epochs."""
    steps, values = _series(records, "samples")
    if not any(math.isfinite(v) for v in values):
        ax.text(0.5, 0.5, "no samples logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("samples / step")
        return
    ax.plot(steps, values, color="tab:purple", linewidth=1.2, drawstyle="steps-mid", label="samples")
    ax.set_ylabel("samples / step")
    epoch_steps, epochs = _series(records, "epoch")
    done = [(s, e) for s, e in zip(epoch_steps, epochs) if math.isfinite(e)]
    if len(done) > 1 and done[-1][1] > done[0][1]:
        per_epoch = (done[-1][0] - done[0][0]) / (done[-1][1] - done[0][1])
        last_step, last_epoch = done[-1]
        ax.set_title(f"{per_epoch:,.1f} steps per epoch; epoch {last_epoch:.2f} at step {last_step}", fontsize="small")


def _smoothed_curve(ax: Any, records: list[dict[str, Any]], key: str, **style: Any) -> Line2D | None:
    """Draw `key` raw (faint, unlabelled) and smoothed (labelled `key`) on `ax`; the smoothed line, or None
    when `key` has no finite value."""
    steps, values = _series(records, key)
    if not any(math.isfinite(v) for v in values):
        return None
    return _draw(ax, key, Curve(steps, values, smoothed(values)), **style)


def _draw(ax: Any, key: str, curve: Curve, **style: Any) -> Line2D:
    """Draw `curve` raw (faint, unlabelled) and smoothed (labelled `key`) on `ax`; the smoothed line."""
    (line,) = ax.plot(curve.steps, curve.smoothed, label=key, **style)
    ax.plot(
        curve.steps,
        curve.values,
        color=line.get_color(),
        alpha=_RAW_ALPHA,
        linewidth=0.8,
        zorder=line.get_zorder() - 0.5,
    )
    return line


def main(argv: list[str] | None = None) -> int:
    """`python -m h3train.tools.curves METRICS_JSONL OUT_PNG`; exit code 2 with one line on bad input."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m h3train.tools.curves METRICS_JSONL OUT_PNG", file=sys.stderr)
        return 2
    try:
        out = plot_metrics(args[0], args[1])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
