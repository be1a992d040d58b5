"""The inputs h3train trains on equal what diffusers' pipeline blocks build for the same request.

Each case writes a cached sample, reads it back as a `TrainingSample`, and runs the pipeline's own
block sequence (the workflow's core-denoise blocks up to, not including, the denoising loop) on the
same latents and text tags. Compared exactly: the layout (positions, tags, the three index tensors,
conditioning row counts), the video and audio rows (row order), and the per-step
`(timestep, timestep_indices)` plan against `row_timesteps`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

from h3train.data.sample_file import CachedSample
from h3train.data.synthetic_dataset import synthetic_sample
from h3train.tasks.conditioning import ReferenceLatents

from helpers.pipeline import check_against_pipeline


@pytest.mark.parametrize(("index", "anchors"), [(0, ("first",)), (1, ("last",)), (2, ("first", "last")), (3, ())])
def test_fl2va_and_t2va_match_pipeline(index: int, anchors: tuple[str, ...], tmp_path: Path) -> None:
    sample = synthetic_sample("fl2va", index, seed=3, text_dim=8)
    assert sample.keyframe_anchors == anchors
    assert sample.task == ("fl2va" if anchors else "t2va")
    check_against_pipeline(sample, tmp_path)


@pytest.mark.parametrize(
    ("index", "plan"),
    [
        (0, [("image", False)]),
        (1, [("video", True)]),
        (2, [("video", False)]),
        (3, [("image", False), ("audio", True)]),
        (4, [("audio", True), ("video", True), ("image", False), ("video", False), ("image", False)]),
        (5, [("image", False), ("image", False)]),
    ],
)
def test_ref2va_matches_pipeline(index: int, plan: list[tuple[str, bool]], tmp_path: Path) -> None:
    sample = synthetic_sample("ref2va", index, seed=3, text_dim=8)
    assert [(r.kind, r.has_audio) for r in sample.references] == plan
    check_against_pipeline(sample, tmp_path)


def _released_geometry_sample(task: str) -> CachedSample:
    """124 frames (37 latent frames, 207 audio latents) on a 64x96 canvas: real durations, tiny canvas."""
    g = torch.Generator().manual_seed(7)
    video = torch.randn(24, 37, 4, 6, generator=g)
    tags = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1])
    kwargs: dict = {}
    if task == "fl2va":
        kwargs = {"keyframe_anchors": ("first", "last"), "keyframes": (video[:, :1], video[:, -1:])}
    else:
        kwargs = {
            "references": (
                ReferenceLatents(
                    "video", video=torch.randn(24, 7, 6, 4, generator=g), audio=torch.randn(2, 32, 37, generator=g)
                ),
                ReferenceLatents("audio", audio=torch.randn(2, 32, 150, generator=g)),
                ReferenceLatents("image", video=torch.randn(24, 1, 8, 6, generator=g)),
                ReferenceLatents("video", video=torch.randn(24, 12, 4, 4, generator=g)),
            )
        }
    return CachedSample(
        sample_id=f"released-{task}",
        task=task,
        num_frames=124,
        video_latents=video,
        audio_latents=torch.randn(2, 32, 207, generator=g),
        prompt_embeds=torch.randn(len(tags), 8, generator=g),
        text_token_tags=tags,
        negative_prompt_embeds=torch.randn(1, 8, generator=g),
        negative_text_token_tags=torch.ones(1, dtype=torch.long),
        **kwargs,
    )


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_released_durations_match_unmodified_pipeline(task: str, tmp_path: Path) -> None:
    check_against_pipeline(_released_geometry_sample(task), tmp_path, pipeline_cls=MiniMaxH3ModularPipeline)
