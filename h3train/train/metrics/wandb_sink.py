"""wandb, best effort: a run that cannot start or log warns once and goes on with the JSONL alone.

wandb starts on a thread of its own, so the training thread (and the other ranks, in their
collectives) never wait for it: rows logged before it is up are held and sent once it is; if it is
not up `init_timeout_s` (+ a grace) after the start, it is given up with one warning.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...config import WandbConfig
from .record import scalars, training_record, validation_record
from .sink import MetricSink, failure_reason

# Beyond wandb's own init timeout, how long its start may take before the run gives up on it; and at
# the end of a run, how long rank 0 still waits for it (the other ranks wait in the closing barrier).
_WANDB_GRACE_S = 5.0
# Rows held for wandb while it starts (beyond these the oldest are not sent; the JSONL has them all).
_WANDB_HELD_ROWS = 1000


class WandbSink(MetricSink):
    """The rows' numbers and the rendered clips (as videos) in a wandb run; nothing when `cfg` disables it.

    `metrics_path` is the JSONL file a warning names as where the metrics continue.
    """

    def __init__(self, cfg: WandbConfig, run_config: dict[str, Any], log_dir: Path, metrics_path: Path) -> None:
        self.cfg = cfg
        self.run_config = run_config
        self.log_dir = log_dir
        self.metrics_path = metrics_path
        #: The wandb run logged to, once started.
        self.run: Any = None
        self._warned = False
        # The start on its own thread: its outcome (run or error), its deadline, and the rows held for it.
        self._start: threading.Thread | None = None
        self._outcome: tuple[Any, BaseException | None] = (None, None)
        self._deadline = 0.0
        self.held: list[tuple[Callable[[], dict[str, Any]], int]] = []

    def open(self, start_step: int) -> None:
        """Start wandb on a thread of its own; `ready` collects the outcome on the training thread."""
        cfg = self.cfg
        if not cfg.enabled or cfg.mode == "disabled":
            return
        # wandb's own console lines (login checks, sync hints) stay out of the run's output, unless asked for.
        os.environ.setdefault("WANDB_SILENT", "true")
        self._deadline = time.monotonic() + cfg.init_timeout_s + _WANDB_GRACE_S
        self._start = threading.Thread(target=self._start_run, name="h3train-wandb-start", daemon=True)
        self._start.start()

    def _start_run(self) -> None:
        cfg = self.cfg
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
                config=self.run_config,
                dir=str(self.log_dir),
                # Silent, and the run's own stdout and stderr are left alone: its console is h3train's.
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, silent=True, console="off"),
            )
            self._outcome = (run, None)
        except Exception as exc:  # noqa: BLE001 - no network, bad key, timeout: all non-fatal
            self._outcome = (None, exc)

    def ready(self, final: bool = False) -> bool:
        """Whether wandb runs, settling its start (on the training thread) once it ended or ran out of time.

        `final`: the run is ending; wait for the start at most `_WANDB_GRACE_S` more (the other ranks
        wait in the closing barrier meanwhile), then settle it either way.
        """
        start = self._start
        if start is None:
            return self.run is not None
        if final:
            start.join(max(0.0, min(self._deadline - time.monotonic(), _WANDB_GRACE_S)))
        if start.is_alive() and time.monotonic() < self._deadline and not final:
            return False
        self._start = None
        held, self.held = self.held, []
        run, error = self._outcome
        if start.is_alive():
            self._warn("did not start", TimeoutError(f"no answer within {self.cfg.init_timeout_s:g} s"))
            return False
        if error is not None:
            self._warn("could not start", error)
            return False
        self.run = run
        for values, step in held:
            self._log(values, step)
        return self.run is not None

    def _warn(self, what: str, exc: BaseException, stacklevel: int = 4) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"wandb {what} ({failure_reason(exc)}); wandb logging is off for this run, metrics continue in "
            f"{self.metrics_path}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    def _log(self, values: Callable[[], dict[str, Any]], step: int) -> None:
        """`wandb.log(values(), step)` when wandb runs (held while it starts); a failure warns once and
        turns wandb off."""
        if self._start is not None and not self.ready():
            if self._start is not None and len(self.held) < _WANDB_HELD_ROWS:
                self.held.append((values, step))
            return
        if self.run is None:
            return
        try:
            self.run.log(values(), step=int(step))
        except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
            self._warn("failed to log", exc)
            self._finish(exit_code=1)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        record = training_record(step, values)
        self._log(lambda: scalars(record), record["step"])

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        record = validation_record(step, values)
        self._log(lambda: scalars(record), step)

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        if self.run is None and self._start is None:
            return

        def media() -> dict[str, Any]:
            import wandb

            return {f"samples/{name}": wandb.Video(str(path), caption=text) for name, (path, text) in videos.items()}

        self._log(media, step)

    def _finish(self, exit_code: int) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - shutdown of an optional logger
            self._warn("failed to finish", exc, stacklevel=5)

    def close(self, failed: bool = False) -> None:
        # Rows held while wandb started are sent if it comes up in time; the run never waits past that.
        self.ready(final=True)
        # Marks the wandb run as failed when training raised.
        self._finish(1 if failed else 0)
