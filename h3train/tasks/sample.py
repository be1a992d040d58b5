"""One training sample as the model consumes it: its rows, its text and the layout of its sample task."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .conditioning import conditioning_of
from .layout import PATCH_SIZE, Geometry, Layout, ReferenceSpec, packed_layout
from .table import SAMPLE_TASKS


def build_layout(
    task: str,
    text_token_tags: torch.Tensor,
    geometry: Geometry,
    keyframe_anchors: tuple[str, ...] = (),
    references: tuple[ReferenceSpec, ...] = (),
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> Layout:
    """The packed layout of a sample of `task` (a `SAMPLE_TASKS` name), built by its conditioning kind.

    `keyframe_anchors` / `references` are the conditioning fields of a `TrainingSample`; each kind reads its own.
    A prompt-only task has diffusers' packed layout with no conditioning rows.
    """
    if task not in SAMPLE_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {tuple(SAMPLE_TASKS)}")
    kind = conditioning_of(task)
    if kind is None:
        return packed_layout(text_token_tags, geometry, patch_size=patch_size)
    fields = {"keyframe_anchors": tuple(keyframe_anchors), "references": tuple(references)}
    return kind.build_layout(text_token_tags, geometry, fields, patch_size)


@dataclass
class TrainingSample:
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
