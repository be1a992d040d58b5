"""The rules of an `h3train` process: what Ctrl-C raises, which rank reports an error, how it leaves.

A command's `H3TrainError` is one line on stderr and the error's exit code (2: a bad input, found
before any process group or model; 1: a run that could not go on); a full disk one line and 1; an
interrupt 130, said by the command that was running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import thread as executor_threads
from types import FrameType
from typing import NoReturn

from ..errors import H3TrainError
from ..train.events import INTERRUPTS, Interrupts


class CtrlC:
    """Ctrl-C raises `KeyboardInterrupt`, as Python's default handler does, and is noted in the process's
    interrupt record (`train.events.INTERRUPTS`), which the trainer's handler notes a second Ctrl-C in too.

    A library may turn the interrupt into another error: torch, building a tensor from a buffer
    when the interrupt lands, raises `ValueError("could not determine the shape of object type
    'torch.storage.UntypedStorage'")`, which a safetensors load then reports as an unreadable file.
    An error that follows a Ctrl-C is the Ctrl-C's (`caused`), so the user sees the interrupt, not a
    damaged components folder.
    """

    def __init__(self, record: Interrupts) -> None:
        self.record = record
        # A second Ctrl-C stopped a run (`commands.train`): `exit_after` leaves without waiting for its
        # background threads (a checkpoint write, a deletion), whose `.tmp-*` folders the next start removes.
        self.left_at_once = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002 - signal handler signature
        self.record.note()
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def watching(self) -> Iterator[CtrlC]:
        """Note Ctrl-C while the body runs, where Python's own handler is the one in place."""
        self.record.noted = self.left_at_once = False
        ours = threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        previous = signal.signal(signal.SIGINT, self._handle) if ours else None
        try:
            yield self
        finally:
            if ours:
                signal.signal(signal.SIGINT, previous)

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc` is an interrupt, or an error raised after one (the interrupt, disguised)."""
        return self.record.caused(exc)


CTRL_C = CtrlC(INTERRUPTS)


def code_of(command: Callable[[], int]) -> int:
    """`command()`'s exit code, Ctrl-C watched while it runs; an `H3TrainError` or a full disk is one line."""
    try:
        with CTRL_C.watching():
            return command()
    except H3TrainError as exc:
        report(exc)
        return exc.exit_code
    except BaseException as exc:
        # A write that ran out of space anywhere (a metrics line, an export shard, an encoded clip):
        # one line naming where, not a traceback. Checkpoint saves say more (`Checkpointer`).
        from ..infra.diskspace import full_disk_line, no_space

        full = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else no_space(exc)
        if full is None:
            raise
        print(f"h3train: error: {full_disk_line(full)}", file=sys.stderr)
        return 1


def report(exc: H3TrainError) -> None:
    """Print `exc` as one line where this rank speaks for it (`_reports_errors`).

    An error the ranks reached together (`exc.agreed`) is printed by rank 0 before any rank leaves:
    torchrun stops the ranks left as soon as one exits, which would cut rank 0 off before its line.
    """
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    if _reports_errors(exc):
        line = f"h3train: error: {exc}"
        print(line, file=sys.stderr, flush=True)
        _repeat_after_launcher(line)
    elif not grouped:
        # A silent rank before the process group: its node's first rank meets the same error and
        # prints it. Leaving at once could let torchrun stop that rank before its line (a loaded
        # node starts ranks seconds apart); the speaking rank's exit ends this wait.
        time.sleep(_SILENT_RANK_GRACE_S)
    if exc.agreed and grouped:
        # Leaving anyway if the barrier fails: the line above is what matters.
        with contextlib.suppress(Exception):
            dist.barrier()


# How long a rank that does not print a start-up error waits before it exits.
_SILENT_RANK_GRACE_S = 10.0

# How long the repeated line waits for torchrun to exit: it stops the other ranks (30 s at most) and
# reports; one still running after this is stuck elsewhere (another node), and the line is dropped.
_REPEAT_WAIT_S = 120.0

# Run by `_repeat_after_launcher` as `python -c _REPEAT PID LINE SECONDS`: LINE on stderr once the
# process PID is gone (or a zombie: a parent that reads this process's output reaps it only then).
_REPEAT = """
import sys, time
pid, line, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])

def running():
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(") ")[2][:1] not in ("Z", "X")
    except OSError:
        return False

while running() and time.monotonic() < deadline:
    time.sleep(0.05)
if not running():
    print(line, file=sys.stderr, flush=True)
"""


def _repeat_after_launcher(line: str) -> None:
    """Print `line` again once torchrun, this rank's parent, has exited, so that it is the last line.

    torchrun ends a failed run with its own report and a traceback of its own (about 40 lines): a
    tailed log would show `ChildFailedError` and not why. A process of its own (a session apart, so
    that torchrun's signals to the ranks miss it) waits for torchrun and repeats the line after
    the report. Only under torchrun (`TORCHELASTIC_RUN_ID`), in its last attempt: with restarts
    left it starts the ranks again, and a line repeated at its end would follow a later attempt's
    output (a run that then succeeded). On a system without `/proc` the line is repeated at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if restarts_left > 0:
        return
    import subprocess

    with contextlib.suppress(OSError):
        subprocess.Popen(
            [sys.executable, "-c", _REPEAT, str(os.getppid()), line, str(_REPEAT_WAIT_S)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )


def _reports_errors(exc: H3TrainError) -> bool:
    """Whether this process prints an `H3TrainError`, so that torchrun shows a bad input once, not once per rank.

    An error raised before the process group exists comes from the config, the command line or
    files, which the ranks of one node see alike: the node's first rank (`LOCAL_RANK` 0; rank 0
    on a single node) prints it, the others exit with the same code in silence. One rank per node
    speaks, because another node may lack a file this one has. After the process group exists an
    error may be this rank's alone (it cannot see the checkpoint rank 0 chose), so every rank prints,
    unless the ranks reached it together (`exc.agreed`): then rank 0 alone does.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or (int(os.environ.get("LOCAL_RANK", "0")) == 0 and not exc.agreed):
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized()) and not exc.agreed


def _joined_process_group() -> bool:
    # Not imported means no group: `init_distributed` lives there.
    dims = sys.modules.get("h3train.parallel.dims")
    return dims is not None and dims.joined_process_group()


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run `main()`, then leave with its code; after a process group, by an exit that skips the
    interpreter's final teardown.

    When the interpreter finalizes, a gloo worker thread may still be releasing the tensors of the
    run's last collective; it needs the GIL for that, a finalizing interpreter ends such a thread
    inside a C++ destructor, and the process aborts (SIGABRT, or SIGSEGV) after a run that
    succeeded. So everything the run owns is finished first, while the interpreter is whole (the
    threads that are not daemons joined, `atexit` handlers run, the standard streams flushed), and
    the process then leaves with `os._exit` and `main()`'s code; an uncaught exception is printed
    as the interpreter prints it and exits 1. A process that never joined a group (a bad input
    found first, `check`, `export`) exits the ordinary way. A run stopped by a second Ctrl-C
    (`CtrlC.left_at_once`) joins no thread: it stops at once, a write in progress with it.
    """
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        if not _joined_process_group():
            raise
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        if not _joined_process_group():
            raise
        traceback.print_exc()
        code = 1
    if not _joined_process_group():
        sys.exit(code)
    if CTRL_C.left_at_once:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Thread-pool workers (inductor's compile pool, for one) stop only when their executors are told
    # to, which interpreter shutdown does after this join; joining them first would wait forever.
    stop_executors = getattr(executor_threads, "_python_exit", None)
    if callable(stop_executors):
        stop_executors()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
