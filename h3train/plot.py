"""Render a run's `metrics.jsonl` into a PNG: losses on top (held-out loss beside them), gradient norm below.

Usage: `python -m h3train.plot runs/x/metrics.jsonl runs/x/metrics.png`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

# Drawn through the Agg canvas directly rather than pyplot, so plotting never touches (or is
# affected by) the process-wide pyplot backend and works on machines without a display.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .errors import UsageError

_LOSS_KEYS = ("loss", "loss_video", "loss_audio")
# Held-out rows (`"kind": "validation"`) drawn beside the training losses.
_VALIDATION_KEYS = ("val/loss", "val/loss_video", "val/loss_audio")


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
    records: list[dict[str, Any]] = []
    try:
        # Undecodable bytes (a binary file, a torn write) become lines that fail to parse below.
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    # A line torn by a crash mid-write should not stop the rest from plotting.
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    records.append(record)
    except OSError as exc:
        raise UsageError(f"metrics file '{path}' cannot be read: {exc.strerror or exc}") from None
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`; null entries (non-finite values written as strict JSON) are skipped."""
    points = [(r["step"], _as_float(r[key])) for r in records if r.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def plot_metrics(metrics_path: str | os.PathLike[str], out_png: str | os.PathLike[str]) -> Path:
    """Plot loss (and `loss_video` / `loss_audio` when logged) and `grad_norm` against step.

    Writes one PNG with two stacked axes sharing the step axis and returns its path. A null value
    (strict JSON's stand-in for a non-finite one) is skipped. Raises `UsageError` (a `ValueError`) naming the file if
    it is missing, holds no step records, or no `loss` values, or if the PNG cannot be written.
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
    """The figure `plot_metrics` writes: training losses and held-out losses on top, grad_norm below."""
    path = Path(metrics_path)
    everything = read_metrics(path)
    records = [r for r in everything if r.get("kind") is None]
    validation = [r for r in everything if r.get("kind") == "validation"]
    if not records:
        raise UsageError(
            f"metrics file '{path}' holds no step records (JSON lines with a 'step'); pass a run's "
            "<logging.dir>/metrics.jsonl once it has logged a step"
        )
    if not any(math.isfinite(v) for v in _series(records, "loss")[1]):
        raise UsageError(f"metrics file '{path}' has no finite 'loss' values to plot")

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_grad = fig.subplots(2, 1, sharex=True)

    for key in _LOSS_KEYS:
        steps, values = _series(records, key)
        if any(math.isfinite(v) for v in values):
            ax_loss.plot(steps, values, label=key, linewidth=1.2 if key == "loss" else 0.9)
    for key in _VALIDATION_KEYS:
        steps, values = _series(validation, key)
        if any(math.isfinite(v) for v in values):
            ax_loss.plot(steps, values, label=f"{key} (held out)", linestyle="--", marker="o", markersize=3)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.set_title(str(path))

    steps, values = _series(records, "grad_norm")
    finite = [v for v in values if math.isfinite(v)]
    if finite:
        ax_grad.plot(steps, values, color="tab:red", linewidth=1.0, label="grad_norm")
        # Gradient norms span orders of magnitude (spikes, clipping), so a log axis reads better.
        if all(v > 0 for v in finite):
            ax_grad.set_yscale("log")
    else:
        ax_grad.text(0.5, 0.5, "no grad_norm logged", ha="center", va="center", transform=ax_grad.transAxes)
    ax_grad.set_ylabel("grad_norm")
    ax_grad.set_xlabel("step")
    ax_grad.grid(True, alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> int:
    """`python -m h3train.plot METRICS_JSONL OUT_PNG`; exit code 2 with one line on bad input."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m h3train.plot METRICS_JSONL OUT_PNG", file=sys.stderr)
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
