"""Per-step metrics: an append-only `metrics.jsonl`, a console progress display, optional wandb.

`metrics.jsonl` is the record of truth. wandb is best effort: if it cannot start or a later log call
fails, one warning is emitted and the run continues with the JSONL file alone, because a
training job should never die (or hang) over a dashboard. wandb starts on a thread of its own, so
the training thread (and the other ranks, in their collectives) never wait for it: rows logged
before it is up are held and sent once it is; if it is not up `init_timeout_s` (+ a grace) after
the start, it is given up with one warning.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

from ..atomic import atomic_write_text, free_name
from ..config import WandbConfig

# Beyond wandb's own init timeout, how long its start may take before the run gives up on it; and at
# the end of a run, how long rank 0 still waits for it (the other ranks wait in the closing barrier).
_WANDB_GRACE_S = 5.0
# Rows held for wandb while it starts (beyond these the oldest are not sent; the JSONL has them all).
_WANDB_HELD_ROWS = 1000

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
# Lists the keys of a record whose values were NaN or infinite, written as null.
NONFINITE_KEY = "nonfinite"

# Without a TTY the bar is replaced by plain lines; this caps how many a run prints.
_MAX_PLAIN_LINES = 50
# Keys shown on the console, in this order, when present.
_CONSOLE_KEYS = ("loss", "grad_norm", "lr")


def write_resolved_config(log_dir: str | os.PathLike[str], yaml_text: str) -> Path:
    """Write the fully resolved run configuration to `<log_dir>/config.yaml` atomically; return its path.

    An earlier attempt's `config.yaml` that differs (a resume with changed overrides) is kept as
    `config.yaml.previous-<n>` (n = 1, 2, ... in order), so every attempt's configuration survives.
    """
    path = Path(log_dir) / CONFIG_FILE
    if path.is_file() and path.read_text(encoding="utf-8") != yaml_text:
        n = 1
        while os.path.lexists(path.with_name(f"{CONFIG_FILE}.previous-{n}")):
            n += 1
        os.replace(path, path.with_name(f"{CONFIG_FILE}.previous-{n}"))
    atomic_write_text(path, yaml_text)
    return path


def _jsonable(value: Any) -> Any:
    """Plain Python scalars for `json.dumps`; 0-d tensors and numpy scalars are unwrapped."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return float(value)


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with non-finite floats as None and their keys listed under `nonfinite` (strict JSON)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    out = {k: (None if k in bad else v) for k, v in record.items()}
    out[NONFINITE_KEY] = bad
    return out


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


