"""Media decoding with PyAV, onto MiniMax H3's clock, canvas and sample rate (and small writers for demos).

Frames are `uint8` RGB arrays `[T, H, W, 3]`; a target clip's waveform is float32 `[2, N]` stereo at the
audio VAE's rate. A reference video keeps its soundtrack as the file has it (its own rate and channels,
decoded as diffusers' `MiniMaxH3VideoReference.from_file` does), for the pipeline to normalize.
Geometry rules are diffusers' own (`resolve_canvas_size`, `align_num_frames`'s `17 n + 5`), and
the frame-rate conversion is the one the pipeline applies to reference videos (`ffmpeg`'s `fps` filter:
a source frame is held until the slot of the next one).

Every problem with a file raises `MediaError` with a one-line reason; the encoder records it for that
clip and goes on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_FPS, resolve_canvas_size
from diffusers.utils import load_image
from PIL import Image

from ..tasks.table import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK

FPS = MINIMAX_H3_FPS
AUDIO_CHANNELS = 2


class MediaError(ValueError):
    """A media file that cannot be used for this clip, with the reason in one line."""

    # The short reason a summary groups clips by ("too short", "unreadable", ...).
    kind = "unusable media"


class ClipTooShort(MediaError):
    """A clip shorter than the shortest kept (`shortest` frames at 24 fps: `min_seconds` rounded down
    to the 17 n + 5 rule, at least the 5 frames the VAE encodes)."""

    kind = "too short"

    def __init__(self, message: str, shortest: int) -> None:
        super().__init__(message)
        self.shortest = shortest


@dataclass(frozen=True)
class MediaFile:
    """What a target clip's file holds, as far as it was decoded.

    `width` x `height` upright pixels at `fps`; `frames` decoded from the file's first frame, which is
    all of them when `complete` (decoding stops once `max_frames` are filled); `slots`: those frames put
    on 24 fps, from the decoded window's first slot on; `duration`: the file's whole length in seconds
    (its stream's header when decoding stopped early, `clip_length`), None when nothing states it.
    """

    width: int
    height: int
    fps: float
    frames: int
    complete: bool
    slots: int
    duration: float | None = None

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    def describe(self) -> str:
        """`640x360 25 fps 5.00 s`: the file's whole length (`>=` the decoded part when it is not known)."""
        if self.duration is not None:
            return f"{self.width}x{self.height} {self.fps:g} fps {self.duration:.2f} s"
        return f"{self.width}x{self.height} {self.fps:g} fps {'' if self.complete else '>='}{self.seconds:.2f} s"


@dataclass
class TargetClip:
    """A target clip on H3's geometry.

    frames `[T, H, W, 3]` uint8 at 24 fps on the canvas, `T = 17 n + 5`; audio `[2, N]` float32 at
    `sample_rate` covering the clip from its start (None when the file has no audio track); `file`: what
    the file held.
    """

    frames: np.ndarray
    audio: torch.Tensor | None
    sample_rate: int
    file: MediaFile | None = None

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


@dataclass
class DecodedVideo:
    """A video at its own rate and size: frames `[T, H, W, 3]` uint8 at `fps`; soundtrack `[C, N]` float32 at
    `sample_rate`, both as the file carries them (None without an audio track)."""

    frames: np.ndarray
    fps: float
    audio: torch.Tensor | None
    sample_rate: int | None


def aligned_down(frames: int) -> int:
    """The largest `17 n + 5` frame count not above `frames` (0 below 5, the shortest the VAE encodes)."""
    if frames < VAE_LATENTS_PER_CHUNK:
        return 0
    return (frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def shortest_kept(min_frames: int) -> int:
    """Frames at 24 fps of the shortest clip kept: `min_frames` rounded *down* to the 17 n + 5 rule.

    Rounded down, so that a clip of exactly `min_seconds` is kept at whatever frame rate it was shot:
    5.00 s is 120 frames at 24 fps, whose largest `17 n + 5` is 107 (4.46 s).
    """
    return max(aligned_down(min_frames), VAE_LATENTS_PER_CHUNK)


def aligned_frame_count(available: int, min_frames: int, max_frames: int) -> int:
    """The largest `17 n + 5` frame count within `available` and `max_frames`; never more frames than exist.

    Raises `ClipTooShort` when it falls short of `shortest_kept(min_frames)`.
    """
    count = aligned_down(min(available, max_frames))
    floor = shortest_kept(min_frames)
    if count < floor:
        raise ClipTooShort(
            f"clip too short: {available} frames at {FPS} fps ({available / FPS:.2f} s), at most {max_frames} used; "
            f"the shortest kept is {floor} frames ({floor / FPS:.2f} s)",
            floor,
        )
    return count


def fps_slots(num_source: int, source_fps: float, target_fps: float = FPS) -> np.ndarray:
    """Source frame index of every output frame when `num_source` frames at `source_fps` are put on `target_fps`.

    The same arithmetic as diffusers' `MiniMaxH3Ref2VASetupStep._normalize_video_condition`: frame `i`
    starts at slot `floor(i * target / source + 0.5)` and is held until the next frame's slot.
    """
    if source_fps <= 0:
        raise MediaError(f"video reports a frame rate of {source_fps}, expected a positive one")
    if source_fps == target_fps:
        return np.arange(num_source)
    scale = target_fps / source_fps
    starts = np.floor(np.arange(num_source) * scale + 0.5).astype(np.int64)
    holds = np.diff(starts, append=math.floor(num_source * scale + 0.5))
    return np.repeat(np.arange(num_source), holds)


def canvas_size(width: int, height: int, short_edge: int, max_pixels: int, multiple: int) -> tuple[int, int]:
    """`(height, width)` of the canvas a `width x height` source is put on (diffusers' `resolve_canvas_size`)."""
    try:
        return resolve_canvas_size(width, height, multiple, short_edge, max_pixels)
    except ValueError as exc:
        raise MediaError(str(exc)) from None


def cover_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Resize `image` to cover `width x height` (LANCZOS), then crop the centre.

    The arithmetic of the pipeline's follower keyframe (`MiniMaxH3ResizeStep`): sizes rounded, the crop
    offset `(resized - canvas) // 2`, so a frame and a keyframe cut from it land on the same pixels.
    """
    if image.size == (width, height):
        return image
    scale = max(width / image.size[0], height / image.size[1])
    resized = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    left, top = max(0, (resized[0] - width) // 2), max(0, (resized[1] - height) // 2)
    return image.resize(resized, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))


def load_clip(
    path: str | os.PathLike,
    short_edge: int,
    max_pixels: int,
    canvas_multiple: int,
    min_frames: int,
    max_frames: int,
    sample_rate: int,
    start: int = 0,
) -> TargetClip:
    """Decode a target clip onto 24 fps and its canvas, and its soundtrack onto `sample_rate` stereo.

    The canvas comes from the clip's own aspect ratio (upright; a non-square pixel aspect ratio is not
    applied, as in diffusers' reference decoder); frames are cover-cropped onto it. The
    frame count is the largest `17 n + 5` the clip holds, capped at `max_frames`. Decoding stops once
    enough frames are read, so a long clip costs no more than the part that is used.

    `start`: the window's first frame on the clip's 24 fps clock. The frames are those of the whole
    clip put on 24 fps from slot `start` on (its first is the source frame showing at `start / 24` s),
    reached by seeking (`_images_from`); the soundtrack starts at the same instant, sample 0 of the
    clip's audio being the instant of its first frame, as for a clip decoded from its start.
    """
    with _open(path) as container:
        stream = _video_stream(path, container)
        fps = _frame_rate(stream)
        scale = FPS / fps
        first = source_frame_at(start, fps)
        frames: list[np.ndarray] = []
        canvas: tuple[int, int] | None = None
        size = (0, 0)
        complete = True
        for image in _images_from(path, container, stream, fps, first):
            if canvas is None:
                size = image.size
                canvas = canvas_size(image.size[0], image.size[1], short_edge, max_pixels, canvas_multiple)
            frames.append(np.asarray(cover_crop(image, canvas[1], canvas[0])))
            # Enough source frames to fill `max_frames` slots, the last one held for a full slot.
            if (first + len(frames)) * scale >= start + max_frames + 1:
                complete = False
                break
        if not frames:
            where = f" from {start / FPS:.2f} s on" if start else ""
            raise MediaError(f"'{path}' holds no decodable video frames{where}")
        decoded = first + len(frames)
        # Source index (within `frames`) of every 24 fps slot from `start` on: the whole clip's slots, cut.
        slots = fps_slots(decoded, fps)[start:] - first
        total = decoded if complete else _header_frames(container, stream, fps)
        file = MediaFile(size[0], size[1], fps, decoded, complete, len(slots), None if total is None else total / fps)
        try:
            num_frames = aligned_frame_count(len(slots), min_frames, max_frames)
        except ClipTooShort as exc:
            # Said in the file's own frames and rate: that is what its owner knows about it.
            raise ClipTooShort(
                f"clip too short: {file.frames} frames at {fps:g} fps ({file.seconds:.2f} s); the shortest kept "
                f"is {exc.shortest / FPS:.2f} s",
                exc.shortest,
            ) from None
        audio = _soundtrack(path, container, sample_rate, num_frames / FPS, start / FPS)
    return TargetClip(np.stack([frames[i] for i in slots[:num_frames]]), audio, sample_rate, file)


def source_frame_at(slot: int, fps: float) -> int:
    """The source frame showing at 24 fps slot `slot`: the last whose slot (`fps_slots`) begins at or before it."""
    if slot <= 0:
        return 0
    scale = FPS / fps
    index = int((slot + 0.5) / scale)
    # The estimate is within one of the answer; settle it with `fps_slots`' own arithmetic.
    while index > 0 and math.floor(index * scale + 0.5) > slot:
        index -= 1
    while math.floor((index + 1) * scale + 0.5) <= slot:
        index += 1
    return index


def clip_length(path: str | os.PathLike) -> tuple[int, float]:
    """`(frames, fps)` of a clip's video stream without decoding it: its header's frame count or duration,
    else the container's duration, else a count of its packets (a read of the file, no decode)."""
    with _open(path) as container:
        stream = _video_stream(path, container)
        fps = _frame_rate(stream)
        frames = _header_frames(container, stream, fps)
        if frames is None:
            try:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            except av.error.FFmpegError as exc:
                raise MediaError(f"cannot read '{path}': {exc}") from None
    return frames, fps


def slot_count(frames: int, fps: float) -> int:
    """How many 24 fps slots `frames` source frames at `fps` fill (the length of `fps_slots`)."""
    return frames if fps == FPS else math.floor(frames * FPS / fps + 0.5)


def load_video(path: str | os.PathLike, max_seconds: float | None = None) -> DecodedVideo:
    """Decode a video at its own frame rate and size (a reference), up to `max_seconds` of it.

    The soundtrack stays at its own rate and channel count (`native_soundtrack`): the pipeline's setup
    step truncates it at that rate and resamples it once, as at inference.
    """
    with _open(path) as container:
        stream = _video_stream(path, container)
        fps = _frame_rate(stream)
        limit = math.inf if max_seconds is None else math.ceil(max_seconds * fps) + 1
        frames = []
        for image in _decoded_images(path, container, stream):
            frames.append(np.asarray(image))
            if len(frames) >= limit:
                break
        if not frames:
            raise MediaError(f"'{path}' holds no decodable video frames")
        audio, rate = native_soundtrack(path, container, max_seconds)
    return DecodedVideo(np.stack(frames), fps, audio, rate)


def load_audio(path: str | os.PathLike, sample_rate: int, max_seconds: float | None = None) -> torch.Tensor:
    """Decode an audio file (or a video's soundtrack) to `[2, N]` float32 at `sample_rate`."""
    with _open(path) as container:
        audio = _soundtrack(path, container, sample_rate, max_seconds)
    if audio is None:
        raise MediaError(f"'{path}' has no audio track")
    return audio


def load_still(path: str | os.PathLike) -> Image.Image:
    """An image file as RGB PIL (diffusers' `load_image`: EXIF orientation applied)."""
    try:
        return load_image(str(path))
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for a bad file
        raise MediaError(f"cannot read image '{path}': {type(exc).__name__}: {exc}") from None


def fit_audio(waveform: torch.Tensor, num_samples: int) -> torch.Tensor:
    """`[2, N]` -> `[2, num_samples]`: cut, or padded with silence when the soundtrack ends early."""
    if waveform.shape[-1] >= num_samples:
        return waveform[:, :num_samples].contiguous()
    return torch.nn.functional.pad(waveform, (0, num_samples - waveform.shape[-1]))


# --------------------------------------------------------------------------------------------------
# PyAV plumbing.


def native_soundtrack(
    path: str | os.PathLike, container: av.container.InputContainer, max_seconds: float | None = None
) -> tuple[torch.Tensor | None, int | None]:
    """The first audio stream as `[C, N]` float32 at the rate and layout it carries, or `(None, None)`.

    The decode of diffusers' reference `from_file` (planar float, the stream's own layout and rate), cut
    to `ceil(max_seconds * rate)` samples: never shorter than the pipeline's own cut at that rate.
    """
    if not container.streams.audio:
        return None, None
    stream = container.streams.audio[0]
    rate = int(stream.codec_context.sample_rate)
    waveform = _decode_audio(path, container, stream, stream.layout, rate, max_seconds)
    return (None, None) if waveform is None else (waveform, rate)


def _decode_audio(
    path: str | os.PathLike,
    container: av.container.InputContainer,
    stream: av.audio.stream.AudioStream,
    layout: object,
    rate: int,
    max_seconds: float | None,
    offset: float = 0.0,
) -> torch.Tensor | None:
    """`stream` decoded to planar float32 `[C, N]` in `layout` at `rate`, from `offset` seconds after its first
    sample on (`round(offset * rate)` samples passed over), cut to `ceil(max_seconds * rate)`.

    None when it holds no samples; silence `[C, 0]` when it ends before `offset`.
    """
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
    # Decoded from the start and cut, not sought: the resampler's output then counts from the first
    # sample exactly as for a clip decoded whole, and audio decodes fast beside video.
    skip = round(offset * rate)
    limit = math.inf if max_seconds is None else skip + math.ceil(max_seconds * rate)
    chunks, total = [], 0
    try:
        container.seek(0)
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunks.append(torch.from_numpy(out.to_ndarray()))
                total += chunks[-1].shape[-1]
            if total >= limit:
                break
        else:
            chunks += [torch.from_numpy(out.to_ndarray()) for out in resampler.resample(None)]
    except av.error.FFmpegError as exc:
        raise MediaError(f"cannot decode the audio of '{path}': {exc}") from None
    if not chunks or sum(c.shape[-1] for c in chunks) == 0:
        return None
    waveform = torch.cat(chunks, dim=-1).to(torch.float32)
    if limit != math.inf:
        waveform = waveform[:, :limit]
    return waveform[:, skip:].contiguous()


def _open(path: str | os.PathLike) -> av.container.InputContainer:
    if not os.path.isfile(path):
        raise MediaError(f"'{path}' does not exist")
    try:
        return av.open(str(path))
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise MediaError(f"cannot open '{path}': {exc}") from None


def _video_stream(path: str | os.PathLike, container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise MediaError(f"'{path}' has no video stream")
    return container.streams.video[0]


def _frame_rate(stream: av.video.stream.VideoStream) -> float:
    rate = stream.average_rate or stream.guessed_rate
    if not rate or float(rate) <= 0:
        raise MediaError("the video stream reports no frame rate")
    return float(rate)


def _header_frames(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, fps: float
) -> int | None:
    """The stream's frame count as its header states it (count, else duration), else from the container's
    duration; None when neither says."""
    if stream.frames:
        return int(stream.frames)
    if stream.duration and stream.time_base:
        return round(float(stream.duration * stream.time_base) * fps)
    if container.duration:
        return round(container.duration / av.time_base * fps)
    return None


def _images_from(
    path: str | os.PathLike,
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    fps: float,
    first: int,
) -> Iterator[Image.Image]:
    """The stream's frames (as `_decoded_images`) from source frame `first` on, frame 0 being its first.

    A frame's index is its presentation time after the first frame's, times `fps`. The container is
    sought to the last keyframe before `first`; where the stream gives no times, or the seek lands past
    `first`, it is decoded from the start and `first` frames are passed over instead.
    """
    if first == 0:
        yield from _decoded_images(path, container, stream)
        return
    origin = next((frame.pts for frame in _decoded_frames(path, container, stream)), None)
    timed = origin is not None and stream.time_base
    if timed:
        target = origin + math.floor(first / fps / stream.time_base)
        try:
            container.seek(target, stream=stream, backward=True, any_frame=False)
        except av.error.FFmpegError:
            timed = False
    if timed:
        frames = _decoded_frames(path, container, stream)
        for frame in frames:
            index = None if frame.pts is None else round(float((frame.pts - origin) * stream.time_base) * fps)
            if index is None or index > first:
                break  # no time to go by, or past the start: decode from the start instead
            if index == first:
                yield _upright(frame)
                yield from (_upright(rest) for rest in frames)
                return
        else:
            return  # the stream ends before `first`
    container.seek(0)
    for index, image in enumerate(_decoded_images(path, container, stream)):
        if index >= first:
            yield image


def _decoded_frames(
    path: str | os.PathLike, container: av.container.InputContainer, stream: av.video.stream.VideoStream
) -> Iterator[av.VideoFrame]:
    """The stream's frames from where the container stands; a decoding error is a `MediaError`."""
    try:
        yield from container.decode(stream)
    except av.error.FFmpegError as exc:
        raise MediaError(f"cannot decode '{path}': {exc}") from None


def _upright(frame: av.VideoFrame) -> Image.Image:
    """A frame as an upright RGB PIL image (display-matrix rotation undone, like ffmpeg)."""
    image = frame.to_image()
    # PyAV reports the counterclockwise rotation; diffusers' reference decoder snaps it to quarter turns.
    turns = round(frame.rotation / 90.0) % 4 if frame.rotation else 0
    return image.rotate(-90 * turns, expand=True) if turns else image


def _decoded_images(
    path: str | os.PathLike, container: av.container.InputContainer, stream: av.video.stream.VideoStream
) -> Iterator[Image.Image]:
    """Yield the stream's frames as upright RGB PIL images (display-matrix rotation undone, like ffmpeg)."""
    for frame in _decoded_frames(path, container, stream):
        yield _upright(frame)


def _soundtrack(
    path: str | os.PathLike,
    container: av.container.InputContainer,
    sample_rate: int,
    max_seconds: float | None,
    offset: float = 0.0,
) -> torch.Tensor | None:
    """The first audio stream as `[2, N]` float32 at `sample_rate` from `offset` seconds on, or None without one.

    Mono is duplicated onto both channels (as the pipeline upmixes reference audio); more than two
    channels are downmixed to stereo by ffmpeg's resampler.
    """
    if not container.streams.audio:
        return None
    stream = container.streams.audio[0]
    mono = stream.codec_context.channels == 1
    layout = "mono" if mono else "stereo"
    waveform = _decode_audio(path, container, stream, layout, sample_rate, max_seconds, offset)
    if waveform is None or not mono:
        return waveform
    return waveform.expand(AUDIO_CHANNELS, -1).contiguous()


# --------------------------------------------------------------------------------------------------
# Writing media: the demo and the tests make their clips with these.


def write_video(
    path: str | os.PathLike,
    frames: np.ndarray,
    fps: float,
    audio: np.ndarray | Sequence[np.ndarray] | None = None,
    sample_rate: int = 44100,
    titles: Sequence[str] = (),
) -> Path:
    """Write `[T, H, W, 3]` uint8 frames (H.264) and optionally `[C, N]` float audio (AAC) to `path`.

    `audio` may be a list of such arrays: one audio stream each, in order, each titled by `titles[i]`
    (stream metadata `title` and `handler_name`, the names players list to choose a track).
    """
    path = Path(path)
    tracks = [] if audio is None else [audio] if isinstance(audio, np.ndarray) else list(audio)
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.height, video.width = frames.shape[1:3]
        video.pix_fmt = "yuv420p"
        sounds = []
        for i, track in enumerate(tracks):
            sound = container.add_stream("aac", rate=sample_rate, layout="mono" if track.shape[0] == 1 else "stereo")
            if i < len(titles):
                sound.metadata.update(title=titles[i], handler_name=titles[i], language="und")
            sounds.append(sound)
        for image in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(video.encode())
        for sound, track in zip(sounds, tracks):
            _mux_audio(container, sound, track, sample_rate)
    return path


def write_audio(path: str | os.PathLike, audio: np.ndarray, sample_rate: int) -> Path:
    """Write `[C, N]` float audio as 16-bit PCM WAV."""
    path = Path(path)
    with av.open(str(path), mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=sample_rate, layout="mono" if audio.shape[0] == 1 else "stereo")
        _mux_audio(container, stream, audio, sample_rate)
    return path


def _mux_audio(container: av.container.OutputContainer, stream: Any, audio: np.ndarray, sample_rate: int) -> None:
    layout = "mono" if audio.shape[0] == 1 else "stereo"
    planar = np.ascontiguousarray(audio, dtype=np.float32)
    step = 1024
    for start in range(0, planar.shape[1], step):
        frame = av.AudioFrame.from_ndarray(planar[:, start : start + step], format="fltp", layout=layout)
        frame.sample_rate = sample_rate
        frame.pts = start
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def moving_pattern(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """`[T, H, W, 3]` uint8: a coloured square crossing a gradient background, different per `seed`."""
    rng = np.random.default_rng(seed)
    color = rng.integers(64, 256, size=3)
    ys, xs = np.mgrid[0:height, 0:width]
    background = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), 0 * xs + 64], -1)
    frames = np.repeat(background[None].astype(np.uint8), num_frames, axis=0)
    side = max(4, min(height, width) // 3)
    dx, dy = rng.choice([-3, -2, 2, 3], size=2)
    x0, y0 = rng.integers(0, width - side), rng.integers(0, height - side)
    for t in range(num_frames):
        x = int(x0 + dx * t) % (width - side)
        y = int(y0 + dy * t) % (height - side)
        frames[t, y : y + side, x : x + side] = color
    return frames


def sine_tone(seconds: float, frequency: float, sample_rate: int, channels: int = 2) -> np.ndarray:
    """`[channels, N]` float32 sine at half amplitude (right channel a fifth above, to tell them apart)."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    tones = [0.5 * np.sin(2 * np.pi * frequency * (1.5**c) * t) for c in range(channels)]
    return np.stack(tones).astype(np.float32)
