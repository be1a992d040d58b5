"""One training sample as the model consumes it, and its packed layout.

The layout is always built by diffusers' own builders (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`
for t2va / fl2va, `MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence` for ref2va), so a
fine-tune sees exactly the sequences inference builds:

    [text | conditioning rows | target audio | target video]

Row conventions (diffusers'): video rows are `patchify_video_latents` rows, conditioning rows first;
audio rows are stereo channel-major (all left latents, then all right), reference rows first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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

from .table import SAMPLE_TASKS

PATCH_SIZE: tuple[int, int, int] = (1, 2, 2)
AUDIO_CHANNELS: int = MINIMAX_H3_AUDIO_CHANNELS
VIDEO_TAG: int = MINIMAX_H3_VIDEO_TAG
AUDIO_TAG: int = MINIMAX_H3_AUDIO_TAG


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


def build_layout(
    task: str,
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    keyframe_anchors: tuple[str, ...] = (),
    references: tuple[ReferenceSpec, ...] = (),
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> Layout:
    """Build the packed layout with the diffusers builder of `task` (a `SAMPLE_TASKS` name: its `layout`)."""
    builder = SAMPLE_TASKS[task].layout if task in SAMPLE_TASKS else None
    if builder == "packed":
        out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
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
    elif builder == "ref2va":
        # The builder reads only `.kind` / `.has_audio` of a reference and the shapes of the latents,
        # so shape-only meta tensors stand in for them.
        refs = [SimpleNamespace(kind=r.kind, has_audio=r.has_audio) for r in references]
        visual = [
            torch.empty(1, 1, r.latent_frames, r.latent_height, r.latent_width, device="meta")
            for r in references
            if r.is_visual
        ]
        audio = [
            torch.empty(r.num_audio_latents * AUDIO_CHANNELS, 1, device="meta") for r in references if r.carries_audio
        ]
        out = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
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
    else:
        raise ValueError(f"unknown task {task!r}; expected one of {tuple(SAMPLE_TASKS)}")
    return Layout(*out)


def audio_latents_to_rows(latents: torch.Tensor) -> torch.Tensor:
    """`[2, C, F_a]` stereo latents -> `[2 * F_a, C]` channel-major rows, as the pipeline packs them."""
    if latents.ndim != 3 or latents.shape[0] != AUDIO_CHANNELS:
        raise ValueError(f"audio latents must be [{AUDIO_CHANNELS}, C, F], got {list(latents.shape)}")
    return latents.permute(0, 2, 1).reshape(-1, latents.shape[1])


def video_latents_to_rows(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """`[C, F, H, W]` latents -> `[F*H*W/4, C*4]` rows (diffusers' `patchify_video_latents`)."""
    return patchify_video_latents(latents[None], patch_size)


@dataclass
class PackedSample:
    """One training sample before noising.

    video_rows `[N_v, 24 * 4]`: clean conditioning rows (keyframes / visual references), then clean
    target rows. audio_rows `[N_a, 32]`: clean reference rows, then target rows (zeros when the clip
    has no sound; `has_audio = False` then zeroes the audio loss). prompt_embeds `[L, D]` with
    text_token_tags `[L]` (vision tokens tagged 0); the negative pair is for CFG: the prompt " " as
    text only, and optionally with the conditioning's vision blocks kept (`negative_visual_*`).
    """

    sample_id: str
    task: str
    geometry: Geometry
    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    prompt_embeds: torch.Tensor
    text_token_tags: torch.Tensor
    has_audio: bool = True
    keyframe_anchors: tuple[str, ...] = ()
    references: tuple[ReferenceSpec, ...] = ()
    negative_prompt_embeds: torch.Tensor | None = None
    negative_text_token_tags: torch.Tensor | None = None
    negative_visual_prompt_embeds: torch.Tensor | None = None
    negative_visual_text_token_tags: torch.Tensor | None = None
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = self.layout_for(self.text_token_tags)
        nv, na = self.layout.video_indices.numel(), self.layout.audio_indices.numel()
        for kind, rows, expected in (("video", self.video_rows, nv), ("audio", self.audio_rows, na)):
            if rows.shape[0] != expected:
                raise ValueError(f"sample {self.sample_id}: {rows.shape[0]} {kind} rows, layout has {expected}")

    def layout_for(self, text_token_tags: torch.Tensor) -> Layout:
        """The layout of this sample under another text prefix (the negative prompt for CFG)."""
        return build_layout(self.task, text_token_tags, self.geometry, self.keyframe_anchors, self.references)

    def meta(self) -> dict:
        """Task and geometry: everything needed to rebuild the layout."""
        return {
            "sample_id": self.sample_id,
            "task": self.task,
            "num_latent_frames": self.geometry.num_latent_frames,
            "latent_height": self.geometry.latent_height,
            "latent_width": self.geometry.latent_width,
            "num_audio_latents": self.geometry.num_audio_latents,
            "has_audio": self.has_audio,
            "keyframe_anchors": list(self.keyframe_anchors),
            "references": [asdict(r) for r in self.references],
            "text_len": int(self.text_token_tags.numel()),
            "seq_len": self.layout.seq_len,
        }
