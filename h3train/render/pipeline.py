"""Rendering with the live model through diffusers' own H3 blocks.

`LiveTransformer` stands in for `MiniMaxH3Transformer3DModel` in the pipeline: its forward takes what
`MiniMaxH3LoopDenoiser` passes a transformer and calls the trainer's sharded, sequence-parallel
model (`SequenceParallelH3`, the same ten forward arguments) with it, returning the
`(video, audio)` velocities the diffusers model returns with `return_dict=False`. Everything else is
the pipeline's: the task's core denoise blocks (layout, conditioning noise, noise draw order from the
request's generator, the two `MiniMaxH3Scheduler` schedules with their shifts, the loop), then
`MiniMaxH3DecodeStep` (video and audio VAE decoders).

Under sequence parallelism every rank of the SP group runs the same blocks on the same request and
generator, so the loop's inputs are identical on each and the gathered velocities are too.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from diffusers.video_processor import VideoProcessor
from torch import nn

from ..data.stand_in import AUDIO_SHIFT, VIDEO_SHIFT
from ..encode.media import FPS, write_video
from ..infra.quiet import diffusers_log_level
from ..tasks.table import DENOISE_BLOCKS_MODULE, SAMPLE_TASKS
from .request_encoding import Conditioning


def core_step(task: str) -> type:
    """The core denoise block class diffusers renders a `task` request with (`SampleTask.denoise_block`)."""
    return getattr(importlib.import_module(DENOISE_BLOCKS_MODULE), SAMPLE_TASKS[task].denoise_block)


class RenderPipeline(MiniMaxH3ModularPipeline):
    """diffusers' H3 pipeline on a chosen execution device, with the 5-15 s duration window lifted.

    The window is the released model's training range; short validation clips outside it are still
    rendered by the same blocks (`validation.samples[i].frames`).
    """

    min_duration = 0.0
    max_duration = math.inf

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = torch.device(device)

    @property
    def _execution_device(self) -> torch.device:
        return self._device


class LiveTransformer(nn.Module):
    """The transformer the pipeline calls: forwards to `model(...)` (the ten `FORWARD_ARGS`) on `device`.

    `model` is not registered as a submodule, so nothing the pipeline does to its components (moving,
    casting, offloading) reaches the training model. `config` is the diffusers model's config, which
    the pipeline reads (`patch_size`).
    """

    def __init__(self, model: Callable[..., tuple[torch.Tensor, torch.Tensor]], config: Any, device: torch.device):
        super().__init__()
        self._live = [model]
        self.config = config
        self.target = torch.device(device)
        # Forwards run by this rank since the counter was last reset (tests count them).
        self.forwards = 0

    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_kwargs:
            raise ValueError("the live model takes no attention_kwargs")
        if return_dict:
            raise ValueError("the live model returns the (video, audio) tuple of return_dict=False")
        args = (
            hidden_states,
            audio_hidden_states,
            encoder_hidden_states,
            timestep,
            timestep_indices,
            token_tags,
            position_ids,
            video_indices,
            audio_indices,
            text_indices,
        )
        self.forwards += 1
        video, audio = self._live[0](*(t.to(self.target) for t in args))
        return video.to(hidden_states.device), audio.to(hidden_states.device)


def render_pipeline(
    transformer: nn.Module, device: torch.device, vae: nn.Module | None = None, audio_vae: nn.Module | None = None
) -> RenderPipeline:
    """A pipeline whose `transformer` and `transformer_ref` are `transformer`, with the released schedules."""
    pipe = RenderPipeline(device)
    components: dict[str, Any] = {
        "transformer": transformer,
        "transformer_ref": transformer,
        "scheduler": MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
        "audio_scheduler": MiniMaxH3Scheduler(shift=AUDIO_SHIFT),
        # `MiniMaxH3VideoDecodeStep`'s own spec: the block reverts the VAE's normalization itself.
        "video_processor": VideoProcessor(vae_scale_factor=16, do_normalize=False),
    }
    if vae is not None:
        components.update(vae=vae, audio_vae=audio_vae)
    # Registering components made outside a `ComponentSpec` logs a notice per component; they are meant so.
    with diffusers_log_level(logging.ERROR):
        pipe.update_components(**components)
    return pipe


def denoising_steps(num_inference_steps: int) -> int:
    """The steps, one forward each, of a render with `num_inference_steps` sigma grid points.

    diffusers' H3 scheduler counts the terminal sigma 0 among the points and runs no step for it, so
    this is the video schedule's timesteps as `render_pipeline`'s scheduler builds them: one fewer.
    """
    scheduler = MiniMaxH3Scheduler(shift=VIDEO_SHIFT)
    scheduler.set_timesteps(num_inference_steps)
    return len(scheduler.timesteps)


def render_line(requests: int, step: int, num_inference_steps: int, folder: Path) -> str:
    """The console line that announces a render of `requests` validation samples after step `step`."""
    steps = denoising_steps(num_inference_steps)
    return (
        f"rendering {requests} validation sample{'s' * (requests != 1)} after step {step} "
        f"({steps} denoising step{'s' * (steps != 1)} each: validation.num_inference_steps={num_inference_steps} "
        f"counts the final sigma 0) into {folder}"
    )


@torch.no_grad()
def denoise(
    pipe: RenderPipeline, cond: Conditioning, num_inference_steps: int, progress: dict[str, Any] | None = None
) -> PipelineState:
    """Run the task's core denoise blocks on one request; the state holds `latents` and `audio_latents`.

    `latents` `[1, 24, F, h, w]` and `audio_latents` `[2, 32, n]` as `MiniMaxH3AfterDenoiseStep` leaves them.
    The request's generator is a CPU generator seeded with its seed, as a user passes one to the pipeline.
    """
    core = core_step(cond.request.task)()
    core.sub_blocks["denoise"].set_progress_bar_config(**(progress or {"disable": True}))
    state = PipelineState()
    values = {
        **cond.pipeline_inputs(pipe._execution_device),
        "generator": torch.Generator().manual_seed(cond.request.seed),
        "num_inference_steps": num_inference_steps,
    }
    for key, value in values.items():
        state.set(key, value)
    core(pipe, state)
    return state


@torch.no_grad()
def decode(pipe: RenderPipeline, state: PipelineState) -> tuple[np.ndarray, torch.Tensor, int]:
    """`MiniMaxH3DecodeStep` on a denoised state: frames `[T, H, W, 3]` uint8, soundtrack `[2, N]`, its rate."""
    state.set("output_type", "np")
    MiniMaxH3DecodeStep()(pipe, state)
    video = state.get("videos")[0]
    # As `VaeImageProcessor.numpy_to_pil` rounds a [0, 1] image to bytes.
    frames = (video * 255).round().astype(np.uint8)
    return frames, state.get("audio")[0].float().cpu(), int(state.get("sampling_rate"))


def fresh_path(folder: Path, stem: str, suffix: str) -> Path:
    """`folder/stem.suffix`, or `stem.2.suffix`, `stem.3.suffix`, ...: a name no existing file has."""
    path, n = folder / f"{stem}{suffix}", 2
    while os.path.lexists(path):
        path, n = folder / f"{stem}.{n}{suffix}", n + 1
    return path


def write_clip(
    folder: Path,
    stem: str,
    frames: np.ndarray,
    audio: torch.Tensor | Sequence[torch.Tensor],
    sample_rate: int,
    titles: Sequence[str] = (),
) -> Path:
    """Write an H.264 + AAC mp4 of the frames at 24 fps with the soundtrack cut to the clip's length.

    `audio` `[2, N]`, or a list of them: one audio stream each, titled by `titles` (`write_video`).
    Written under a temporary name and linked to a fresh one, so no existing file is ever replaced and
    no reader sees a partial file. Returns the path written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    samples = round(frames.shape[0] / FPS * sample_rate)
    tracks = [audio] if isinstance(audio, torch.Tensor) else list(audio)
    tmp = folder / f".{stem}.{uuid.uuid4().hex}.mp4"
    try:
        write_video(tmp, frames, FPS, [t[:, :samples].numpy() for t in tracks], sample_rate, titles)
        while True:
            path = fresh_path(folder, stem, ".mp4")
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            except OSError:
                # A filesystem without hard links: one writer per name, so a checked rename is enough.
                if os.path.lexists(path):
                    continue
                os.replace(tmp, path)
            return path
    finally:
        tmp.unlink(missing_ok=True)
