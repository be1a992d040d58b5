"""Per-step metrics: an append-only `metrics.jsonl`, a console progress display, optional wandb and TensorBoard.

`metrics.jsonl` is the record of truth. wandb is best effort: if it cannot start or a later log call
fails, one warning is emitted and the run continues with the JSONL file alone, because a
training job should never die (or hang) over a dashboard. wandb starts on a thread of its own, so
the training thread (and the other ranks, in their collectives) never wait for it: rows logged
before it is up are held and sent once it is; if it is not up `init_timeout_s` (+ a grace) after
the start, it is given up with one warning. TensorBoard (`logging.tensorboard`) is best effort too.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np
import torch
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
# `logging.tensorboard`'s event files, under `logging.dir`.
TENSORBOARD_DIR = "tensorboard"
# Lists the keys of a record whose values were NaN or infinite, written as null.
NONFINITE_KEY = "nonfinite"
# On the first training row a resumed run logs: true (the run went on from the step before it).
RESUMED_KEY = "resumed"
# The peak memory of a step, GiB (`peak_memory_gib`).
MEMORY_KEY = "mem_peak_gib"

# Without a TTY the bar is replaced by plain lines; this caps how many a run prints.
_MAX_PLAIN_LINES = 50
# Keys shown on the console, in this order, when present, and the name each is shown under.
_CONSOLE_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr", MEMORY_KEY: "peak_mem"}
# Rendered clips go to TensorBoard as GIFs no longer than this on their long edge (pixels).
_TENSORBOARD_GIF_EDGE = 320


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak for `peak_memory_gib` (the trainer calls it as each step starts); a no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory in GiB (2**30 bytes), the figure `mem_peak_gib` logs.

    CUDA: `torch.cuda.max_memory_allocated` on `device`, the tensors' bytes (not the caching
    allocator's reserve) since the last `reset_peak_memory`, so a training row holds the peak of
    its own step (forward, backward, optimizer; validation and rendering after the step are not
    counted). Elsewhere (CPU): the process's peak resident set size since it started
    (`getrusage().ru_maxrss`, kilobytes on Linux, bytes on macOS), which never goes down. Under
    torchrun each rank measures its own; the logged value is rank 0's.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 2**30


def format_duration(seconds: float) -> str:
    """`H:MM:SS` (hours keep counting past 24), as the console shows elapsed time and ETA."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


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
    if value is None:
        # Absent from the step (e.g. no clip with sound): not a number, so not shown as one.
        return "n/a"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key == "lr":
        return f"{value:.3e}"
    if key == MEMORY_KEY:
        return f"{value:.2f}GiB"
    return f"{value:.4g}" if key == "grad_norm" else f"{value:.4f}"


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a row the dashboards chart: every value but `step`, text, flags and null."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        # stderr may be replaced by an object without isatty, or already closed.
        return False


