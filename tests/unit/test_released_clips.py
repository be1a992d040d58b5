"""The released clips' facts (`tasks/released.py`) follow from diffusers' rules: its frame and audio counts,
its canvas rule and the layout builders' packed rows, and the encoder's default settings make that canvas."""

from __future__ import annotations

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_FPS,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)

from h3train.encode.clip import EncodeSettings
from h3train.tasks import released
from h3train.tasks.layout import Geometry
from h3train.tasks.sample import build_layout
from h3train.tasks.table import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK


@pytest.mark.parametrize(
    ("seconds", "pixel_frames", "geometry", "rows"),
    [
        (15, released.LONGEST_PIXEL_FRAMES, released.LONGEST_GEOMETRY, released.LONGEST_ROWS),
        (5, released.SHORT_PIXEL_FRAMES, released.SHORT_GEOMETRY, released.SHORT_ROWS),
    ],
)
def test_each_released_clip_is_what_diffusers_encodes_and_packs(
    seconds: int, pixel_frames: int, geometry: tuple[int, ...], rows: int
) -> None:
    # A `17 n + 5` frame count, the one nearest the clip's seconds at the pipeline's rate.
    assert (pixel_frames - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK == 0
    assert abs(pixel_frames - seconds * MINIMAX_H3_FPS) <= VAE_FRAMES_PER_CHUNK // 2
    frames, height, width, audio = geometry
    assert frames == video_latent_num_frames(pixel_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    assert audio == audio_latent_num_frames(pixel_frames)
    assert (height, width) == released.LATENT_SIZE
    tags = torch.ones(released.TEXT_ROWS, dtype=torch.long)
    layout = build_layout("fl2va", tags, Geometry(*geometry), ("first", "last"))
    assert layout.seq_len == rows
    one_frame = Geometry(1, height, width, 0).video_rows()
    assert 2 * one_frame == released.KEYFRAME_ROWS


def test_the_canvas_is_the_encoders_default_and_the_latents_its_sixteenth() -> None:
    settings = EncodeSettings()
    height, width = released.CANVAS
    assert (settings.short_edge, settings.max_pixels) == (height, height * width)
    assert resolve_canvas_size(16, 9, 32, settings.short_edge, settings.max_pixels) == (height, width)
    assert (height // 16, width // 16) == released.LATENT_SIZE
    assert 0 < released.VISION_TOKENS < released.TEXT_ROWS
