"""The inputs h3train trains on equal what diffusers' pipeline blocks build for the same request.

Each case writes a cached sample, reads it back as a `PackedSample`, and runs the pipeline's own
block sequence (the workflow's core-denoise blocks up to, not including, the denoising loop) on the
same latents and text tags. Compared exactly: the layout (positions, tags, the three index tensors,
conditioning row counts), the video and audio rows (row order), and the per-step
`(timestep, timestep_indices)` plan against `row_timesteps`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
    MiniMaxH3CoreDenoiseStep,
    MiniMaxH3FL2VACoreDenoiseStep,
    MiniMaxH3Ref2VACoreDenoiseStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

from h3train.data.conditioning import ReferenceLatents
from h3train.data.format import CachedSample, read_sample, write_sample
from h3train.data.synth import synthetic_sample
from h3train.tasks.layout import PackedSample, row_timesteps

VAE_SCALE = 16
NUM_STEPS = 6
CORE_STEPS = {
    "t2va": MiniMaxH3CoreDenoiseStep,
    "fl2va": MiniMaxH3FL2VACoreDenoiseStep,
    "ref2va": MiniMaxH3Ref2VACoreDenoiseStep,
}


class TinyClipPipeline(MiniMaxH3ModularPipeline):
    """The released pipeline with the 5 s minimum lifted: the synthetic clips are 5 or 22 frames."""

    min_duration = 0.0


class CleanConditioningPipeline(TinyClipPipeline):
    """Holds conditioning at t = 1, so its noised rows equal the clean latents and compare exactly."""

    keyframe_noise_aug = 1.0


def _components(cls: type[MiniMaxH3ModularPipeline]) -> MiniMaxH3ModularPipeline:
    pipe = cls()
    pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    return pipe


def _pipeline_reference(ref: ReferenceLatents) -> object:
    """A public diffusers reference of the same kind; the blocks under test read only kind and has_audio."""
    if ref.kind == "image":
        return MiniMaxH3ImageReference(image=np.zeros((32, 32, 3), dtype=np.uint8))
    if ref.kind == "video":
        soundtrack = torch.zeros(2, 800) if ref.audio is not None else None
        return MiniMaxH3VideoReference(frames=np.zeros((5, 32, 32, 3), dtype=np.uint8), audio=soundtrack)
    return MiniMaxH3AudioReference(audio=torch.zeros(2, 800))


def _request_state(sample: CachedSample, text_token_tags: torch.Tensor) -> PipelineState:
    """What the encoder blocks would hand to the core-denoise blocks for this sample."""
    geo = sample.geometry
    state = PipelineState()
    values = {
        "text_token_tags": text_token_tags,
        "height": geo.latent_height * VAE_SCALE,
        "width": geo.latent_width * VAE_SCALE,
        "num_frames": sample.num_frames,
        "generator": torch.Generator().manual_seed(0),
        "latents": sample.video_latents[None],
        "audio_latents": sample.audio_latents,
        "num_inference_steps": NUM_STEPS,
    }
    if sample.task == "fl2va":
        values["keyframe_anchors"] = tuple(sample.keyframe_anchors)
        values["condition_latents"] = [k[None] for k in sample.keyframes]
    if sample.task == "ref2va":
        values["normalized_references"] = [_pipeline_reference(r) for r in sample.references]
        values["condition_latents"] = [r.video[None] for r in sample.references if r.video is not None]
        # MiniMaxH3Ref2VAReferenceEncoderStep's packing of `[2, 32, n]` soundtrack latents.
        values["audio_condition_latents"] = [
            r.audio.transpose(1, 2).reshape(-1, r.audio.shape[1]) for r in sample.references if r.audio is not None
        ]
    for key, value in values.items():
        state.set(key, value)
    return state


def _run_blocks(sample: CachedSample, components: MiniMaxH3ModularPipeline, tags: torch.Tensor) -> PipelineState:
    blocks = CORE_STEPS[sample.task].block_classes
    # Everything before the denoising loop, in the workflow's own order.
    assert [b.__name__ for b in blocks[-2:]] in (
        ["MiniMaxH3DenoiseStep", "MiniMaxH3AfterDenoiseStep"],
        ["MiniMaxH3Ref2VADenoiseStep", "MiniMaxH3AfterDenoiseStep"],
    )
    state = _request_state(sample, tags)
    for block in blocks[:-2]:
        block()(components, state)
    return state


def _assert_layout_matches(packed: PackedSample, tags: torch.Tensor, state: PipelineState) -> None:
    layout = packed.layout_for(tags)
    for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        ours, theirs = getattr(layout, name), state.get(name)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert layout.num_condition_video_rows == state.get("num_condition_video_rows")
    assert layout.num_condition_audio_rows == state.get("num_condition_audio_rows")
    plan = state.get("row_timestep_plan")
    assert len(plan) == len(state.get("timesteps")) > 1
    for t_video, t_audio, (timestep, indices) in zip(state.get("timesteps"), state.get("audio_timesteps"), plan):
        ours_t, ours_i = row_timesteps(layout, float(t_video), float(t_audio))
        assert torch.equal(ours_t, timestep) and torch.equal(ours_i, indices)


def _check_against_pipeline(sample: CachedSample, tmp_path: Path, pipeline_cls: type = TinyClipPipeline) -> None:
    path = tmp_path / "sample.safetensors"
    write_sample(path, sample)
    packed = read_sample(path)

    state = _run_blocks(sample, _components(pipeline_cls), packed.text_token_tags)
    _assert_layout_matches(packed, packed.text_token_tags, state)
    # The CFG branches rebuild the layout for their own text prefix with the same builders.
    for tags in (packed.negative_text_token_tags, packed.negative_visual_text_token_tags):
        if tags is not None:
            _assert_layout_matches(packed, tags, _run_blocks(sample, _components(pipeline_cls), tags))

    rows = _run_blocks(sample, _components(CleanConditioningPipeline), packed.text_token_tags)
    assert torch.equal(packed.video_rows, rows.get("latents"))
    assert torch.equal(packed.audio_rows, rows.get("audio_latents"))


@pytest.mark.parametrize(("index", "anchors"), [(0, ("first",)), (1, ("last",)), (2, ("first", "last")), (3, ())])
def test_fl2va_and_t2va_match_pipeline(index: int, anchors: tuple[str, ...], tmp_path: Path) -> None:
    sample = synthetic_sample("fl2va", index, seed=3, text_dim=8)
    assert sample.keyframe_anchors == anchors
    assert sample.task == ("fl2va" if anchors else "t2va")
    _check_against_pipeline(sample, tmp_path)


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
    _check_against_pipeline(sample, tmp_path)


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
    _check_against_pipeline(_released_geometry_sample(task), tmp_path, pipeline_cls=MiniMaxH3ModularPipeline)
