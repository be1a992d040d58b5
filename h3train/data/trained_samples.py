"""The trained-samples log (`logging.sample_ids`): its files, and the reader that says what each step trained.

Files, under `<logging.dir>/trained_samples/`:

- `dp<R>.jsonl`, one per data-parallel rank R (written by SP rank 0 of DP group R alone, so no two
  processes append to one file): a JSON line per micro-batch,
  `{"attempt": A, "step": S, "micro": M, "dp_rank": R, "samples": [ids]}`, the ids of a pack in pack
  order. A step's lines are written together once the step is done (`after_step`), so a step cut
  short by a crash leaves none (at most a torn last line, which readers skip).
- `attempts.jsonl`, written by rank 0 alone: a JSON line per start of the run (an *attempt*),
  written before any record of it, `{"attempt": A, "started_at_step": S0, "layout": {"dp", "sp",
  "dp_replicate", "grad_accum", "pack", "balance", "global_batch"}, "previous_last_step": L,
  "supersedes": [earlier attempts]}`. Attempts are numbered 1, 2, ... in the order they started;
  `started_at_step` is the step the attempt resumed from (0: a fresh start); `previous_last_step` the
  last step the attempt before it recorded (null: none); `supersedes` the earlier attempts that hold
  records of steps after `started_at_step` still in force until this attempt started.

Supersession: a record of attempt A and step S is superseded when a later attempt B started at a
step below S (`started_at_step(B) < S`): B trained S again, so A's record is history, not what the
run's weights saw. This holds whatever rank wrote the record, so the file of a DP rank that a resume
on fewer ranks no longer has (its last lines are steps the resume redid) is covered too. Records
without an `attempt` (written before attempts were recorded) read as attempt 0, older than every
attempt in `attempts.jsonl`; the files are only ever appended to.

`trained_samples(log_dir)` reads the files back applying the supersession: step -> the ids it
trained over all DP ranks, ordered by (dp_rank, micro, pack order). `attempts(log_dir)` reads
`attempts.jsonl`. A step that an attempt completed and that no later attempt redid reads as trained,
even when no checkpoint kept its update (a run that stopped for good after it).

The hook that writes the log is `train/sample_log.py`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FOLDER = "trained_samples"
ATTEMPTS_FILE = "attempts.jsonl"
_RANK_FILE = re.compile(r"dp(\d+)\.jsonl")
# Records without an attempt (before attempts were recorded) belong to this one.
LEGACY_ATTEMPT = 0


def begin_attempt(folder: Path, started_at_step: int, layout: dict[str, Any]) -> int:
    """Rank 0 at a start: number the new attempt, append its line to `attempts.jsonl` (durably), return it.

    Runs while no process writes the rank files (before this start's first record), so each file's
    last record is the last one the previous attempt wrote there: its last step is read from the
    files' ends, not by reading the files through.
    """
    folder.mkdir(parents=True, exist_ok=True)
    earlier = attempts(folder.parent)
    tails = [record for path in rank_files(folder) if (record := _last_record(path)) is not None]
    numbers = [a["attempt"] for a in earlier] + [_attempt_of(r) for r in tails]
    previous = max(numbers, default=None)
    attempt = (previous if previous is not None else LEGACY_ATTEMPT) + 1
    previous_last = max((r["step"] for r in tails if _attempt_of(r) == previous), default=None)
    entry = {
        "attempt": attempt,
        "started_at_step": started_at_step,
        "layout": layout,
        "previous_last_step": previous_last,
        "supersedes": _superseded(earlier, previous, previous_last, started_at_step),
    }
    with open(folder / ATTEMPTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return attempt


def _superseded(
    earlier: list[dict[str, Any]], previous: int | None, previous_last: int | None, started_at_step: int
) -> list[int]:
    """The earlier attempts with records of steps after `started_at_step` still in force (module docstring).

    An attempt's records in force are the steps after its start, up to the last it recorded and up to
    the start of every later attempt. Each attempt's last step is in the line of the attempt after it
    (`previous_last_step`), the previous attempt's in `previous_last`.
    """
    started = {a["attempt"]: a["started_at_step"] for a in earlier}
    last = {a["attempt"] - 1: a.get("previous_last_step") for a in earlier}
    if previous is not None:
        last[previous] = previous_last
        started.setdefault(previous, 0)
    started.setdefault(LEGACY_ATTEMPT, 0)
    out = []
    for attempt in sorted(last):
        reached = last[attempt]
        if reached is None or attempt not in started:
            continue
        limit = min([reached, *(s for a, s in started.items() if a > attempt)])
        if limit > max(started_at_step, started[attempt]):
            out.append(attempt)
    return out


# -- reading the log back ------------------------------------------------------------------------


def attempts(log_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of `<log_dir>/trained_samples/attempts.jsonl` in order (torn lines skipped); [] when none."""
    path = Path(log_dir) / FOLDER / ATTEMPTS_FILE
    if not path.is_file():
        return []
    return [
        r for r in _records(path) if isinstance(r.get("attempt"), int) and isinstance(r.get("started_at_step"), int)
    ]


def trained_samples(log_dir: str | Path) -> dict[int, list[str]]:
    """Step -> the sample ids the step trained, over every DP rank, in (dp_rank, micro, pack order).

    Applies the supersession of the module docstring: of a step trained more than once, only the
    last attempt's records count, whichever ranks wrote the earlier ones. Steps in ascending order.
    """
    folder = Path(log_dir) / FOLDER
    starts = {a["attempt"]: a["started_at_step"] for a in attempts(log_dir)}
    cache: dict[int, float] = {}

    def cutoff(attempt: int) -> float:
        """The last step of `attempt` still in force: just before a later attempt's start."""
        if attempt not in cache:
            cache[attempt] = min((s for a, s in starts.items() if a > attempt), default=float("inf"))
        return cache[attempt]

    kept: dict[int, list[tuple[int, int, list[str]]]] = {}
    for path in rank_files(folder):
        file_rank = _rank_of(path)
        for record in _records(path):
            step, micro, ids = record.get("step"), record.get("micro"), record.get("samples")
            if not (isinstance(step, int) and isinstance(micro, int) and isinstance(ids, list)):
                continue
            if step > cutoff(_attempt_of(record)):
                continue
            kept.setdefault(step, []).append((int(record.get("dp_rank", file_rank)), micro, ids))
    # A record's own `dp_rank` and `micro` order the step's ids; the files may be read in any order.
    return {
        step: [i for *_, ids in sorted(rows, key=lambda r: r[:2]) for i in ids] for step, rows in sorted(kept.items())
    }


def rank_files(folder: Path) -> list[Path]:
    """The `dp<R>.jsonl` files of a `trained_samples` folder, by rank."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _RANK_FILE.fullmatch(p.name)), key=_rank_of)


def _rank_of(path: Path) -> int:
    """R of a `dp<R>.jsonl` file."""
    match = _RANK_FILE.fullmatch(path.name)
    assert match is not None, path
    return int(match.group(1))


def _attempt_of(record: Mapping[str, Any]) -> int:
    attempt = record.get("attempt")
    return attempt if isinstance(attempt, int) else LEGACY_ATTEMPT


def _records(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file; a torn line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def _last_record(path: Path) -> dict[str, Any] | None:
    """The last complete record of a JSONL file, reading back from its end only as far as it needs."""
    size = path.stat().st_size
    window = 4096
    with open(path, "rb") as f:
        while True:
            start = max(0, size - window)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
            # The first piece may be a line cut by the window; the last is what follows the final newline.
            complete = lines[1:-1] if start > 0 else lines[:-1]
            for line in reversed(complete):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    return record
            if start == 0:
                return None
            window *= 4


def end_torn_line(path: Path) -> None:
    """End a file whose last line a crash cut short, so the next record starts a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
