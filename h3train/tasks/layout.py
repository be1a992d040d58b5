"""The packed layout: its geometry, its rows' conventions and diffusers' two layout builders.

The layout is always built by diffusers' own builders (`packed_layout`: `MiniMaxH3PrepareLayoutStep.
build_packed_sequence`, for t2va / fl2va; `ref2va_layout`: `MiniMaxH3Ref2VAPrepareLayoutStep.
build_ref2va_packed_sequence`), so a fine-tune sees exactly the sequences inference builds:

    [text | conditioning rows | target audio | target video]

Row conventions (diffusers'): video rows are `patchify_video_latents` rows, conditioning rows first;
audio rows are stereo channel-major (all left latents, then all right), reference rows first.
Which builder a sample task's layout takes is its conditioning kind's (`tasks/conditioning.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_VIDEO_TAG,
    MiniMaxH3ModularPipeline,
)

PATCH_SIZE: tuple[int, int, int] = (1, 2, 2)
AUDIO_CHANNELS: int = MINIMAX_H3_AUDIO_CHANNELS
VIDEO_TAG: int = MINIMAX_H3_VIDEO_TAG
AUDIO_TAG: int = MINIMAX_H3_AUDIO_TAG
# Latent channels of H3's VAEs: video latents are [24, F, H, W], audio latents [2 (stereo), 32, F_a].
VIDEO_LATENT_CHANNELS: int = 24
AUDIO_LATENT_CHANNELS: int = 32


def _pipeline_constant(name: str) -> float:
    """A constant `MiniMaxH3ModularPipeline` exposes as a property; it reads nothing of the instance."""
    return float(getattr(MiniMaxH3ModularPipeline, name).fget(None))


# The `t` visual conditioning rows are noised to and held at: the pipeline's `keyframe_noise_aug` (0.999).
# The released model was trained with slightly noised anchors, so a clean 1.0 would be off-distribution.
CONDITION_VIDEO_T: float = _pipeline_constant("keyframe_noise_aug")
# Reference soundtracks condition clean (`MiniMaxH3SetTimestepsStep` passes 1.0 for them).
REFERENCE_AUDIO_T: float = 1.0


@dataclass(frozen=True)
class Geometry:
    """Target geometry in latent units: video `[24, F, H, W]`, audio `F_a` latents per channel."""

    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int

    def video_rows(self, patch_size: tuple[int, int, int] = PATCH_SIZE) -> int:
        pt, ph, pw = patch_size
        return (self.num_latent_frames // pt) * (self.latent_height // ph) * (self.latent_width // pw)

    def audio_rows(self) -> int:
        return self.num_audio_latents * AUDIO_CHANNELS


@dataclass(frozen=True)
class ReferenceSpec:
    """One ref2va reference as the layout needs it.

    `kind` is `image | video | audio`. Visual references carry their latent shape `(F, H, W)`;
    audio-bearing ones (`audio`, or `video` with `has_audio`) their latent count per channel.
    """

    kind: str
    has_audio: bool = False
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    num_audio_latents: int = 0

    @property
    def is_visual(self) -> bool:
        return self.kind in ("image", "video")

    @property
    def carries_audio(self) -> bool:
        return self.kind == "audio" or (self.kind == "video" and self.has_audio)


@dataclass
class Layout:
    """The structural model inputs of one packed sequence of length `S`.

    position_ids `[S, 3]` float64 `(t, h, w)`; token_tags `[S]` long (0 video, 1 text, 2 audio);
    video/audio/text_indices: sequence positions of each modality's rows, conditioning rows first.
    """

    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int

    @property
    def seq_len(self) -> int:
        return int(self.position_ids.shape[0])


def row_timesteps(layout: Layout, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's `(timestep, timestep_indices)` for one packed sequence, as the pipeline assigns them.

    Target video and text rows get `video_t`, target audio rows `audio_t`, visual conditioning rows
    `max(video_t, CONDITION_VIDEO_T)`, reference audio rows `REFERENCE_AUDIO_T`. Returns the sorted distinct
    float32 timesteps `[T]` and every row's index into them `[S]` (diffusers' `build_row_timesteps`).
    """
    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_indices,
        layout.audio_indices,
        layout.num_condition_video_rows,
        layout.num_condition_audio_rows,
        layout.text_indices.numel(),
        float(video_t),
        float(audio_t),
        max(float(video_t), CONDITION_VIDEO_T),
        REFERENCE_AUDIO_T,
    )


def packed_layout(
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    keyframe_anchors: tuple[str, ...] = (),
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> Layout:
    """The t2va / fl2va layout (`build_packed_sequence`): text, the keyframes' rows in `keyframe_anchors`
    order (none for t2va), target audio, target video."""
    return Layout(
        *MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_token_tags,
            geometry.num_latent_frames,
            geometry.latent_height,
            geometry.latent_width,
            geometry.num_audio_latents,
            patch_size,
            AUDIO_CHANNELS,
            AUDIO_TAG,
            VIDEO_TAG,
            tuple(keyframe_anchors),
        )
    )


def ref2va_layout(
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    references: tuple[ReferenceSpec, ...],
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> Layout:
    """The ref2va layout (`build_ref2va_packed_sequence`): text, the references' rows in request order,
    target audio, target video."""
    # The builder reads only `.kind` / `.has_audio` of a reference and the shapes of the latents,
    # so shape-only meta tensors stand in for them.
    refs = [SimpleNamespace(kind=r.kind, has_audio=r.has_audio) for r in references]
    visual = [
        torch.empty(1, 1, r.latent_frames, r.latent_height, r.latent_width, device="meta")
        for r in references
        if r.is_visual
    ]
    audio = [torch.empty(r.num_audio_latents * AUDIO_CHANNELS, 1, device="meta") for r in references if r.carries_audio]
    return Layout(
        *MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            text_token_tags,
            refs,
            visual,
            audio,
            geometry.num_latent_frames,
            geometry.latent_height,
            geometry.latent_width,
            geometry.num_audio_latents,
            patch_size,
            AUDIO_CHANNELS,
            AUDIO_TAG,
            VIDEO_TAG,
        )
    )


def audio_latents_to_rows(latents: torch.Tensor) -> torch.Tensor:
    """`[2, C, F_a]` stereo latents -> `[2 * F_a, C]` channel-major rows, as the pipeline packs them."""
    if latents.ndim != 3 or latents.shape[0] != AUDIO_CHANNELS:
        raise ValueError(f"audio latents must be [{AUDIO_CHANNELS}, C, F], got {list(latents.shape)}")
    return latents.permute(0, 2, 1).reshape(-1, latents.shape[1])


def video_latents_to_rows(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """`[C, F, H, W]` latents -> `[F*H*W/4, C*4]` rows (diffusers' `patchify_video_latents`)."""
    return patchify_video_latents(latents[None], patch_size)
