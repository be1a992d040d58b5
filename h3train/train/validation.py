"""Held-out loss: a forward-only pass of the live sharded model over fixed (sample, sigma, noise).

The loss of one training step depends mostly on the sigma it drew; this one does not. Every
held-out sample is evaluated at each base sigma of `validation.sigmas` (each modality through its
own shift, as in training) with noise drawn from a generator keyed by `(validation.seed, sample id,
sigma)`, so the number is comparable from step to step, run to run and across a resume. Nothing is
drawn from a training generator or the default RNG, no gradient is kept and the model returns to
train mode afterwards, so training is bitwise the same with or without validation.

Sample `i` is evaluated by DP group `i % dp`, each SP group with the sequence-parallel forward.
FSDP2's collectives need every rank of the sharding group to run the same number of forwards, so
a group with fewer samples repeats one with weight 0: each sample counts exactly once.

Logged (each a mean over samples, audio terms over samples with sound): `val/loss`,
`val/loss_video`, `val/loss_audio` (plain flow matching, `MSE(p, v)`), per sigma
`val/loss_video@0.50` / `val/loss_audio@0.50`, and under CFG the calibrated loss of the training
objective as `val/loss_cfg`, `val/loss_video_cfg`, `val/loss_audio_cfg`.

LoRA runs also report how far the fine-tune has moved from its base: the same conditional inputs are
run once more with the adapters disabled (the base costs no memory; peft's `disable_adapters` on the
transformer inside the sharded wrapper), and `val/drift_video` / `val/drift_audio` are
`sum MSE(p_lora, p_base) / sum MSE(p_base, v)` over the held-out pairs: the prediction's move
relative to the base's own error, 0 while every lora_B is zero. A full fine-tune keeps no copy of
its base in memory, so it has no drift.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..config import Config
from ..data.sampler import assigned_indices
from ..objective import cfg_enabled, compute_loss, make_training_inputs, masked_mse
from ..tasks.layout import PackedSample
from .hooks import TrainerHook, TrainerView

# Columns of the per-sigma sums: [video_fm, audio_fm, video_cfg, audio_cfg, samples, samples_with_audio,
# then for LoRA runs the drift terms MSE(p_lora, p_base) and MSE(p_base, v), video then audio]
_COLUMNS = 10


@contextmanager
def adapters_disabled(transformer: torch.nn.Module):
    """The peft-adapted `transformer` computes as its base inside the block; every flag is restored after.

    peft's `enable_adapters` sets `requires_grad` on the adapters, so the flags are saved and put back.
    """
    flags = {name: p.requires_grad for name, p in transformer.named_parameters()}
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
        for name, p in transformer.named_parameters():
            p.requires_grad_(flags[name])


def heldout_generator(seed: int, sample_id: str, sigma: float) -> torch.Generator:
    """The noise of one (sample, sigma) pair: a function of the seed, the sample's id and the sigma alone."""
    key = zlib.crc32(f"{seed}:{sample_id}:{sigma!r}".encode())
    return torch.Generator().manual_seed(key)


def sigma_label(sigma: float, sigmas: list[float]) -> str:
    """Two decimals (`0.50`), or as many more as it takes to tell the configured sigmas apart."""
    for digits in range(2, 8):
        if len({f"{s:.{digits}f}" for s in sigmas}) == len(sigmas):
            return f"{sigma:.{digits}f}"
    return repr(sigma)