class MetricsLogger:
    """Log one metrics dict per optimizer step to JSONL, the console and (optionally) wandb and TensorBoard.

    Only the main rank does anything; on every other rank each method is a no-op, so callers can
    construct and call it unconditionally.

    `metrics.jsonl` is opened for appending so a resumed run extends the same file. Lines whose
    step is after `start_step` belong to steps that the resumed run is about to redo (they were
    logged after the checkpoint it resumes from): when the logger opens they move, with any
    unparseable line (e.g. one torn by a crash mid-write), to `metrics.jsonl.abandoned-<start_step>`,
    never deleted, so the steps in `metrics.jsonl` stay strictly increasing. Every line is strict
    JSON: a NaN or infinite value is written as `null` and its key listed in `"nonfinite"`, so jq,
    JavaScript and Go read every line. A value the step did not have (`loss_audio` of a step
    without sound) is `null` too, without a `nonfinite` entry. The first training row of a resumed
    run carries `"resumed": true`.

    The console shows a tqdm bar on a TTY when `progress` is true; otherwise (log files, CI) a
    plain line is printed to stderr every few steps, at most about 50 per run:
    `step 20/40 loss=0.1234 grad_norm=0.8123 lr=1.000e-03 peak_mem=1.52GiB (0.31 s/step, elapsed
    0:00:06, eta 0:00:06)`. Elapsed time counts from `start_clock` (the first step of this process,
    so a resumed run times its own steps) and the ETA extrapolates its mean time per step to
    `total_steps`. `show` prints a step's line as soon as the step is done; `log` prints it when
    `show` did not.

    With `tensorboard`, the same numbers (and the rendered clips of `log_videos`) also go to
    TensorBoard event files in `<log_dir>/tensorboard`; a resumed run hides the earlier events of
    the steps it redoes (TensorBoard's `purge_step`).
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
        self._plain_last_time = self._clock_start = time.monotonic()
        self._plain_last_step = self._shown_step = start_step
        self._resumed = start_step > 0
        self._tensorboard: _TensorBoard | None = None
        if not is_main:
            return

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._set_aside_later_lines()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

        # wandb first: its start-up output or failure warning would otherwise break the bar's line.
        if wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            self._init_wandb(wandb_cfg, run_config)
        if tensorboard:
            self._with_tensorboard("start", self._open_tensorboard, start_step)

        # Console s/step should measure training, not wandb start-up.
        self.start_clock()
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

    def _open_tensorboard(self, start_step: int) -> None:
        self._tensorboard = _TensorBoard(self.log_dir / TENSORBOARD_DIR, start_step)

    def _with_tensorboard(self, what: str, action: Callable[..., None], *args: Any) -> None:
        """`action(*args)` (a TensorBoard write); a failure warns once and turns TensorBoard off."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
            board, self._tensorboard = self._tensorboard, None
            if board is not None:
                with contextlib.suppress(Exception):
                    board.close()
            detail = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {detail[0]}" if detail else type(exc).__name__
            warnings.warn(
                f"TensorBoard failed to {what} ({reason}); TensorBoard logging is off for this run, "
                f"metrics continue in {self.path}",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- logging -----------------------------------------------------------------------------

    def start_clock(self) -> None:
        """Time training from now: elapsed time, ETA and s/step on the console count from here.

        The trainer calls it right before its first step, after the start-up work (validation and
        rendering at step 0), which would otherwise inflate the first steps' time and the ETA.
        """
        self._clock_start = self._plain_last_time = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        """Seconds since `start_clock` (or since the logger opened, before it is called)."""
        return time.monotonic() - self._clock_start

    def show(self, step: int, metrics: dict[str, float | None]) -> None:
        """The console progress of optimizer step `step`: the bar, or a plain line every few steps.

        Called as soon as the step is done, so that what the step's hooks print (validation,
        rendering) comes after its line.
        """
        if not self.is_main or self._closed or step <= self._shown_step:
            return
        self._shown_step = step
        shown = [(k, metrics[k]) for k in _CONSOLE_KEYS if k in metrics]
        if self._bar is not None:
            postfix = " ".join(f"{_CONSOLE_KEYS[k]}={_format_value(k, v)}" for k, v in shown if k != "lr")
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
        fields = " ".join(f"{_CONSOLE_KEYS[k]}={_format_value(k, v)}" for k, v in shown)
        timing = f"{per_step:.2f} s/step, elapsed {format_duration(elapsed)}, eta {format_duration(eta)}"
        print(f"step {step}/{self.total_steps} {fields} ({timing})", file=sys.stderr, flush=True)

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Record `metrics` for optimizer step `step` (1-based: the step just completed).

        A None value is a quantity the step did not have: `null` in `metrics.jsonl`, left out of
        the dashboards. The console line is shown here unless `show` showed it already.
        """
        if not self.is_main or self._closed:
            return
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if key != "step":
                record[key] = _jsonable(value)
        if self._resumed:
            record[RESUMED_KEY] = True
            self._resumed = False

        self._write_line(record)
        self.show(record["step"], record)
        self._wandb_log(lambda: _scalars(record), record["step"])
        self._tensorboard_scalars(record)

    def _tensorboard_scalars(self, record: dict[str, Any]) -> None:
        if self._tensorboard is not None:
            self._with_tensorboard("log", self._tensorboard.scalars, record["step"], _scalars(record))

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

        The row carries `"kind": "validation"`; training rows have no `kind`. wandb and TensorBoard
        get the values at the same step as the training row, so both curves share the x axis.
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
        self._wandb_log(lambda: _scalars(record), step)
        self._tensorboard_scalars(record)

    def log_videos(self, step: int, videos: dict[str, tuple[Path, str]]) -> None:
        """Log rendered clips `{name: (mp4 path, caption)}` as `samples/<name>` at step `step`.

        wandb gets each as a video with its caption; TensorBoard as an animated GIF (at most
        320 pixels on its long edge, every frame at the clip's rate), its soundtrack (mono) as
        `samples/<name>/audio` and its prompt as text `samples/<name>/prompt`. `metrics.jsonl`
        holds numbers only; the files stay where they were written.
        """
        if not self.is_main or self._closed or not videos:
            return
        if self._wandb_run is not None or self._wandb_start is not None:

            def media() -> dict[str, Any]:
                import wandb

                return {
                    f"samples/{name}": wandb.Video(str(path), caption=text) for name, (path, text) in videos.items()
                }

            self._wandb_log(media, step)
        for name, (path, text) in videos.items():
            # Checked per clip: a failed one turns TensorBoard off.
            if self._tensorboard is not None:
                self._with_tensorboard(f"log clip '{path}'", self._tensorboard.clip, step, name, Path(path), text)

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
        if self._tensorboard is not None:
            board, self._tensorboard = self._tensorboard, None
            self._with_tensorboard("close", board.close)
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


class _TensorBoard:
    """Rank 0's TensorBoard event files in one folder (`torch.utils.tensorboard`, the `tensorboard` package).

    Scalars are written under the keys of `metrics.jsonl`; a clip as the GIF image summary that
    TensorBoard's own video summary writes, encoded here with Pillow (torch's `add_video` needs
    moviepy).
    """

    def __init__(self, folder: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            missing = f"logging.tensorboard needs the tensorboard package: pip install tensorboard ({exc})"
            raise ImportError(missing) from exc

        # A resumed run redoes the steps after `start_step`: TensorBoard hides what earlier event
        # files hold for them, as the steps' earlier rows leave `metrics.jsonl`.
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(str(folder), purge_step=purge, flush_secs=10)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def clip(self, step: int, name: str, path: Path, caption: str) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        from ..data.media import load_video

        video = load_video(path)
        gif, height, width = _gif(video.frames, video.fps)
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=f"samples/{name}", image=image)]), step)
        if video.audio is not None and video.sample_rate:
            mono = video.audio.float().mean(0, keepdim=True).clamp(-1.0, 1.0)
            self.writer.add_audio(f"samples/{name}/audio", mono, step, sample_rate=video.sample_rate)
        self.writer.add_text(f"samples/{name}/prompt", caption, step)

    def close(self) -> None:
        self.writer.close()


def _gif(frames: np.ndarray, fps: float) -> tuple[bytes, int, int]:
    """Frames `[T, H, W, 3]` uint8 as a looping GIF at most `_TENSORBOARD_GIF_EDGE` on its long edge: (bytes, h, w)."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    scale = min(1.0, _TENSORBOARD_GIF_EDGE / max(images[0].size))
    size = (max(1, round(images[0].width * scale)), max(1, round(images[0].height * scale)))
    images = [image.resize(size, Image.Resampling.BILINEAR) for image in images]
    out = io.BytesIO()
    # GIF delays are whole hundredths of a second.
    delay = max(20, 10 * round(100 / max(fps, 1e-3)))
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=delay, loop=0)
    return out.getvalue(), size[1], size[0]
