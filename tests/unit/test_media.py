"""Media decoding onto H3's clock, canvas and sample rate, checked against diffusers' own rules."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3VideoReference
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep, MiniMaxH3ResizeStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from PIL import Image

from h3train.encode import EncodeSettings
from h3train.encode.media import (
    ClipTooShort,
    MediaError,
    aligned_frame_count,
    cover_crop,
    fit_audio,
    fps_slots,
    load_audio,
    load_clip,
    load_still,
    load_video,
    moving_pattern,
    sine_tone,
    write_audio,
    write_video,
)

RATE = 32000
CANVAS = {"short_edge": 64, "max_pixels": 64 * 96, "canvas_multiple": 32}


def _clip(path: Path, **kwargs) -> object:
    options = {**CANVAS, "min_frames": 0, "max_frames": 360, "sample_rate": RATE, **kwargs}
    return load_clip(path, **options)


@pytest.mark.parametrize(
    ("available", "max_frames", "expected"),
    [(5, 360, 5), (21, 360, 5), (22, 360, 22), (38, 360, 22), (39, 360, 39), (400, 360, 345), (400, 30, 22)],
)
def test_frame_count_is_the_largest_17n_plus_5_that_fits(available: int, max_frames: int, expected: int) -> None:
    assert aligned_frame_count(available, 0, max_frames) == expected


def test_too_short_clip_is_rejected_with_a_reason() -> None:
    with pytest.raises(MediaError, match="clip too short: 4 frames"):
        aligned_frame_count(4, 0, 360)
    # min_seconds 5 (120 frames) rounds down to the 17 n + 5 rule: 107 frames is the shortest kept.
    with pytest.raises(ClipTooShort, match="the shortest kept is 107 frames") as caught:
        aligned_frame_count(100, 120, 360)
    assert caught.value.shortest == 107
    assert aligned_frame_count(107, 120, 360) == 107


@pytest.mark.parametrize("fps", [24, 25, 30])
def test_a_clip_of_exactly_min_seconds_is_kept_at_any_frame_rate(fps: int, tmp_path: Path) -> None:
    path = write_video(tmp_path / f"five_{fps}.mp4", moving_pattern(5 * fps, 32, 48, fps), fps)
    clip = _clip(path, min_frames=EncodeSettings().min_frames, max_frames=EncodeSettings().max_frames)
    assert clip.num_frames == 107  # 5.00 s at 24 fps is 120 frames: the largest 17 n + 5 within it
    assert clip.file is not None and clip.file.frames == 5 * fps and clip.file.fps == fps
    assert clip.file.describe() == f"48x32 {fps} fps 5.00 s"


def test_a_too_short_clip_is_named_in_its_own_frames_and_rate(tmp_path: Path) -> None:
    path = write_video(tmp_path / "two.mp4", moving_pattern(50, 32, 48, 1), 25)
    with pytest.raises(ClipTooShort, match=r"50 frames at 25 fps \(2.00 s\); the shortest kept is 4.46 s"):
        _clip(path, min_frames=EncodeSettings().min_frames)


@pytest.mark.parametrize("source_fps", [30.0, 25.0, 24.0, 12.0, 60.0])
def test_fps_conversion_matches_the_pipeline(source_fps: float) -> None:
    # Frames on their own canvas already, so the pipeline's normalization only resamples the rate.
    frames = np.arange(37, dtype=np.uint8)[:, None, None, None] * np.ones((1, 32, 32, 3), dtype=np.uint8)
    theirs = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames, source_fps, 10_000, 32, 32, 32 * 32, 24.0)
    ours = frames[fps_slots(len(frames), source_fps)]
    assert np.array_equal(ours, theirs)


def test_cover_crop_is_the_pipelines_follower_keyframe() -> None:
    canvas = (64, 96)
    follower = Image.fromarray(moving_pattern(1, 75, 160, seed=4)[0])
    pipe = MiniMaxH3ModularPipeline()
    state = PipelineState()
    anchor = Image.new("RGB", canvas[::-1])
    for key, value in {"image": anchor, "last_image": follower, "height": canvas[0], "width": canvas[1]}.items():
        state.set(key, value)
    MiniMaxH3ResizeStep()(pipe, state)
    assert np.array_equal(np.asarray(cover_crop(follower, canvas[1], canvas[0])), np.asarray(state.get("keyframes")[1]))


def test_clip_is_put_on_24_fps_and_its_canvas(tmp_path: Path) -> None:
    path = write_video(tmp_path / "a.mp4", moving_pattern(30, 80, 120), 30, sine_tone(1.0, 440, 44100), 44100)
    clip = _clip(path)
    # 30 frames at 30 fps are 24 frames at 24 fps; 22 is the largest 17 n + 5 among them.
    assert clip.frames.shape == (22, 64, 96, 3) and clip.frames.dtype == np.uint8
    assert clip.audio.shape[0] == 2 and clip.audio.dtype == torch.float32
    # The soundtrack is cut to the clip: 22 / 24 s.
    assert clip.audio.shape[1] == math.ceil(22 / 24 * RATE)
    assert not torch.equal(clip.audio[0], clip.audio[1])


def test_long_clip_is_cut_and_mono_is_upmixed(tmp_path: Path) -> None:
    path = write_video(tmp_path / "b.mp4", moving_pattern(72, 64, 64), 24, sine_tone(3.0, 300, 48000, 1), 48000)
    clip = _clip(path, max_frames=48)
    assert clip.num_frames == 39
    assert torch.equal(clip.audio[0], clip.audio[1])


def test_clip_without_audio_track(tmp_path: Path) -> None:
    clip = _clip(write_video(tmp_path / "c.mp4", moving_pattern(24, 64, 96), 24))
    assert clip.audio is None and clip.num_frames == 22


def test_unreadable_media_raise_media_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00garbage" * 64)
    for load in (_clip, load_video, lambda p: load_audio(p, RATE), load_still):
        with pytest.raises(MediaError):
            load(broken)
    with pytest.raises(MediaError, match="does not exist"):
        _clip(tmp_path / "missing.mp4")
    with pytest.raises(MediaError, match="no audio track"):
        load_audio(write_video(tmp_path / "silent.mp4", moving_pattern(5, 32, 32), 24), RATE)


def test_audio_is_resampled_and_fitted(tmp_path: Path) -> None:
    audio = load_audio(write_audio(tmp_path / "v.wav", sine_tone(2.0, 330, 22050), 22050), RATE)
    assert audio.shape[0] == 2 and abs(audio.shape[1] - 2 * RATE) <= 64
    assert load_audio(tmp_path / "v.wav", RATE, max_seconds=0.5).shape[1] == RATE // 2
    assert fit_audio(audio, 100).shape == (2, 100)
    padded = fit_audio(audio, audio.shape[1] + 10)
    assert padded.shape[1] == audio.shape[1] + 10 and padded[:, -10:].abs().max() == 0


def test_generated_frames_survive_the_codec(tmp_path: Path) -> None:
    frames = moving_pattern(24, 64, 96, seed=9)
    decoded = _clip(write_video(tmp_path / "p.mp4", frames, 24)).frames
    assert np.abs(decoded.astype(int) - frames[:22].astype(int)).mean() < 8


@pytest.mark.parametrize("channels", [1, 2])
def test_reference_video_keeps_its_rate_size_and_sound(channels: int, tmp_path: Path) -> None:
    tone = sine_tone(2.0, 500, 44100, channels)
    path = write_video(tmp_path / "r.mp4", moving_pattern(50, 48, 80), 25, tone, 44100)
    video = load_video(path, max_seconds=1.0)
    assert video.fps == 25.0 and video.frames.shape[1:] == (48, 80, 3)
    assert 25 <= video.frames.shape[0] <= 27
    # The soundtrack as the file has it, for the pipeline to normalize: diffusers' own decode, cut.
    assert video.sample_rate == 44100 and video.audio.shape == (channels, 44100)
    theirs = MiniMaxH3VideoReference.from_file(path)
    assert theirs.sample_rate == video.sample_rate
    assert torch.equal(video.audio, theirs.audio[:, :44100])