class HeldOutLoss(TrainerHook):
    """`validation.every` / `validation.at_start`: the held-out loss, logged as its own metrics row.

    It runs every `validation.every` steps and after the last one (`train.steps`), and at step 0 with `at_start`.

    `shared_negative` is the `cfg.negative=shared` text negative the trainer loaded (None otherwise):
    it is passed in, not read from the trainer, so evaluation uses exactly the training negative.
    """

    def __init__(
        self,
        cfg: Config,
        source_factory: Callable[[], object] | None = None,
        *,
        shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if cfg.cfg.negative == "shared" and shared_negative is None:
            raise ValueError("cfg.negative is 'shared': HeldOutLoss needs the loaded shared_negative")
        self.cfg = cfg
        self.shared_negative = shared_negative
        self.v = cfg.validation
        self._source_factory = source_factory
        self._source = None
        self.sigmas = list(self.v.sigmas)
        self.labels = [sigma_label(s, self.sigmas) for s in self.sigmas]
        self.cfg_enabled = cfg_enabled(cfg.cfg)
        self.drift = cfg.lora.rank > 0
        # Forwards run by this rank in its last pass (tests count them).
        self.forwards = 0

    def _samples(self):
        if self._source is None:
            if self._source_factory is not None:
                self._source = self._source_factory()
            else:
                from ..data.source import build_source

                self._source = build_source(self.cfg, path=self.v.dataset)
        return self._source

    def on_fit_start(self, trainer: TrainerView) -> None:
        if self.v.at_start and trainer.step == 0:
            trainer.log_validation(0, self.evaluate(trainer))

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        # Also after the last step, so the trained model is always measured; once when it is a multiple.
        if self.v.every and (step % self.v.every == 0 or step == self.cfg.train.steps):
            trainer.log_validation(step, self.evaluate(trainer))

    def evaluate(self, trainer: TrainerView) -> dict[str, float | None]:
        """One pass over the held-out set; every rank returns the same, DP-reduced values."""
        source = self._samples()
        n = len(source) if not self.v.num_samples else min(self.v.num_samples, len(source))
        ctx, device = trainer.ctx, trainer.device
        sums = torch.zeros(len(self.sigmas), _COLUMNS, dtype=torch.float64, device=device)
        model = trainer.model
        was_training = model.training
        model.eval()
        self.forwards = 0
        weights = trainer.evaluation_weights(self.v.use_ema)
        try:
            with torch.no_grad(), weights:
                for index in assigned_indices(n, ctx.dp_rank, ctx.dims.dp):
                    counted = index is not None
                    sample: PackedSample = source[index if counted else 0]
                    for k, sigma in enumerate(self.sigmas):
                        values = self._pair(trainer, sample, sigma)
                        if counted:
                            sums[k] += values
        finally:
            model.train(was_training)
        trainer.phase = "validation all-reduce"
        # Over every rank, SP rank 0 of each group contributing: its SP peers hold the same sums.
        if ctx.sp_rank != 0:
            sums.zero_()
        dist.all_reduce(sums)
        return self._summarise(sums.cpu())

    def _pair(self, trainer: TrainerView, sample: PackedSample, sigma: float) -> torch.Tensor:
        cfg = self.cfg
        gen = heldout_generator(self.v.seed, sample.sample_id, sigma)
        ti = make_training_inputs(
            sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, self.shared_negative, sigma=sigma
        )
        self.forwards += 1 + (ti.uncond_inputs is not None)
        ti = ti.to(trainer.device)
        calls: list[tuple[dict, tuple[torch.Tensor, torch.Tensor]]] = []

        def forward(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append((inputs, out := trainer.model(**inputs)))
            return out

        parts = compute_loss(forward, ti)
        has_audio = float(sample.has_audio)
        one = torch.ones((), dtype=torch.float64, device=trainer.device)
        zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
        drift = [zero] * 4
        if self.drift:
            # The conditional forward is compute_loss's last; the base sees exactly its inputs.
            inputs, (p_video, p_audio) = calls[-1]
            self.forwards += 1
            with adapters_disabled(trainer.model.transformer):
                b_video, b_audio = trainer.model(**inputs)
            drift = [
                masked_mse(p_video, b_video[0].float(), ti.loss_mask_video).double(),
                masked_mse(b_video, ti.target_video, ti.loss_mask_video).double(),
                masked_mse(p_audio, b_audio[0].float(), ti.loss_mask_audio).double() * has_audio,
                masked_mse(b_audio, ti.target_audio, ti.loss_mask_audio).double() * has_audio,
            ]
        return torch.stack(
            [
                parts.video_fm.double(),
                parts.audio_fm.double() * has_audio,
                parts.video.double(),
                parts.audio.double() * has_audio,
                one,
                one * has_audio,
                *drift,
            ]
        )

    def _summarise(self, sums: torch.Tensor) -> dict[str, float | None]:
        # An audio term over a held-out set (or sigma) without sound is None, logged as null: no
        # number to average, and a 0 would pull the total and the plot down as if audio were learned.
        w = self.cfg.train.loss_weights
        total = sums.sum(0).tolist()
        samples, with_audio = total[4], total[5]

        def audio(value: float, count: float) -> float | None:
            return value / count if count > 0 else None

        def weighted(video: float, audio_term: float | None) -> float:
            return w.video * video + (w.audio * audio_term if audio_term is not None else 0.0)

        out: dict[str, float | None] = {
            "val/loss_video": total[0] / samples,
            "val/loss_audio": audio(total[1], with_audio),
        }
        out["val/loss"] = weighted(total[0] / samples, out["val/loss_audio"])
        if self.cfg_enabled:
            out["val/loss_video_cfg"] = total[2] / samples
            out["val/loss_audio_cfg"] = audio(total[3], with_audio)
            out["val/loss_cfg"] = weighted(total[2] / samples, out["val/loss_audio_cfg"])
        if self.drift:
            out["val/drift_video"] = total[6] / total[7] if total[7] > 0 else 0.0
            out["val/drift_audio"] = total[8] / total[9] if with_audio and total[9] > 0 else None
        for label, row in zip(self.labels, sums.tolist()):
            out[f"val/loss_video@{label}"] = row[0] / row[4]
            out[f"val/loss_audio@{label}"] = audio(row[1], row[5])
        return out
