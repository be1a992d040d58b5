"""Flow-matching objective in H3's conventions.

- Time: t in [0, 1], t = 1 is clean data; sigma = 1 - t.
- Noising: `x_t = t * x0 + (1 - t) * noise`; velocity target (data-ward): `v = x0 - noise`.
- One base sigma per sample, mapped through each modality's shift `s*sigma / (1 + (s-1)*sigma)`
  (video 12, audio 3), as inference steps both schedules from one base index.
- Visual conditioning rows are noised to t = 0.999 and carry `max(t_v, 0.999)`; audio reference
  rows stay clean at t = 1 (diffusers' `build_row_timesteps`, as the pipeline calls it).
- Loss: per-modality mean squared error over target rows only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

from .config import LossWeights, TimestepConfig
from .tasks.layout import PackedSample

KEYFRAME_NOISE_T = 0.999
AUDIO_REFERENCE_T = 1.0


def shift_sigma(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sample_base_sigma(cfg: TimestepConfig, generator: torch.Generator) -> float:
    if cfg.sampling == "uniform":
        return float(torch.rand((), generator=generator, dtype=torch.float64))
    z = float(torch.randn((), generator=generator, dtype=torch.float64))
    return 1.0 / (1.0 + math.exp(-(cfg.logit_mean + cfg.logit_std * z)))


def timestep_weight(cfg: TimestepConfig, sigma: float) -> float:
    """Per-sample loss weight as a function of the base sigma (`cosmap`: SD3's cosine-map density)."""
    if cfg.weighting == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * sigma + 2.0 * sigma * sigma))
    return 1.0


def step_generator(seed: int, step: int, dp_rank: int, micro: int) -> torch.Generator:
    """The RNG of one micro-batch: a function of (seed, step, DP rank, micro-batch), never the SP rank."""
    key = ((seed * 1_000_003 + step) * 65_537 + dp_rank) * 1_031 + micro
    return torch.Generator().manual_seed(key % (2**63))


@dataclass
class TrainingInputs:
    """One micro-batch, unsharded and unpadded.

    `model_inputs` holds the ten `model.forward` arguments (batch dim 1 on the row tensors).
    target_video `[N_v, 96]` / target_audio `[N_a, 32]`: velocity targets in the row order of
    `hidden_states` / `audio_hidden_states`; loss masks are 1 on target rows, 0 on conditioning rows.
    weight_video / weight_audio: the full factor each modality's MSE is multiplied by.
    """

    model_inputs: dict[str, torch.Tensor]
    target_video: torch.Tensor
    target_audio: torch.Tensor
    loss_mask_video: torch.Tensor
    loss_mask_audio: torch.Tensor
    weight_video: float
    weight_audio: float
    sigma: float
    t_video: float
    t_audio: float

    def to(self, device: torch.device) -> TrainingInputs:
        moved = {k: v.to(device) for k, v in self.model_inputs.items()}
        return TrainingInputs(
            moved, self.target_video.to(device), self.target_audio.to(device), self.loss_mask_video.to(device),
            self.loss_mask_audio.to(device), self.weight_video, self.weight_audio, self.sigma, self.t_video,
            self.t_audio,
        )


def make_training_inputs(
    sample: PackedSample, generator: torch.Generator, tcfg: TimestepConfig, weights: LossWeights
) -> TrainingInputs:
    layout = sample.layout
    sigma = sample_base_sigma(tcfg, generator)
    t_video = 1.0 - shift_sigma(sigma, tcfg.video_shift)
    t_audio = 1.0 - shift_sigma(sigma, tcfg.audio_shift)
    ncv, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows

    x0_video = sample.video_rows.float()
    x0_audio = sample.audio_rows.float()
    noise_video = torch.randn(x0_video.shape, generator=generator)
    noise_audio = torch.randn(x0_audio.shape, generator=generator)

    t_rows_video = torch.full((x0_video.shape[0], 1), t_video)
    t_rows_video[:ncv] = KEYFRAME_NOISE_T
    t_rows_audio = torch.full((x0_audio.shape[0], 1), t_audio)
    t_rows_audio[:nca] = AUDIO_REFERENCE_T
    xt_video = t_rows_video * x0_video + (1.0 - t_rows_video) * noise_video
    xt_audio = t_rows_audio * x0_audio + (1.0 - t_rows_audio) * noise_audio

    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_indices, layout.audio_indices, ncv, nca, layout.text_indices.numel(),
        t_video, t_audio, max(t_video, KEYFRAME_NOISE_T), AUDIO_REFERENCE_T,
    )
    mask_video = torch.ones(x0_video.shape[0])
    mask_video[:ncv] = 0
    mask_audio = torch.ones(x0_audio.shape[0])
    mask_audio[:nca] = 0
    w = timestep_weight(tcfg, sigma)
    inputs = {
        "hidden_states": xt_video[None],
        "audio_hidden_states": xt_audio[None],
        "encoder_hidden_states": sample.prompt_embeds.float()[None],
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "token_tags": layout.token_tags,
        "position_ids": layout.position_ids,
        "video_indices": layout.video_indices,
        "audio_indices": layout.audio_indices,
        "text_indices": layout.text_indices,
    }
    return TrainingInputs(
        model_inputs=inputs,
        target_video=x0_video - noise_video,
        target_audio=x0_audio - noise_audio,
        loss_mask_video=mask_video,
        loss_mask_audio=mask_audio,
        weight_video=weights.video * w,
        weight_audio=weights.audio * w if sample.has_audio else 0.0,
        sigma=sigma,
        t_video=t_video,
        t_audio=t_audio,
    )


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `(pred - target)^2` over the rows where `mask` is 1 and all channels. pred `[1, N, C]`."""
    err = (pred[0].float() - target).square() * mask[:, None]
    return err.sum() / (mask.sum().clamp_min(1) * target.shape[-1])


def flow_matching_loss(
    pred_video: torch.Tensor, pred_audio: torch.Tensor, ti: TrainingInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(loss, mse_video, mse_audio)` with `loss = w_v * mse_video + w_a * mse_audio`.

    A zero audio weight (no soundtrack) still multiplies the audio term, so every rank runs the
    same backward graph.
    """
    mse_video = masked_mse(pred_video, ti.target_video, ti.loss_mask_video)
    mse_audio = masked_mse(pred_audio, ti.target_audio, ti.loss_mask_audio)
    return ti.weight_video * mse_video + ti.weight_audio * mse_audio, mse_video, mse_audio
