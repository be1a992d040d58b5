"""Per-step metrics: an append-only `metrics.jsonl`, a console progress display, optional wandb and TensorBoard.

`metrics.jsonl` is the record of truth. The dashboards are best effort: if one cannot start or a
later call fails, one warning is emitted and the run continues with the JSONL file alone, because a
training job should never die (or hang) over a dashboard. `MetricsLogger` fans each row out to one
sink per destination (`sink.MetricSink`), each in a file of its own.
"""

from .console_sink import ConsoleSink, format_duration
from .jsonl_sink import METRICS_FILE, JsonlSink, first_row, iter_rows, set_aside_later_lines
from .logger import MetricsLogger
from .memory import peak_memory_gib, reset_peak_memory
from .record import MEMORY_KEY, NONFINITE_KEY, RESUMED_KEY, strict_record
from .sink import MetricSink
from .tensorboard_sink import TENSORBOARD_DIR, TensorBoardSink, _TensorBoard
from .wandb_sink import WandbSink

__all__ = [
    "MEMORY_KEY",
    "METRICS_FILE",
    "NONFINITE_KEY",
    "RESUMED_KEY",
    "TENSORBOARD_DIR",
    "ConsoleSink",
    "JsonlSink",
    "MetricSink",
    "MetricsLogger",
    "TensorBoardSink",
    "WandbSink",
    "_TensorBoard",
    "first_row",
    "format_duration",
    "iter_rows",
    "peak_memory_gib",
    "reset_peak_memory",
    "set_aside_later_lines",
    "strict_record",
]
