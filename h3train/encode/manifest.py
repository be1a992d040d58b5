"""The encoding manifest: one JSON object per line, one clip per object.

    {"video": "clips/a.mp4", "prompt": "...", "task": "fl2va", "keyframes": "both"}
    {"video": "clips/b.mp4", "prompt": "...", "task": "fl2va", "keyframes": {"first": "stills/b0.png", "last": null}}
    {"video": "clips/c.mp4", "prompt": "...", "task": "ref2va",
     "references": [{"kind": "image", "path": "refs/face.png"}, {"kind": "audio", "path": "refs/voice.wav"}]}
    {"video": "clips/d.mp4", "prompt": "...", "task": "t2va", "negative_prompt": " ", "id": "d"}

Every path is relative to the manifest's folder and may not leave it: no absolute paths, no `..`,
and no symbolic link that resolves outside the folder.
`keyframes` (fl2va only) is `"first"`, `"last"`, `"both"`, a list of anchors, or an object mapping an
anchor to an image path, `null` meaning the clip's own frame. `references` (ref2va only) keep their
order: it is the packed order and numbers the labels of the prompt presentation.

A malformed manifest raises one `ManifestError` (a `ConfigError`: one line naming the file, and
every bad line with its field, the first few of many), so the CLI exits 2 before any model is
loaded. Problems with the media themselves are found while encoding and reported per clip.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ConfigError, did_you_mean
from ..tasks.conditioning import CONDITIONING_KINDS, Keyframe, Reference
from ..tasks.table import SAMPLE_TASKS, sample_task_of

DEFAULT_NEGATIVE_PROMPT = " "
_KEYS = {"video", "prompt", "task", "negative_prompt", "id", *CONDITIONING_KINDS}
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class ManifestError(ConfigError):
    """A manifest that cannot be used, reported in one line naming the file, the line and the field."""


@dataclass(frozen=True)
class MediaPath:
    """A media file named by the manifest: `relative` as written, `path` resolved inside the manifest folder."""

    relative: str
    path: Path

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the file's content cheaply: its name, size and modification time (None if missing)."""
        try:
            stat = self.path.stat()
        except OSError:
            return {"path": self.relative, "size": None, "mtime_ns": None}
        return {"path": self.relative, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@dataclass(frozen=True)
class ManifestEntry:
    """One clip of the manifest. `line` is 1-based; `keyframes` are in packed order (first, then last)."""

    line: int
    sample_id: str
    video: MediaPath
    prompt: str
    task: str
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()

    def fingerprint(self) -> dict[str, Any]:
        """Everything the encoded sample depends on from this entry, media files by `MediaPath.fingerprint`."""
        return {
            "id": self.sample_id,
            "video": self.video.fingerprint(),
            "prompt": self.prompt,
            "task": self.task,
            "negative_prompt": self.negative_prompt,
            "keyframes": [[k.anchor, k.image.fingerprint() if k.image else None] for k in self.keyframes],
            "references": [[r.kind, r.media.fingerprint()] for r in self.references],
        }


# A manifest with many bad lines names this many of them, then counts the rest.
_REPORTED_LINES = 5


# What a folder of clips is read for: video files, each with a same-named `.txt` caption.
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")
CAPTION_SUFFIX = ".txt"


def read_clip_folder(folder: str | os.PathLike) -> list[ManifestEntry]:
    """The clips of a folder (and its subfolders) as t2va entries: each video with a same-named
    `.txt` caption (`clips/a.mp4` + `clips/a.txt`), in sorted path order, ids from the paths as a
    manifest derives them. Raises one `ManifestError` naming every clip without a usable caption.

    `line` numbers the clips 1, 2, ... in that order. Keyframes and references need a manifest.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ManifestError(f"clip folder '{root}' does not exist")
    videos = sorted(
        p for p in root.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file() and not p.name.startswith(".")
    )
    if not videos:
        raise ManifestError(
            f"clip folder '{root}' holds no video ({', '.join(VIDEO_SUFFIXES)}); put clips with same-named "
            f"{CAPTION_SUFFIX} captions there, or pass a manifest"
        )
    rows, problems = [], []
    for video in videos:
        relative = video.relative_to(root).as_posix()
        caption = video.with_suffix(CAPTION_SUFFIX)
        try:
            prompt = caption.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            problems.append(f"'{relative}' has no caption '{caption.name}'")
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"caption '{caption.relative_to(root).as_posix()}' cannot be read as UTF-8 ({exc})")
            continue
        if not prompt:
            problems.append(f"caption '{caption.relative_to(root).as_posix()}' is empty")
            continue
        rows.append({"video": relative, "prompt": prompt})
    if problems:
        shown = "; ".join(problems[:_REPORTED_LINES])
        more = len(problems) - _REPORTED_LINES
        raise ManifestError(
            f"clip folder '{root}': {len(problems)} of {len(videos)} clips lack a caption: {shown}"
            + (f"; and {more} more" if more > 0 else "")
            + f" (each clip needs a same-named {CAPTION_SUFFIX} file with its prompt)"
        )
    return _entries(root.resolve(), rows, f"clip folder '{root}'")


def read_manifest(path: str | os.PathLike) -> list[ManifestEntry]:
    """Parse and validate a manifest. Raises one `ManifestError` naming every bad line.

    All lines are checked in one pass, so a manifest with several mistakes is fixed in one go: the
    message names the first few bad lines and counts the rest, still on one line.
    """
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest '{path}' does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest '{path}' cannot be read as UTF-8 text ({exc})") from None
    rows: dict[int, Any] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            rows[number] = json.loads(raw)
        except json.JSONDecodeError as exc:
            rows[number] = _LineError(f"not valid JSON ({exc})")
    return _entries(path.resolve().parent, rows, f"manifest '{path}'")


def _entries(folder: Path, rows: dict[int, Any] | list[dict[str, Any]], name: str) -> list[ManifestEntry]:
    """Validate `rows` (line number -> parsed JSON, or a list numbered from 1) of a manifest or clip folder.

    Raises one `ManifestError` starting with `name` that names every bad line (the first few of many).
    """
    numbered = rows if isinstance(rows, dict) else dict(enumerate(rows, start=1))
    entries: list[ManifestEntry] = []
    problems: list[tuple[int, str]] = []
    first_line_of: dict[str, int] = {}
    for number, row in numbered.items():
        try:
            if isinstance(row, _LineError):
                raise row
            entry = _parse_row(_Where(number), folder, row)
        except _LineError as exc:
            problems.append((number, str(exc)))
            continue
        if entry.sample_id in first_line_of:
            problems.append(
                (
                    number,
                    f"id '{entry.sample_id}' is already used on line {first_line_of[entry.sample_id]}; "
                    "give one of them an explicit 'id'",
                )
            )
            continue
        first_line_of[entry.sample_id] = number
        entries.append(entry)
    if len(problems) == 1:
        number, problem = problems[0]
        raise ManifestError(f"{name} line {number}: {problem}")
    if problems:
        shown = "; ".join(f"line {number}: {problem}" for number, problem in problems[:_REPORTED_LINES])
        more = len(problems) - _REPORTED_LINES
        raise ManifestError(f"{name}: {len(problems)} bad lines: {shown}" + (f"; and {more} more" if more > 0 else ""))
    if not entries:
        raise ManifestError(f"{name} lists no clips")
    return entries


class _LineError(Exception):
    """One line's problem, without the manifest's name: `read_manifest` gathers them into one error."""


@dataclass(frozen=True)
class _Where:
    line: int

    def error(self, field_name: str, problem: str) -> _LineError:
        return _LineError(f"field '{field_name}' {problem}")


def _parse_row(where: _Where, folder: Path, row: Any) -> ManifestEntry:
    if not isinstance(row, dict):
        raise _LineError("expected a JSON object")
    unknown = sorted(set(row) - _KEYS)
    if unknown:
        fields = sorted(_KEYS)
        raise where.error(
            unknown[0], f"is not a manifest field (fields: {', '.join(fields)}){did_you_mean(unknown[0], fields)}"
        )

    video = _media(where, folder, "video", _string(where, row, "video"))
    prompt = _string(where, row, "prompt", allow_empty=True)
    task = _string(where, row, "task") if "task" in row else _task_of(row)
    if task not in SAMPLE_TASKS:
        raise where.error(
            "task", f"is {task!r}, expected one of {', '.join(SAMPLE_TASKS)}{did_you_mean(task, SAMPLE_TASKS)}"
        )
    if SAMPLE_TASKS[task].conditioning is None and not prompt.strip():
        raise where.error("prompt", f"is {prompt!r}: a {task} clip is conditioned on its prompt alone; write one")
    negative = _string(where, row, "negative_prompt", allow_empty=True) if "negative_prompt" in row else None

    # The one conditioning field the task takes (`SampleTask.conditioning`); the others are refused.
    taken = SAMPLE_TASKS[task].conditioning
    conditioning: dict[str, tuple] = {}
    for name, kind in CONDITIONING_KINDS.items():
        if name == taken:
            media = partial(_media, where, folder)
            conditioning[name] = kind.parse_manifest(row.get(name), media, where.error)
        elif name in row:
            raise where.error(name, f"are for {kind.sample_task} clips, this one is {task}")

    return ManifestEntry(
        line=where.line,
        sample_id=_sample_id(where, row, video.relative),
        video=video,
        prompt=prompt,
        task=task,
        negative_prompt=DEFAULT_NEGATIVE_PROMPT if negative is None else negative,
        **conditioning,
    )


def _task_of(row: dict[str, Any]) -> str:
    """The task of a line without `task`: the one whose conditioning field it has, else plain text (t2va)."""
    return sample_task_of(next((name for name in CONDITIONING_KINDS if name in row), None))


def _string(where: _Where, row: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    if key not in row:
        raise where.error(key, "is missing")
    value = row[key]
    if not isinstance(value, str) or (not allow_empty and not value):
        raise where.error(key, f"is {value!r}, expected a {'' if allow_empty else 'non-empty '}string")
    return value


def _media(where: _Where, folder: Path, field_name: str, relative: Any) -> MediaPath:
    """Resolve a manifest path inside the manifest folder (itself fully resolved).

    No absolute path, no `..`, and after symbolic links are resolved the file must still lie
    inside the folder: a link in it may point only within it, so a manifest cannot make the encoder
    read (and store the latents of) a file elsewhere on the machine.
    """
    if not isinstance(relative, str) or not relative:
        raise where.error(field_name, f"is {relative!r}, expected a path relative to the manifest folder")
    if "\x00" in relative:
        raise where.error(field_name, f"is {relative!r}: a path cannot hold a NUL character")
    try:
        relative.encode("utf-8")
    except UnicodeEncodeError:
        raise where.error(field_name, f"is {relative!r}: not valid unicode (a lone surrogate); fix the name") from None
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise where.error(field_name, f"is '{relative}': paths must stay inside the manifest folder '{folder}'")
    try:
        resolved = (folder / rel).resolve()
    except (OSError, RuntimeError) as exc:
        raise where.error(field_name, f"is '{relative}': cannot be resolved ({exc})") from None
    if not resolved.is_relative_to(folder):
        raise where.error(
            field_name,
            f"is '{relative}', a link to '{resolved}': paths must stay inside the manifest folder '{folder}' "
            "after links are resolved; copy the file in or put the manifest above the media",
        )
    return MediaPath(relative=rel.as_posix(), path=resolved)


def _sample_id(where: _Where, row: dict[str, Any], video: str) -> str:
    """The explicit `id`, or one derived from the video path (`clips/a b.mp4` -> `clips--a_b`)."""
    if "id" in row:
        value = row["id"]
        if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
            raise where.error("id", f"is {value!r}, expected letters, digits, '.', '_' or '-' (it names the file)")
        return value
    stem = Path(video).with_suffix("").as_posix().replace("/", "--")
    derived = re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip("._-") or "clip"
    return derived[:200]
