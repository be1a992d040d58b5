"""The encoding manifest: one JSON object per line, one clip per object.

    {"video": "clips/a.mp4", "prompt": "...", "task": "fl2va", "keyframes": "both"}
    {"video": "clips/b.mp4", "prompt": "...", "task": "fl2va", "keyframes": {"first": "stills/b0.png", "last": null}}
    {"video": "clips/c.mp4", "prompt": "...", "task": "ref2va",
     "references": [{"kind": "image", "path": "refs/face.png"}, {"kind": "audio", "path": "refs/voice.wav"}]}
    {"video": "clips/d.mp4", "prompt": "...", "task": "t2va", "negative_prompt": " ", "id": "d"}

Every path is relative to the manifest's folder and may not leave it (no absolute paths, no `..`).
`keyframes` (fl2va only) is `"first"`, `"last"`, `"both"`, a list of anchors, or an object mapping an
anchor to an image path, `null` meaning the clip's own frame. `references` (ref2va only) keep their
order: it is the packed order and numbers the labels of the prompt presentation.

A malformed manifest raises `ManifestError` (a `ConfigError`: one line naming the file, the line and
the field), so the CLI exits 2 before any model is loaded. Problems with the media themselves are
found while encoding and reported per clip.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .format import ANCHORS, REFERENCE_KINDS

MANIFEST_TASKS = ("t2va", "fl2va", "ref2va")
DEFAULT_NEGATIVE_PROMPT = " "
_KEYS = {"video", "prompt", "task", "keyframes", "references", "negative_prompt", "id"}
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
class Keyframe:
    """One fl2va anchor (`first` / `last`); `image` None means the clip's own first or last frame."""

    anchor: str
    image: MediaPath | None = None


@dataclass(frozen=True)
class Reference:
    """One ref2va reference: `kind` is `image | video | audio`."""

    kind: str
    media: MediaPath


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


def read_manifest(path: str | os.PathLike) -> list[ManifestEntry]:
    """Parse and validate a manifest. Raises `ManifestError` naming the first problem."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest '{path}' does not exist")
    folder = path.resolve().parent
    entries: list[ManifestEntry] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        entry = _parse_line(_Where(path, number), folder, raw)
        if entry.sample_id in first_line_of:
            raise ManifestError(
                f"manifest '{path}' line {number}: id '{entry.sample_id}' is already used on line "
                f"{first_line_of[entry.sample_id]}; give one of them an explicit 'id'"
            )
        first_line_of[entry.sample_id] = number
        entries.append(entry)
    if not entries:
        raise ManifestError(f"manifest '{path}' lists no clips")
    return entries


@dataclass(frozen=True)
class _Where:
    path: Path
    line: int

    def error(self, field_name: str, problem: str) -> ManifestError:
        return ManifestError(f"manifest '{self.path}' line {self.line}: field '{field_name}' {problem}")


def _parse_line(where: _Where, folder: Path, raw: str) -> ManifestEntry:
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest '{where.path}' line {where.line}: not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ManifestError(f"manifest '{where.path}' line {where.line}: expected a JSON object")
    unknown = sorted(set(row) - _KEYS)
    if unknown:
        raise where.error(unknown[0], f"is not a manifest field (fields: {', '.join(sorted(_KEYS))})")

    video = _media(where, folder, "video", _string(where, row, "video"))
    prompt = _string(where, row, "prompt", allow_empty=True)
    task = _string(where, row, "task")
    if task not in MANIFEST_TASKS:
        raise where.error("task", f"is {task!r}, expected one of {', '.join(MANIFEST_TASKS)}")
    negative = _string(where, row, "negative_prompt", allow_empty=True) if "negative_prompt" in row else None

    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()
    if task == "fl2va":
        keyframes = _keyframes(where, folder, row.get("keyframes"))
    elif "keyframes" in row:
        raise where.error("keyframes", f"is for fl2va clips, this one is {task}")
    if task == "ref2va":
        references = _references(where, folder, row.get("references"))
    elif "references" in row:
        raise where.error("references", f"are for ref2va clips, this one is {task}")

    return ManifestEntry(
        line=where.line,
        sample_id=_sample_id(where, row, video.relative),
        video=video,
        prompt=prompt,
        task=task,
        negative_prompt=DEFAULT_NEGATIVE_PROMPT if negative is None else negative,
        keyframes=keyframes,
        references=references,
    )


def _string(where: _Where, row: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    if key not in row:
        raise where.error(key, "is missing")
    value = row[key]
    if not isinstance(value, str) or (not allow_empty and not value):
        raise where.error(key, f"is {value!r}, expected a {'' if allow_empty else 'non-empty '}string")
    return value


def _media(where: _Where, folder: Path, field_name: str, relative: Any) -> MediaPath:
    """Resolve a manifest path inside the manifest folder.

    The check is lexical (no absolute path, no `..`): a symlink placed inside the folder by its owner
    is followed, but the manifest itself cannot point outside.
    """
    if not isinstance(relative, str) or not relative:
        raise where.error(field_name, f"is {relative!r}, expected a path relative to the manifest folder")
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise where.error(field_name, f"is '{relative}': paths must stay inside the manifest folder '{folder}'")
    return MediaPath(relative=rel.as_posix(), path=folder / rel)


def _keyframes(where: _Where, folder: Path, value: Any) -> tuple[Keyframe, ...]:
    expected = "expected 'first', 'last', 'both', a list of anchors or {anchor: image path or null}"
    if value is None:
        raise where.error("keyframes", f"is missing; an fl2va clip needs at least one ({expected})")
    if value == "both":
        value = list(ANCHORS)
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        value = {anchor: None for anchor in value} if all(isinstance(a, str) for a in value) else value
    if not isinstance(value, dict) or not value or any(a not in ANCHORS for a in value):
        raise where.error("keyframes", f"is {value!r}, {expected}")
    # Packed order is first, then last, whatever order the manifest wrote them in.
    return tuple(
        Keyframe(anchor, None if value[anchor] is None else _media(where, folder, f"keyframes.{anchor}", value[anchor]))
        for anchor in ANCHORS
        if anchor in value
    )


def _references(where: _Where, folder: Path, value: Any) -> tuple[Reference, ...]:
    if not isinstance(value, list) or not value:
        raise where.error("references", f"is {value!r}, expected a non-empty list of {{kind, path}} objects")
    refs = []
    for i, ref in enumerate(value):
        name = f"references[{i}]"
        if not isinstance(ref, dict) or set(ref) != {"kind", "path"}:
            raise where.error(name, f"is {ref!r}, expected {{'kind': image|video|audio, 'path': ...}}")
        if ref["kind"] not in REFERENCE_KINDS:
            raise where.error(f"{name}.kind", f"is {ref['kind']!r}, expected one of {', '.join(REFERENCE_KINDS)}")
        refs.append(Reference(ref["kind"], _media(where, folder, f"{name}.path", ref["path"])))
    return tuple(refs)


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
