"""`h3train train CONFIG [key=value ...]`: train from a YAML config, alone or under torchrun.

Exit codes: 0 done or stopped by a preemption signal; 130 Ctrl-C; `train.guard.GUARD_EXIT` stopped by
validation.guard; 1 a collective failed or the run could not go on; 2 a bad input, before any work.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ..errors import H3TrainError
from .arguments import Parser
from .process import CTRL_C, report

if TYPE_CHECKING:
    from ..config import Config
    from ..train.trainer import Trainer

NAME = "train"
HELP = "train from a YAML config (alone or under torchrun)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.sp=2")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a folder that holds an earlier run, moving it into <logging.dir>/previous-<n>",
    )


def run(args: argparse.Namespace) -> int:
    from ..config import load_config

    # `build_trainer` checks the config (`run/preflight.preflight`) before any process group.
    cfg = load_config(args.config, args.overrides)
    from ..run.assemble import build_trainer

    try:
        trainer = build_trainer(cfg, overwrite=args.overwrite)
    except BaseException as exc:
        if not CTRL_C.caused(exc):
            raise
        print("h3train: interrupted during start-up; nothing was trained", file=sys.stderr)
        return 130
    try:
        trainer.fit()
    except BaseException as exc:
        code = _fit_failed(trainer, cfg, exc)
        if code is None:
            # No barrier: the other ranks may be blocked in a collective this rank will never join.
            trainer.close(clean=False)
            raise
        return code
    try:
        trainer.close()
    except BaseException as exc:
        if not CTRL_C.caused(exc):
            raise
        return _stop_at_once(trainer)
    # Ctrl-C exits as an interrupted program does; a preemption signal is a clean stop (exit 0); a
    # run stopped by validation.guard says so in its status.
    if trainer.guard_stop is not None:
        from ..train.guard import GUARD_EXIT

        return GUARD_EXIT
    return 130 if trainer.interrupted else 0


def _fit_failed(trainer: Trainer, cfg: Config, exc: BaseException) -> int | None:
    """The exit code of a run that `exc` ended, its one line printed; None: `exc` is to be raised."""
    if CTRL_C.caused(exc):
        return _stop_at_once(trainer)
    if isinstance(exc, H3TrainError):
        report(exc)
        trainer.close(clean=False)
        return exc.exit_code
    if not isinstance(exc, RuntimeError) or not _is_collective_failure(exc):
        return None
    # A peer died or a collective timed out (parallel.timeout_s): say what this rank waited for.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(
        f"h3train: error: rank {trainer.ctx.rank}: collective failed during {trainer.phase} "
        f"(parallel.timeout_s={cfg.parallel.timeout_s}): {first}",
        file=sys.stderr,
        flush=True,
    )
    trainer.close(clean=False)
    return 1


def _stop_at_once(trainer: Trainer) -> int:
    """A second Ctrl-C (`KeyboardInterrupt`, or the error DCP made of it inside a save): one line, exit 130.

    No save commits after it and nothing waits for the background work (`CtrlC.left_at_once`);
    a further Ctrl-C meanwhile is ignored, as the process is already on its way out.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        CTRL_C.left_at_once = True
        line = trainer.stop_at_once()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"h3train: {line}", file=sys.stderr, flush=True)
        trainer.close(clean=False)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    return 130


# The last two are torch's under TORCH_DISTRIBUTED_DEBUG=DETAIL, whose groups check every collective.
_COLLECTIVE_FAILURE_MARKS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "timed out",
    "timeout",
    "failed to pass monitoredbarrier",
    "mismatch between collectives",
)


def _is_collective_failure(exc: RuntimeError) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or any(m in str(exc).lower() for m in _COLLECTIVE_FAILURE_MARKS)
