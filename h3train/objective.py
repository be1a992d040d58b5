"""Flow-matching objective in H3's conventions, which are diffusers' (`MiniMaxH3Scheduler`, the pipeline).

- Time: t in [0, 1], t = 1 is clean data; sigma = 1 - t.
- Noising: `MiniMaxH3Scheduler.scale_noise`, i.e. `x_t = t * x0 + (1 - t) * noise`.
- Velocity target (data-ward, the scheduler's `x0 = x_t + sigma * v`): `v = x0 - noise`.
- One base sigma per sample, mapped through each modality's shift `s*sigma / (1 + (s-1)*sigma)`
  (video 12, audio 3: the pipeline's `scheduler` / `audio_scheduler`), as inference steps both
  schedules from one base index.
- Visual conditioning rows are noised with `scale_noise` to the pipeline's `keyframe_noise_aug`
  (0.999) and carry `max(t_v, 0.999)`; audio reference rows stay clean at t = 1 (diffusers'
  `build_row_timesteps`, as the pipeline calls it).
- Loss: per-modality mean squared error over target rows only.

`tests/runs/test_conventions.py` holds each of these to diffusers' own code, not to these functions.

CFG-calibrated target (the released checkpoints are CFG-distilled; plain flow matching slowly
un-distills them): with guidance scale `s` and curvature power `k`, per modality
`L = s^(2-k) * MSE((p + (s-1) u) / s, v)`, `p` the conditional prediction and `u` a no-grad
prediction on the same rows and timesteps under the negative text prefix. `k = 0` is exactly
`MSE(p, u + s (v - u))`; `s = 1` is plain flow matching and runs a single forward.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import reduce
from operator import add
from typing import Protocol

import torch
from diffusers import MiniMaxH3Scheduler

from .config import CfgConfig, Config, LossWeights, TimestepConfig
from .tasks.layout import CONDITION_VIDEO_T, REFERENCE_AUDIO_T, Layout, row_timesteps
from .tasks.sample import TrainingSample

# The pipeline's forward process. `scale_noise` reads nothing of the scheduler's shift or schedule.
_FORWARD_PROCESS = MiniMaxH3Scheduler()


def shift_sigma(sigma: float, shift: float) -> float:
    """The shift `MiniMaxH3Scheduler.set_timesteps` applies to its base grid, at one base sigma.

    diffusers applies it inline to the whole grid and exposes no function for a single value, so it is
    written here once, in float64, and tested against the scheduler's own sigmas.
    """
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def noise_rows(x0: torch.Tensor, noise: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:
    """`[N, C]` clean rows at per-row times `t_rows [N, 1]` -> `x_t` (`MiniMaxH3Scheduler.scale_noise`)."""
    return _FORWARD_PROCESS.scale_noise(x0, t_rows, noise)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The data-ward velocity the model predicts: the scheduler's `step` recovers `x0 = x_t + (1 - t) v`."""
    return x0 - noise


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


def step_generator(seed: int, step: int, slot: int) -> torch.Generator:
    """The RNG of one micro-batch: a function of (seed, step, slot), never the SP rank.

    `slot = micro * dp + dp_rank` is the sample's place in the step's global batch, the same place the
    sampler reads it from; so the noise of a sample does not depend on how the batch is split into DP
    ranks and micro-batches, and a run resumed under another layout draws the same noise.
    """
    key = (seed * 1_000_003 + step) * 65_537 + slot
    return torch.Generator().manual_seed(key % (2**63))


@dataclass(frozen=True)
class Guidance:
    """Effective CFG scales of one micro-batch (1 = off) and the curvature power `k`."""

    scale_video: float = 1.0
    scale_audio: float = 1.0
    curvature_power: float = 0.0

    @property
    def active(self) -> bool:
        return self.scale_video != 1.0 or self.scale_audio != 1.0


def configured_scales(cfg: CfgConfig) -> tuple[float, float]:
    """`(video, audio)` guidance scales before any schedule; (1, 1) means CFG is off."""
    s_video = cfg.video_scale if cfg.video_scale is not None else cfg.scale
    s_audio = cfg.audio_scale if cfg.audio_scale is not None else cfg.scale
    return s_video, s_audio


def cfg_enabled(cfg: CfgConfig) -> bool:
    """Whether the CFG-calibrated target is on for either modality (a scale other than 1)."""
    return configured_scales(cfg) != (1.0, 1.0)


