"""`metrics.jsonl`, the record of truth: one strict-JSON row per step and per evaluation."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from ...infra.atomic import atomic_write_text, free_name
from .record import RESUMED_KEY, strict_record, training_record, validation_record
from .sink import MetricSink

METRICS_FILE = "metrics.jsonl"


def set_aside_later_lines(path: Path, step: int) -> Path | None:
    """Move the lines of JSONL log `path` after `step` (and torn lines) to `<name>.abandoned-<step>`.

    A run resumed from step `step` redoes the later steps; their earlier record is kept beside the
    log, never deleted. Returns the file the lines went to, if any.
    """
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if not text:
        return None
    kept: list[str] = []
    later: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            line_step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            line_step = None
        (kept if isinstance(line_step, int) and line_step <= step else later).append(line)
    aside = None
    if later:
        aside = free_name(path.with_name(f"{path.name}.abandoned-{step}"))
        atomic_write_text(aside, "".join(f"{line}\n" for line in later))
    # A missing final newline would glue the next appended record onto the last line.
    if later or text != "".join(f"{line}\n" for line in kept):
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return aside


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of JSONL log `path`: each line that is a JSON object with an integer `step`, in order.

    Lines torn by a crash mid-write (undecodable bytes included) are passed over, as
    `set_aside_later_lines` sets them aside. Raises `OSError` when the file cannot be read.
    """
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                yield row


def first_row(path: Path, kind: str | None) -> dict[str, Any] | None:
    """The first row of JSONL log `path` whose `kind` is `kind` (None: training rows); None if none is."""
    if not path.is_file():
        return None
    return next((row for row in iter_rows(path) if row.get("kind") == kind), None)


class JsonlSink(MetricSink):
    """Appends each row to `<log_dir>/metrics.jsonl`, flushed per line.

    Opened for appending, so a resumed run extends the same file. Lines whose step is after the
    start step belong to steps the resumed run is about to redo: when the sink opens they move,
    with any unparseable line (e.g. one torn by a crash mid-write), to
    `metrics.jsonl.abandoned-<start step>`, never deleted, so the steps in the file stay strictly
    increasing. A NaN or infinite value is written as `null` and its key listed in `"nonfinite"`;
    a value the step did not have is `null` without that entry. The first training row of a
    resumed run carries `"resumed": true`.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.path = log_dir / METRICS_FILE
        self._fh: IO[str] | None = None
        self._resumed = False

    def open(self, start_step: int) -> None:
        self._resumed = start_step > 0
        self.log_dir.mkdir(parents=True, exist_ok=True)
        set_aside_later_lines(self.path, start_step)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        record = training_record(step, values)
        if self._resumed:
            record[RESUMED_KEY] = True
            self._resumed = False
        self._write_line(record)

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        self._write_line(validation_record(step, values))

    def _write_line(self, record: dict[str, Any]) -> None:
        assert self._fh is not None
        try:
            self._fh.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
            # Flushed per line so `tail -f` and a crash both see every completed step.
            self._fh.flush()
        except OSError as exc:
            # A file object's error names no file; a full disk must say which one.
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self, failed: bool = False) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            # Only a row whose write already failed (and was raised, naming the file) is unflushed.
            with contextlib.suppress(OSError):
                fh.close()
