"""Which spans of a clip become samples (`h3train encode --windows`), on the clip's 24 fps clock.

    first     the clip's first window, as long as `--max-seconds` (or `--window-seconds`) allows: one
              sample per clip, its id the clip's
    uniform   up to `--max-windows` non-overlapping windows spread evenly: the first at the clip's
              start, the last ending at its end, equal gaps between (as many as fit by default)
    slide     a window every `--stride` seconds from the start (back to back by default), up to
              `--max-windows`, while one fits

A window of `uniform` / `slide` is `--window-seconds` long (default: the longest `--max-seconds` allows),
cut to the `17 n + 5` frame rule; a clip shorter than one window gives one sample of all of it, as
`first` does. Its sample id is the clip's id, `.w` and its first frame at 24 fps (`clip.w000288` starts
at 12.00 s), so an id names the same span on every run and a window left where it was stays up to date.

`plan_clips` plans every clip from its file's header (the same on every rank, before any is encoded);
`footage_used` says how much of the clips the samples of a dataset hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, one_of
from .clip import EncodeSettings
from .manifest import ManifestEntry
from .media import FPS, MediaError, aligned_down, clip_length, shortest_kept, slot_count

WINDOW_MODES = ("first", "uniform", "slide")


@dataclass(frozen=True)
class Window:
    """One sample's span of a clip: `start` its first frame at 24 fps, at most `frames` frames from there.

    `frames` caps the frame count (`load_clip`'s `max_frames`); the sample has the largest `17 n + 5`
    within it and within what the clip holds from `start`.
    """

    sample_id: str
    clip_id: str
    start: int
    frames: int


@dataclass(frozen=True)
class Windowing:
    """How clips are cut into samples: `mode` one of `WINDOW_MODES`; `seconds` a window's length (None: the
    longest `max_seconds` allows); `stride` seconds between `slide` windows (None: a window's length);
    `max_windows` per clip (None: as many as fit)."""

    mode: str = "first"
    seconds: float | None = None
    stride: float | None = None
    max_windows: int | None = None

    def validate(self, settings: EncodeSettings) -> None:
        """Raise `ConfigError` naming the flag of the first bad value."""
        if self.mode not in WINDOW_MODES:
            raise ConfigError(f"--windows '{self.mode}': {one_of(self.mode, WINDOW_MODES)}")
        if self.seconds is not None:
            if not math.isfinite(self.seconds) or self.seconds <= 0:
                raise ConfigError(f"--window-seconds is {self.seconds:g}, expected a positive number of seconds")
            if self.seconds > settings.max_seconds:
                raise ConfigError(
                    f"--window-seconds {self.seconds:g} is longer than --max-seconds {settings.max_seconds:g}, "
                    "the longest sample; raise --max-seconds or shorten the window"
                )
            frames = aligned_down(math.floor(self.seconds * FPS))
            shortest = shortest_kept(settings.min_frames)
            if frames < shortest:
                raise ConfigError(
                    f"--window-seconds {self.seconds:g} gives {frames} frames at {FPS} fps, under the shortest "
                    f"sample kept ({shortest} frames, {shortest / FPS:.2f} s, from --min-seconds "
                    f"{settings.min_seconds:g}); lengthen the window"
                )
        if self.stride is not None:
            if self.mode != "slide":
                raise ConfigError(f"--stride applies to --windows slide, not --windows {self.mode}")
            if not math.isfinite(self.stride) or round(self.stride * FPS) < 1:
                raise ConfigError(f"--stride is {self.stride:g}, expected at least one frame ({1 / FPS:.3f} s)")
        if self.max_windows is not None:
            if self.mode == "first":
                raise ConfigError("--max-windows applies to --windows uniform or slide; --windows first takes one")
            if self.max_windows < 1:
                raise ConfigError(f"--max-windows is {self.max_windows}, expected at least 1")

    def window_frames(self, settings: EncodeSettings) -> int:
        """The cap on a window's frames: `seconds` (else `max_seconds`) at 24 fps; for `uniform` / `slide`
        cut to the `17 n + 5` rule, the length every whole window has."""
        cap = settings.max_frames if self.seconds is None else math.floor(self.seconds * FPS)
        return cap if self.mode == "first" else aligned_down(cap)

    def plan(self, clip_id: str, slots: int | None, settings: EncodeSettings) -> list[Window]:
        """The windows of a clip `slots` frames long at 24 fps (None: unknown, one window at its start)."""
        frames = self.window_frames(settings)
        if self.mode == "first":
            return [Window(clip_id, clip_id, 0, frames)]
        starts = [0]
        if slots is not None and slots > frames:
            limit = math.inf if self.max_windows is None else self.max_windows
            if self.mode == "uniform":
                count = int(min(limit, slots // frames))
                if count > 1:
                    # The first at 0, the last ending at the clip's end; gaps of at least 0 as count * frames <= slots.
                    starts = [i * (slots - frames) // (count - 1) for i in range(count)]
            else:
                step = frames if self.stride is None else round(self.stride * FPS)
                starts = list(range(0, slots - frames + 1, step))[: int(min(limit, slots))]
        return [Window(window_id(clip_id, start), clip_id, start, frames) for start in starts]

    def describe(self, settings: EncodeSettings) -> str:
        """`windows uniform of 39 frames (1.62 s), at most 4 per clip`."""
        frames = aligned_down(self.window_frames(settings))
        if self.mode == "first":
            return f"windows first (up to {frames} frames, {frames / FPS:.2f} s)"
        line = f"windows {self.mode} of {frames} frames ({frames / FPS:.2f} s)"
        if self.mode == "slide":
            line += f" every {self.stride:g} s" if self.stride is not None else " back to back"
        return line + (f", at most {self.max_windows} per clip" if self.max_windows else "")

    def more_footage(self) -> str | None:
        """The flag that would use more of a clip these settings leave mostly unused; None if none would."""
        if self.mode == "first":
            return "--windows uniform"
        if self.max_windows is not None:
            return f"a --max-windows above {self.max_windows}"
        if self.mode == "slide" and self.stride is not None:
            return "a shorter --stride"
        return None


def window_id(clip_id: str, start: int) -> str:
    """The sample id of a clip's window starting at 24 fps frame `start`: `clip.w000288`."""
    return f"{clip_id}.w{start:06d}"


@dataclass(frozen=True)
class ClipPlan:
    """A clip's whole length in seconds (None when it cannot be read: its encode reports why) and its windows."""

    duration: float | None
    windows: list[Window]


def plan_clips(entries: list[ManifestEntry], windowing: Windowing, settings: EncodeSettings) -> dict[str, ClipPlan]:
    """Clip id -> its plan, from each file's header (`clip_length`): the same on every rank.

    Raises `ConfigError` when a window's sample id is another clip's id or window.
    """
    plans, owner = {}, {}
    for entry in entries:
        try:
            frames, fps = clip_length(entry.video.path)
            duration, slots = frames / fps, slot_count(frames, fps)
        except MediaError:
            duration, slots = None, None
        plans[entry.sample_id] = ClipPlan(duration, windowing.plan(entry.sample_id, slots, settings))
    for entry in entries:
        for window in plans[entry.sample_id].windows:
            other = owner.setdefault(window.sample_id, entry)
            if other is not entry:
                raise ConfigError(
                    f"sample id '{window.sample_id}' names a window of clip '{entry.sample_id}' (manifest line "
                    f"{entry.line}) and clip '{other.sample_id}' (line {other.line}); give one of them another id"
                )
    return plans


def footage_used(
    samples: list[tuple[str, int, int]], durations: dict[str, float | None]
) -> tuple[float, float, list[tuple[str, float]]]:
    """`(footage, used, underused)` of the samples in a dataset, each `(clip id, first frame, frames)` at 24 fps.

    `footage`: seconds of the clips of known length (`durations`, clip id -> seconds or None); `used`:
    seconds of them some sample holds (overlapping windows counted once); `underused`: `(clip, fraction
    used)` of each clip with a sample that uses under half of it, in clip order.
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for clip, start, frames in samples:
        spans.setdefault(clip, []).append((start, start + frames))
    footage = sum(d for d in durations.values() if d)
    used, underused = 0.0, []
    for clip, intervals in sorted(spans.items()):
        covered, reach = 0, 0
        for begin, end in sorted(intervals):
            covered += max(0, end - max(begin, reach))
            reach = max(reach, end)
        duration = durations.get(clip)
        if not duration:
            continue
        seconds = min(covered / FPS, duration)
        used += seconds
        if seconds < duration / 2:
            underused.append((clip, seconds / duration))
    return footage, used, underused