def guidance_for(cfg: CfgConfig, sigma_video: float, sigma_audio: float) -> Guidance:
    """`constant`: the configured scales; `sigma`: `1 + (s - 1) * sigma_m`, each modality its own sigma."""
    s_video, s_audio = configured_scales(cfg)
    if cfg.schedule == "sigma":
        s_video = 1.0 + (s_video - 1.0) * sigma_video
        s_audio = 1.0 + (s_audio - 1.0) * sigma_audio
    return Guidance(s_video, s_audio, cfg.curvature_power)


def negative_prompt(
    sample: TrainingSample, cfg: CfgConfig, shared: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The negative text prefix `(embeds [L', D], tags [L'])` this config asks for."""
    if cfg.negative == "shared":
        if shared is None:
            raise ValueError("cfg.negative is 'shared' but no shared negative was loaded")
        return shared
    if cfg.negative_visual == "keep":
        embeds, tags, field = (
            sample.negative_visual_prompt_embeds,
            sample.negative_visual_text_token_tags,
            "negative_visual_prompt_embeds",
        )
    else:
        embeds, tags, field = sample.negative_prompt_embeds, sample.negative_text_token_tags, "negative_prompt_embeds"
    if embeds is None or tags is None:
        raise ValueError(
            f"sample '{sample.sample_id}' has no '{field}' for CFG; re-encode it with negatives or set "
            "cfg.negative_visual / cfg.negative=shared"
        )
    return embeds, tags


def text_dropped(seed: int, step: int, sample_id: str, p: float) -> bool:
    """Condition dropout decision: a function of (seed, step, sample) alone, so all SP ranks agree."""
    if p <= 0.0:
        return False
    key = zlib.crc32(f"{seed}:{step}:{sample_id}".encode())
    return torch.rand((), generator=torch.Generator().manual_seed(key), dtype=torch.float64).item() < p


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. To CUDA the copy goes through pinned memory and does not block: a pageable copy
    would make the host wait for the previous micro-batch's backward to drain."""
    pinned = device.type == "cuda"
    return (t.pin_memory() if pinned else t).to(device, non_blocking=pinned)


def move_rows(rows: dict[str, torch.Tensor] | None, device: torch.device) -> dict[str, torch.Tensor] | None:
    """A branch's forward arguments on `device` (`to_device` each); None stays None."""
    return None if rows is None else {k: to_device(v, device) for k, v in rows.items()}


@dataclass
class TrainingInputs:
    """One sample's micro-batch, unsharded and unpadded (a pack of several: `packing.PackedInputs`).

    `model_inputs` holds the ten `model.forward` arguments (batch dim 1 on the row tensors);
    `uncond_inputs` the same rows under the negative text prefix when the run has CFG on (every
    micro-batch, a dropped prompt's too, whose guidance scale is 1), else None.
    target_video `[N_v, 96]` / target_audio `[N_a, 32]`: velocity targets in the row order of
    `hidden_states` / `audio_hidden_states`; loss masks are 1 on target rows, 0 on conditioning rows.
    weight_video / weight_audio: loss weight times timestep weight (0 for audio without sound).
    `sample_id`, `has_audio` and `seq_len` (its packed length under its prompt) are the sample's.
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
    guidance: Guidance = Guidance()
    uncond_inputs: dict[str, torch.Tensor] | None = None
    sample_id: str = ""
    has_audio: bool = True
    seq_len: int = 0

    @property
    def samples(self) -> tuple[TrainingInputs, ...]:
        """The micro-batch's samples' own inputs (`MicroBatch`): this one."""
        return (self,)

    def forward_kwargs(self, uncond: bool = False) -> dict[str, object]:
        """The forward's arguments of one branch."""
        return dict(self.uncond_inputs if uncond else self.model_inputs)

    def split_predictions(
        self, video: torch.Tensor, audio: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The forward's predictions `[1, N, C]` per sample (`MicroBatch`): all of them are this sample's."""
        return ((video, audio),)

    def to(self, device: torch.device) -> TrainingInputs:
        """Copy to `device`. To CUDA the copies go through pinned memory and do not block: a pageable
        copy would make the host wait for the previous micro-batch's backward to drain."""
        if device.type == "cpu":
            return self
        return replace(
            self,
            model_inputs=move_rows(self.model_inputs, device),
            uncond_inputs=move_rows(self.uncond_inputs, device),
            target_video=to_device(self.target_video, device),
            target_audio=to_device(self.target_audio, device),
            loss_mask_video=to_device(self.loss_mask_video, device),
            loss_mask_audio=to_device(self.loss_mask_audio, device),
        )

    def full_weights(self) -> tuple[float, float]:
        """The factor each modality's MSE is multiplied by in the loss (`w * s^(2-k)` under CFG)."""
        g = self.guidance
        return (
            self.weight_video * guided_factor(g.scale_video, g.curvature_power),
            self.weight_audio * guided_factor(g.scale_audio, g.curvature_power),
        )


def guided_factor(scale: float, k: float) -> float:
    return 1.0 if scale == 1.0 else scale ** (2.0 - k)


def forward_inputs(
    layout: Layout,
    xt_video: torch.Tensor,
    xt_audio: torch.Tensor,
    prompt_embeds: torch.Tensor,
    t_video: float,
    t_audio: float,
) -> dict[str, torch.Tensor]:
    """The ten `model.forward` arguments for noised rows under one text prefix and its layout."""
    timestep, timestep_indices = row_timesteps(layout, t_video, t_audio)
    return {
        "hidden_states": xt_video[None],
        "audio_hidden_states": xt_audio[None],
        "encoder_hidden_states": prompt_embeds.float()[None],
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "token_tags": layout.token_tags,
        "position_ids": layout.position_ids,
        "video_indices": layout.video_indices,
        "audio_indices": layout.audio_indices,
        "text_indices": layout.text_indices,
    }


def make_training_inputs(
    sample: TrainingSample,
    generator: torch.Generator,
    tcfg: TimestepConfig,
    weights: LossWeights,
    cfg: CfgConfig | None = None,
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None,
    drop_text: bool = False,
    sigma: float | None = None,
) -> TrainingInputs:
    """Noise one sample and build its forward inputs (and the negative branch's, under CFG).

    Draws from `generator`, in this order: the base sigma (unless `sigma` fixes it), the video noise
    `[N_v, 96]` (conditioning rows first), the audio noise `[N_a, 32]`. A dropped prompt (`drop_text`)
    trains under the negative prompt at guidance scale 1.
    """
    cfg = cfg or CfgConfig()
    layout = sample.layout
    sigma = sample_base_sigma(tcfg, generator) if sigma is None else sigma
    t_video = 1.0 - shift_sigma(sigma, tcfg.video_shift)
    t_audio = 1.0 - shift_sigma(sigma, tcfg.audio_shift)
    ncv, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows

    x0_video = sample.video_rows.float()
    x0_audio = sample.audio_rows.float()
    noise_video = torch.randn(x0_video.shape, generator=generator)
    noise_audio = torch.randn(x0_audio.shape, generator=generator)

    # Conditioning rows as the pipeline prepares them: visual ones noised to `keyframe_noise_aug`
    # (`MiniMaxH3PrepareConditionLatentsStep`; patchify only permutes, so noising rows is the same
    # arithmetic), reference soundtracks clean.
    t_rows_video = torch.full((x0_video.shape[0], 1), t_video)
    t_rows_video[:ncv] = CONDITION_VIDEO_T
    t_rows_audio = torch.full((x0_audio.shape[0], 1), t_audio)
    t_rows_audio[:nca] = REFERENCE_AUDIO_T
    xt_video = noise_rows(x0_video, noise_video, t_rows_video)
    xt_audio = noise_rows(x0_audio, noise_audio, t_rows_audio)

    # A dropped prompt makes both CFG branches the same inputs: such a sample trains at s = 1 (plain
    # flow matching under the negative prompt) rather than scaling its gradient by s^(1-k).
    if drop_text:
        guidance = Guidance(curvature_power=cfg.curvature_power)
    else:
        guidance = guidance_for(cfg, 1.0 - t_video, 1.0 - t_audio)
    # Under CFG every micro-batch runs the negative forward, whatever its own guidance (a dropped
    # prompt, a `sigma` schedule at scale 1): the number of forwards, and with it the sharding
    # group's all-gathers, is the run's, never the sample's.
    with_negative = cfg_enabled(cfg)
    negative_rows = None
    if with_negative or drop_text:
        embeds, tags = negative_prompt(sample, cfg, shared_negative)
        negative_rows = forward_inputs(sample.layout_for(tags), xt_video, xt_audio, embeds, t_video, t_audio)
    if drop_text:
        inputs = negative_rows
    else:
        inputs = forward_inputs(layout, xt_video, xt_audio, sample.prompt_embeds, t_video, t_audio)
    uncond = negative_rows if with_negative else None

    mask_video = torch.ones(x0_video.shape[0])
    mask_video[:ncv] = 0
    mask_audio = torch.ones(x0_audio.shape[0])
    mask_audio[:nca] = 0
    w = timestep_weight(tcfg, sigma)
    return TrainingInputs(
        model_inputs=inputs,
        target_video=velocity_target(x0_video, noise_video),
        target_audio=velocity_target(x0_audio, noise_audio),
        loss_mask_video=mask_video,
        loss_mask_audio=mask_audio,
        weight_video=weights.video * w,
        weight_audio=weights.audio * w if sample.has_audio else 0.0,
        sigma=sigma,
        t_video=t_video,
        t_audio=t_audio,
        guidance=guidance,
        uncond_inputs=uncond,
        sample_id=sample.sample_id,
        has_audio=sample.has_audio,
        seq_len=layout.seq_len,
    )


def negative_inputs(
    sample: TrainingSample,
    ti: TrainingInputs,
    cfg: CfgConfig,
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The forward inputs of `ti`'s noised rows under the negative prompt `cfg` configures: the CFG
    branch's own inputs when it has one, else built the same way (for measuring guidance at scale 1)."""
    if ti.uncond_inputs is not None:
        return ti.uncond_inputs
    embeds, tags = negative_prompt(sample, cfg, shared_negative)
    rows = ti.model_inputs
    return forward_inputs(
        sample.layout_for(tags),
        rows["hidden_states"][0],
        rows["audio_hidden_states"][0],
        embeds,
        ti.t_video,
        ti.t_audio,
    )


def _loss_precision(pred: torch.Tensor) -> torch.Tensor:
    """A prediction in the loss's precision: float32, or float64 when the model computes in float64."""
    return pred.to(torch.promote_types(pred.dtype, torch.float32))


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `(pred - target)^2` over the rows where `mask` is 1 and all channels. pred `[1, N, C]`."""
    err = (_loss_precision(pred[0]) - target).square() * mask[:, None]
    return err.sum() / (mask.sum().clamp_min(1) * target.shape[-1])


def guided_mse(
    pred: torch.Tensor, uncond: torch.Tensor | None, target: torch.Tensor, mask: torch.Tensor, scale: float, k: float
) -> torch.Tensor:
    """`s^(2-k) * MSE((p + (s-1) u) / s, v)`; at `s = 1` exactly the plain `MSE(p, v)`."""
    if scale == 1.0:
        return masked_mse(pred, target, mask)
    calibrated = (_loss_precision(pred) + (scale - 1.0) * _loss_precision(uncond.detach())) / scale
    return guided_factor(scale, k) * masked_mse(calibrated, target, mask)


class MicroBatch(Protocol):
    """What one forward-backward trains: one sample (`TrainingInputs`) or a pack of them (`packing.PackedInputs`).

    `samples` are each sample's own inputs (targets, masks, weights, guidance) in row order; the
    forward rows of both branches are the micro-batch's, with `forward_kwargs` its arguments, and
    `split_predictions` cuts a forward's `[1, N, C]` predictions back into each sample's rows.
    """

    uncond_inputs: dict[str, torch.Tensor] | None

    @property
    def samples(self) -> tuple[TrainingInputs, ...]: ...

    def forward_kwargs(self, uncond: bool = False) -> dict[str, object]: ...

    def split_predictions(
        self, video: torch.Tensor, audio: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]: ...

    def to(self, device: torch.device) -> MicroBatch: ...


@dataclass
class LossParts:
    """`loss = w_v * video + w_a * audio`; `*_fm` are the plain flow-matching MSEs `MSE(p, v)`.

    The micro-batch's parts are sums over its samples; `samples` holds each sample's own, in row order.
    """

    loss: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    video_fm: torch.Tensor
    audio_fm: torch.Tensor
    samples: tuple[LossParts, ...] = ()

    def per_sample(self) -> tuple[LossParts, ...]:
        """Each sample's own parts, in row order (a sample's own parts: itself)."""
        return self.samples or (self,)


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def compute_loss(forward: Forward, batch: MicroBatch) -> LossParts:
    """Run the forward(s) of one micro-batch and build its loss: the sum of each sample's loss as it is alone.

    `forward(**inputs) -> (video [1, N_v, 96], audio [1, N_a, 32])`. Under CFG the unconditional
    forward runs first, without gradient. A zero audio weight (no soundtrack) still multiplies the
    audio term, so every rank runs the same backward graph. Each branch runs once over all the
    micro-batch's rows; its predictions are cut into each sample's (`split_predictions`).
    """
    samples = batch.samples
    uncond: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...] = ((None, None),) * len(samples)
    if batch.uncond_inputs is not None:
        with torch.no_grad():
            uncond = batch.split_predictions(*forward(**batch.forward_kwargs(uncond=True)))
    cond = batch.split_predictions(*forward(**batch.forward_kwargs()))
    per_sample = tuple(_sample_loss(s, *p, *u) for s, p, u in zip(samples, cond, uncond, strict=True))
    if len(per_sample) == 1:
        return per_sample[0]

    def total(name: str) -> torch.Tensor:
        return torch.stack([getattr(parts, name) for parts in per_sample]).sum()

    return LossParts(*(total(n) for n in ("loss", "video", "audio", "video_fm", "audio_fm")), samples=per_sample)


def step_sums(batch: MicroBatch, parts: LossParts) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What one micro-batch adds to its step's sums (`train.reduction.StepTotals`), sample by sample.

    Returns the device terms (`loss_video`, `loss_audio`, `loss_video_fm`, `loss_audio_fm`; a silent
    sample's audio terms zeroed) and the host counts (`audio_samples`, `cfg_scale_video`,
    `cfg_scale_audio`, `rows`: the samples' own packed lengths). `loss` itself is the caller's: hooks
    may change it.
    """
    pairs = list(zip(batch.samples, parts.per_sample(), strict=True))
    sound = [float(s.has_audio) for s, _ in pairs]
    # Added pairwise: a lone sample's terms are its own, with no kernel for a sum of one.
    device = {
        "loss_video": reduce(add, [own.video.detach() for _, own in pairs]),
        "loss_audio": reduce(add, [own.audio.detach() * a for (_, own), a in zip(pairs, sound)]),
        "loss_video_fm": reduce(add, [own.video_fm for _, own in pairs]),
        "loss_audio_fm": reduce(add, [own.audio_fm * a for (_, own), a in zip(pairs, sound)]),
    }
    host = {
        "audio_samples": sum(sound),
        "cfg_scale_video": sum(s.guidance.scale_video for s, _ in pairs),
        "cfg_scale_audio": sum(s.guidance.scale_audio for s, _ in pairs),
        "rows": float(sum(s.seq_len for s, _ in pairs)),
    }
    return device, host


def _sample_loss(
    ti: TrainingInputs,
    p_video: torch.Tensor,
    p_audio: torch.Tensor,
    u_video: torch.Tensor | None,
    u_audio: torch.Tensor | None,
) -> LossParts:
    """One sample's loss parts from its predictions `p_*` (and the negative branch's `u_*` under CFG)."""
    g = ti.guidance
    video = guided_mse(p_video, u_video, ti.target_video, ti.loss_mask_video, g.scale_video, g.curvature_power)
    audio = guided_mse(p_audio, u_audio, ti.target_audio, ti.loss_mask_audio, g.scale_audio, g.curvature_power)
    loss = ti.weight_video * video + ti.weight_audio * audio
    if g.active:
        with torch.no_grad():
            video_fm = masked_mse(p_video, ti.target_video, ti.loss_mask_video)
            audio_fm = masked_mse(p_audio, ti.target_audio, ti.loss_mask_audio)
    else:
        video_fm, audio_fm = video.detach(), audio.detach()
    return LossParts(loss, video, audio, video_fm, audio_fm)


def micro_batch_inputs(
    cfg: Config,
    sample: TrainingSample,
    step: int,
    slot: int,
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TrainingInputs:
    """The inputs of `sample` as micro-batch `slot` of the global batch of optimizer step `step`.

    Everything random about a micro-batch comes from (seed, step, slot, sample), so it is the same on
    every SP rank, at any prefetch depth and across a resume.
    """
    gen = step_generator(cfg.train.seed, step, slot)
    drop = text_dropped(cfg.train.seed, step, sample.sample_id, cfg.cfg.text_dropout)
    return make_training_inputs(
        sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, shared_negative, drop_text=drop
    )
