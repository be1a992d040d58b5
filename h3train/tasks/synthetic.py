"""Synthetic t2va / fl2va samples (`data.source=synthetic`): random latents and text embeddings of a real H3 geometry.

Which of the two a run gets is the training task's: keyframe samples (`data.synthetic.keyframe_anchors`)
only when `task.name` trains fl2va samples, text-only ones otherwise. Sample `i` is a pure function of
`(seed, i)`, so every rank that asks for it gets the same tensors.

Made in memory, packed, all of the one geometry `data.synthetic` sets: a stand-in for a real run's
shapes (bench, plan, step measurements). `data/synthetic_dataset.py` writes a cached dataset instead, whose
samples vary in geometry and conditioning to exercise every layout and the file format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames, video_latent_num_frames

from ..config import SyntheticDataConfig
from ..errors import ConfigError
from .layout import (
    AUDIO_LATENT_CHANNELS,
    VIDEO_LATENT_CHANNELS,
    Geometry,
    audio_latents_to_rows,
    video_latents_to_rows,
)
from .sample import TrainingSample
from .table import TRAINING_TASKS, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK, sample_task_of


def synthetic_anchors(cfg: SyntheticDataConfig, task: str) -> tuple[str, ...]:
    """The keyframe anchors of the synthetic samples `task.name=task` trains on (none: t2va samples).

    `data.synthetic.keyframe_anchors` when the task trains fl2va samples; none otherwise, so a t2va run
    never sees an anchor whatever the synthetic section says. Raises `ConfigError` for a task that trains
    neither t2va nor fl2va samples (ref2va: this source makes no references).
    """
    trained = TRAINING_TASKS[task].sample_tasks
    anchors = tuple(cfg.keyframe_anchors) if sample_task_of("keyframes") in trained else ()
    made = sample_task_of("keyframes" if anchors else None)
    if made not in trained:
        raise ConfigError(
            f"config key 'data.source' is 'synthetic', which makes {made} samples, but task.name={task} trains "
            f"{', '.join(trained)} samples; write a synthetic dataset instead (data.source=cached, "
            "data.create_synthetic=true)"
        )
    return anchors


class SyntheticSource:
    """Indexable source of the `TrainingSample`s `task.name=task` trains: fl2va, or t2va (see `synthetic_anchors`)."""

    def __init__(self, cfg: SyntheticDataConfig, text_dim: int, seed: int, task: str = "fl2va") -> None:
        self.cfg = cfg
        self.text_dim = text_dim
        self.seed = seed
        self.anchors = synthetic_anchors(cfg, task)
        self.sample_task = sample_task_of("keyframes" if self.anchors else None)
        self.geometry = Geometry(cfg.num_latent_frames, cfg.latent_height, cfg.latent_width, cfg.num_audio_latents)

    def __len__(self) -> int:
        return self.cfg.num_samples

    @property
    def lengths(self) -> list[int]:
        """Packed length of every sample (all share one geometry and text length)."""
        return [self[0].layout.seq_len] * len(self)

    def __getitem__(self, index: int) -> TrainingSample:
        cfg, geo = self.cfg, self.geometry
        g = torch.Generator().manual_seed(self.seed * 7919 + index + 1)
        video = torch.randn(
            VIDEO_LATENT_CHANNELS, geo.num_latent_frames, geo.latent_height, geo.latent_width, generator=g
        )
        audio = torch.randn(2, AUDIO_LATENT_CHANNELS, geo.num_audio_latents, generator=g)
        if not cfg.has_audio:
            audio.zero_()
        anchors = self.anchors
        # Keyframe latents are the target's own first / last latent frame, as when encoded from the clip.
        frame_of = {"first": 0, "last": geo.num_latent_frames - 1}
        cond = [video_latents_to_rows(video[:, frame_of[a] : frame_of[a] + 1]) for a in anchors]
        video_rows = torch.cat([*cond, video_latents_to_rows(video)])
        tags = torch.ones(cfg.text_len, dtype=torch.long)
        # Vision tokens of the keyframe presentation sit after the first text token and are tagged video (0).
        if anchors and cfg.vision_tokens:
            tags[1 : 1 + cfg.vision_tokens] = 0
        prompt = torch.randn(cfg.text_len, self.text_dim, generator=g)
        negative = torch.randn(max(1, cfg.text_len // 3), self.text_dim, generator=g)
        # The negative presentation that keeps the keyframes' vision blocks: the same vision rows as
        # the prompt, between the first negative token and the rest.
        vision = prompt[tags == 0]
        negative_visual = torch.cat([negative[:1], vision, negative[1:]])
        negative_visual_tags = torch.ones(negative_visual.shape[0], dtype=torch.long)
        negative_visual_tags[1 : 1 + vision.shape[0]] = 0
        return TrainingSample(
            sample_id=f"synthetic-{index:06d}",
            task=self.sample_task,
            geometry=geo,
            video_rows=video_rows,
            audio_rows=audio_latents_to_rows(audio),
            prompt_embeds=prompt,
            text_token_tags=tags,
            has_audio=cfg.has_audio,
            keyframe_anchors=anchors,
            negative_prompt_embeds=negative,
            negative_text_token_tags=torch.ones(negative.shape[0], dtype=torch.long),
            negative_visual_prompt_embeds=negative_visual,
            negative_visual_text_token_tags=negative_visual_tags,
        )


@dataclass(frozen=True)
class Clip:
    """The benchmarked FL2VA sample in pixels: `frames` (17 n + 5) of `height` x `width` (multiples of 32).

    `text_len` rows of text prefix, the first `vision_tokens` after the first token tagged video, as
    the keyframes' vision blocks are; the split only decides which AdaLN rows are read.
    """

    frames: int
    height: int
    width: int
    text_len: int
    vision_tokens: int


def clip_data(clip: Clip, num_samples: int = 1) -> SyntheticDataConfig:
    """Synthetic FL2VA samples of `clip`'s geometry (first + last keyframes, stereo audio).

    The one description of a benchmarked or rehearsed clip's data: `clip_sample` draws from it, and the
    bench's trainers train on it.
    """
    return SyntheticDataConfig(
        num_samples=num_samples,
        text_len=clip.text_len,
        vision_tokens=clip.vision_tokens,
        num_latent_frames=video_latent_num_frames(clip.frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK),
        latent_height=clip.height // 16,
        latent_width=clip.width // 16,
        num_audio_latents=audio_latent_num_frames(clip.frames),
        keyframe_anchors=["first", "last"],
    )


def clip_sample(clip: Clip, text_dim: int, seed: int) -> TrainingSample:
    """One random FL2VA sample (first + last keyframes, stereo audio) of `clip`'s geometry."""
    return SyntheticSource(clip_data(clip), text_dim, seed)[0]