def _format_value(key: str, value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key == "lr":
        return f"{value:.3e}"
    return f"{value:.4g}" if key == "grad_norm" else f"{value:.4f}"


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        # stderr may be replaced by an object without isatty, or already closed.
        return False


class MetricsLogger:
    """Log one metrics dict per optimizer step to JSONL, the console and (optionally) wandb.

    Only the main rank does anything; on every other rank each method is a no-op, so callers can
    construct and call it unconditionally.

    `metrics.jsonl` is opened for appending so a resumed run extends the same file. Lines whose
    step is after `start_step` belong to steps that the resumed run is about to redo (they were
    logged after the checkpoint it resumes from): when the logger opens they move, with any
    unparseable line (e.g. one torn by a crash mid-write), to `metrics.jsonl.abandoned-<start_step>`,
    never deleted, so the steps in `metrics.jsonl` stay strictly increasing. Every line is strict
    JSON: a NaN or infinite value is written as `null` and its key listed in `"nonfinite"`, so jq,
    JavaScript and Go read every line.

    The console shows a tqdm bar on a TTY when `progress` is true; otherwise (log files, CI) a
    plain line is printed to stderr every few steps, at most about 50 per run.
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
    ) -> None:
        self.is_main = is_main
        self.log_dir = Path(log_dir)
        self.path = self.log_dir / METRICS_FILE
        self.total_steps = total_steps
        self.start_step = start_step
        self._fh: IO[str] | None = None
        self._bar: tqdm | None = None
        self._wandb_run: Any = None
        self._wandb_warned = False
        # The start on its own thread: its outcome (run or error), its deadline, and the rows held for it.
        self._wandb_start: threading.Thread | None = None
        self._wandb_outcome: tuple[Any, BaseException | None] = (None, None)
        self._wandb_deadline = 0.0
        self._wandb_timeout_s = 0.0
        self._wandb_held: list[tuple[Callable[[], dict[str, Any]], int]] = []
        self._closed = False
        self._exit_code = 0
        self._plain_every = max(1, math.ceil(max(1, total_steps - start_step) / _MAX_PLAIN_LINES))
        self._plain_last_time = time.monotonic()
        self._plain_last_step = start_step
        if not is_main:
            return

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._set_aside_later_lines()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

        # wandb first: its start-up output or failure warning would otherwise break the bar's line.
        if wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            self._init_wandb(wandb_cfg, run_config)

        # Console s/step should measure training, not wandb start-up.
        self._plain_last_time = time.monotonic()
        if progress and _stderr_is_tty():
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    # -- setup -------------------------------------------------------------------------------

    def _set_aside_later_lines(self) -> None:
        set_aside_later_lines(self.path, self.start_step)

    def _init_wandb(self, cfg: WandbConfig, run_config: dict[str, Any]) -> None:
        """Start wandb on a thread of its own; `_wandb_ready` collects the outcome on the training thread."""
        # wandb's own console lines (login checks, sync hints) stay out of the run's output, unless asked for.
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb_timeout_s = cfg.init_timeout_s
        self._wandb_deadline = time.monotonic() + cfg.init_timeout_s + _WANDB_GRACE_S
        self._wandb_start = threading.Thread(
            target=self._start_wandb, args=(cfg, run_config), name="h3train-wandb-start", daemon=True
        )
        self._wandb_start.start()

    def _start_wandb(self, cfg: WandbConfig, run_config: dict[str, Any]) -> None:
        try:
            import wandb

            # Online without credentials, wandb.init would show an interactive API-key prompt on a
            # TTY; check without prompting.
            if cfg.mode == "online" and not wandb.login(prompt=False, verify=False):
                raise RuntimeError("no API key configured; run `wandb login` or set WANDB_API_KEY")
            run = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                mode=cfg.mode,
                config=run_config,
                dir=str(self.log_dir),
                # Silent, and the run's own stdout and stderr are left alone: its console is h3train's.
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, silent=True, console="off"),
            )
            self._wandb_outcome = (run, None)
        except Exception as exc:  # noqa: BLE001 - no network, bad key, timeout: all non-fatal
            self._wandb_outcome = (None, exc)

    def _wandb_ready(self, final: bool = False) -> bool:
        """Whether wandb runs, settling its start (on the training thread) once it ended or ran out of time.

        `final`: the run is ending; wait for the start at most `_WANDB_GRACE_S` more (the other ranks
        wait in the closing barrier meanwhile), then settle it either way.
        """
        start = self._wandb_start
        if start is None:
            return self._wandb_run is not None
        if final:
            start.join(max(0.0, min(self._wandb_deadline - time.monotonic(), _WANDB_GRACE_S)))
        if start.is_alive() and time.monotonic() < self._wandb_deadline and not final:
            return False
        self._wandb_start = None
        held, self._wandb_held = self._wandb_held, []
        run, error = self._wandb_outcome
        if start.is_alive():
            self._warn_wandb("did not start", TimeoutError(f"no answer within {self._wandb_timeout_s:g} s"))
            return False
        if error is not None:
            self._warn_wandb("could not start", error)
            return False
        self._wandb_run = run
        for values, step in held:
            self._wandb_log(values, step)
        return self._wandb_run is not None

    def _warn_wandb(self, what: str, exc: BaseException, stacklevel: int = 3) -> None:
        if self._wandb_warned:
            return
        self._wandb_warned = True
        detail = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {detail[0]}" if detail else type(exc).__name__
        warnings.warn(
            f"wandb {what} ({reason}); wandb logging is off for this run, metrics continue in {self.path}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    # -- logging -----------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` for optimizer step `step` (1-based: the step just completed)."""
        if not self.is_main or self._closed:
            return
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if key != "step":
                record[key] = _jsonable(value)

        self._write_line(record)
        self._console(record)
        self._wandb_log(lambda: {k: v for k, v in record.items() if k != "step"}, record["step"])

    def _write_line(self, record: dict[str, Any]) -> None:
        assert self._fh is not None
        try:
            self._fh.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
            # Flushed per line so `tail -f` and a crash both see every completed step.
            self._fh.flush()
        except OSError as exc:
            # A file object's error names no file; a full disk must say which one.
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def _wandb_log(self, values: Callable[[], dict[str, Any]], step: int) -> None:
        """`wandb.log(values(), step)` when wandb runs (held while it starts); a failure warns once and
        turns wandb off."""
        if self._wandb_start is not None and not self._wandb_ready():
            if self._wandb_start is not None and len(self._wandb_held) < _WANDB_HELD_ROWS:
                self._wandb_held.append((values, step))
            return
        if self._wandb_run is None:
            return
        try:
            self._wandb_run.log(values(), step=int(step))
        except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
            self._warn_wandb("failed to log", exc)
            self._finish_wandb(exit_code=1)

    def log_validation(self, step: int, metrics: dict[str, float]) -> None:
        """Record a held-out evaluation after step `step` (0: before training) as a row of its own.

        The row carries `"kind": "validation"`; training rows have no `kind`. wandb gets the values
        at the same step as the training row, so both curves share the x axis.
        """
        if not self.is_main or self._closed:
            return
        record: dict[str, Any] = {"step": int(step), "kind": "validation"}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._write_line(record)
        shown = " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if "@" not in k and isinstance(v, float))
        message = f"validation after step {step}: {shown}"
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)
        self._wandb_log(lambda: {k: v for k, v in record.items() if k not in ("step", "kind")}, step)

    def log_videos(self, step: int, videos: dict[str, tuple[Path, str]]) -> None:
        """Log rendered clips `{name: (mp4 path, caption)}` to wandb as videos `samples/<name>` at step `step`.

        Only wandb gets them (`metrics.jsonl` holds numbers); the files stay where they were written.
        """
        if not self.is_main or self._closed or (self._wandb_run is None and self._wandb_start is None) or not videos:
            return

        def media() -> dict[str, Any]:
            import wandb

            return {f"samples/{name}": wandb.Video(str(path), caption=text) for name, (path, text) in videos.items()}

        self._wandb_log(media, step)

    def _console(self, record: dict[str, Any]) -> None:
        step = record["step"]
        shown = [(k, record[k]) for k in _CONSOLE_KEYS if k in record]
        if self._bar is not None:
            postfix = " ".join(f"{k}={_format_value(k, v)}" for k, v in shown if k != "lr")
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            return
        done = step - self.start_step
        if not (done == 1 or done % self._plain_every == 0 or step >= self.total_steps):
            return
        now = time.monotonic()
        steps = max(1, step - self._plain_last_step)
        per_step = (now - self._plain_last_time) / steps
        self._plain_last_time, self._plain_last_step = now, step
        fields = " ".join(f"{k}={_format_value(k, v)}" for k, v in shown)
        print(f"step {step}/{self.total_steps} {fields} ({per_step:.2f} s/step)", file=sys.stderr, flush=True)

    # -- teardown ----------------------------------------------------------------------------

    def _finish_wandb(self, exit_code: int) -> None:
        run, self._wandb_run = self._wandb_run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - shutdown of an optional logger
            self._warn_wandb("failed to finish", exc, stacklevel=4)

    def close(self) -> None:
        """Close the bar, finish wandb, close the file. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        # Rows held while wandb started are sent if it comes up in time; the run never waits past that.
        self._wandb_ready(final=True)
        self._finish_wandb(self._exit_code)
        if self._fh is not None:
            fh, self._fh = self._fh, None
            # Only a row whose write already failed (and was raised, naming the file) is unflushed.
            with contextlib.suppress(OSError):
                fh.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Marks the wandb run as failed when training raised.
        if exc_type is not None:
            self._exit_code = 1
        self.close()
