"""diffusers' own MiniMax-H3 pipeline blocks run on a cached sample, and h3train's inputs held against them.

`check_against_pipeline` writes a sample, reads it back as a `TrainingSample`, and runs the pipeline's
block sequence (the workflow's core-denoise blocks up to, not including, the denoising loop) on the
same latents and text tags; the layout, the rows and the per-step timestep plan must be equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
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

from h3train.data.sample_file import CachedSample, read_sample, write_sample
from h3train.tasks.conditioning import ReferenceLatents
from h3train.tasks.layout import row_timesteps
from h3train.tasks.sample import TrainingSample

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


def _assert_layout_matches(packed: TrainingSample, tags: torch.Tensor, state: PipelineState) -> None:
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


def check_against_pipeline(sample: CachedSample, tmp_path: Path, pipeline_cls: type = TinyClipPipeline) -> None:
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
