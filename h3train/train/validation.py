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

Retention (`validation.retention`, on by default): how much of its base the fine-tune keeps, on the
same pairs. The base's predictions are computed once, on a fresh run before the first step (a LoRA
with its adapters disabled, a full fine-tune as loaded) and stored in the run folder
(`data/base_predictions.py`); every validation, and a resumed run, reads them. Per modality:

- `val/drift_video` / `val/drift_audio`: `sum MSE(p, p_base) / sum MSE(p_base, v)` over the pairs,
  the prediction's move relative to the base's own error (0 while nothing has trained).
- `val/guidance_ratio_video` / `_audio` (also per sigma, `@0.50`): `sum ||g|| / sum ||g_base||`, with
  `g = p(c) - p(neg)` the implicit guidance, conditional minus negative-prompt prediction (the
  negative as `cfg.negative` / `cfg.negative_visual` configure it), norms over the loss rows of each
  pair. A CFG-distilled base has a large `g_base`; a fine-tune that undoes the distillation shrinks
  it (ratio below 1).
- `val/guidance_cos_video` / `_audio` (also per sigma): `sum <g, g_base> / sqrt(sum ||g||^2 sum ||g_base||^2)`,
  whether the guidance still points the base's way.

An audio term over pairs without sound is null, not 0. Each pair costs one more forward (the negative
prompt's) unless the CFG-calibrated objective runs it anyway.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config
from ..data.base_predictions import FOLDER, BasePredictions, fingerprint
from ..data.sampler import assigned_indices
from ..errors import DatasetError, SampleError
from ..infra.digest import digest_tensor
from ..objective import TrainingInputs, cfg_enabled, compute_loss, make_training_inputs, negative_inputs
from ..tasks.sample import TrainingSample
from .hooks import TrainerHook, TrainerView
from .metrics import METRICS_FILE, first_row

# Columns of the per-sigma sums: [video_fm, audio_fm, video_cfg, audio_cfg, samples, samples_with_audio],
# then with retention, per modality (video, audio): drift MSE(p, p_base) and MSE(p_base, v), guidance
# ||g||, ||g_base||, <g, g_base>, ||g||^2, ||g_base||^2.
_LOSS_COLUMNS = 6
_RETENTION_COLUMNS = 7
_COLUMNS = _LOSS_COLUMNS + 2 * _RETENTION_COLUMNS
MODALITIES = ("video", "audio")


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


@dataclass
class HeldOutTrail:
    """This run's first and last held-out values (`evaluate`'s, by step), for the lines that close the run.

    `lines()`: `held-out loss (steps 0 -> 4): 3.512 -> 3.201 (video 2.9 -> 2.6, audio 0.61 -> 0.6)` and
    `guidance retention: ratio video 1 -> 0.97, ...; cos ...; drift ...`; an entry only where both
    validations have a number, a line only where it has an entry, one value where there was one validation.
    """

    first: tuple[int, dict[str, float | None]] | None = None
    last: tuple[int, dict[str, float | None]] | None = None
    # Significant digits of each value printed.
    digits: int = field(default=4, repr=False)

    def record(self, step: int, values: dict[str, float | None]) -> None:
        if self.first is None:
            self.first = (step, values)
        self.last = (step, values)

    def _change(self, key: str) -> str | None:
        """`a -> b` of metric `key` (`b` alone after one validation); None where either lacks a number."""
        assert self.first is not None and self.last is not None
        a, b = self.first[1].get(key), self.last[1].get(key)
        if a is None or b is None:
            return None
        if self.first[0] == self.last[0]:
            return f"{b:.{self.digits}g}"
        return f"{a:.{self.digits}g} -> {b:.{self.digits}g}"

    def _items(self, prefix: str) -> str | None:
        """`video X, audio Y` of `val/<prefix>_video` / `_audio`, those with numbers; None: neither."""
        found = [f"{m} {c}" for m in MODALITIES if (c := self._change(f"val/{prefix}_{m}")) is not None]
        return ", ".join(found) or None

    def lines(self) -> list[str]:
        if self.first is None or self.last is None:
            return []
        out = []
        steps = f"step {self.last[0]}" if self.first[0] == self.last[0] else f"steps {self.first[0]} -> {self.last[0]}"
        loss = self._change("val/loss")
        if loss is not None:
            parts = self._items("loss")
            out.append(f"held-out loss ({steps}): {loss}" + (f" ({parts})" if parts else ""))
        retention = [
            f"{label} {items}"
            for label, prefix in (("ratio", "guidance_ratio"), ("cos", "guidance_cos"), ("drift", "drift"))
            if (items := self._items(prefix)) is not None
        ]
        if retention:
            out.append("guidance retention: " + "; ".join(retention))
        return out


class HeldOutLoss(TrainerHook):
    """`validation.every` / `validation.at_start`: the held-out loss, logged as its own metrics row.

    It runs every `validation.every` steps and after the last one (`train.steps`), and at step 0 with `at_start`.

    `shared_negative` is the `cfg.negative=shared` text negative the trainer loaded (None otherwise):
    it is passed in, not read from the trainer, so evaluation uses exactly the training negative.
    """

    def __init__(self, cfg: Config, *, shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if cfg.cfg.negative == "shared" and shared_negative is None:
            raise ValueError("cfg.negative is 'shared': HeldOutLoss needs the loaded shared_negative")
        self.cfg = cfg
        self.shared_negative = shared_negative
        self.v = cfg.validation
        self._source = None
        self.sigmas = list(self.v.sigmas)
        self.labels = [sigma_label(s, self.sigmas) for s in self.sigmas]
        self.cfg_enabled = cfg_enabled(cfg.cfg)
        self.lora = cfg.lora.rank > 0
        # The stored base predictions, once `on_fit_start` has them (None: retention off or unavailable).
        self.base: BasePredictions | None = None
        # Forwards run by this rank in its last pass (tests count them).
        self.forwards = 0
        # This run's first and last values, for the closing summary.
        self.trail = HeldOutTrail()

    def _samples(self):
        if self._source is None:
            from ..data.source import build_source

            self._source = build_source(self.cfg, path=self.v.dataset)
        return self._source

    def _count(self) -> int:
        source = self._samples()
        return len(source) if not self.v.num_samples else min(self.v.num_samples, len(source))

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.step > 0 and trainer.ctx.is_main:
            # A resumed run's summary compares with the run's first evaluation, not this process's.
            row = first_row(Path(self.cfg.logging.dir) / METRICS_FILE, "validation")
            if row is not None and row["step"] <= trainer.step:
                self.trail.record(row["step"], {k: v for k, v in row.items() if k.startswith("val/")})
        if self.v.retention:
            self.base = self._prepare_base(trainer)
        if self.v.at_start and trainer.step == 0:
            self._log(trainer, 0)

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        # Also after the last step, so the trained model is always measured; once when it is a multiple.
        if self.v.every and (step % self.v.every == 0 or step == self.cfg.train.steps):
            self._log(trainer, step)

    def summary_lines(self) -> list[str]:
        return self.trail.lines()

    def _log(self, trainer: TrainerView, step: int) -> None:
        values = self.evaluate(trainer)
        self.trail.record(step, values)
        trainer.log_validation(step, values)

    # -- the base's predictions ------------------------------------------------------------------

    def settings(self) -> dict[str, object]:
        """What the held-out pairs depend on besides the samples: part of the store's fingerprint."""
        c, t = self.cfg.cfg, self.cfg.train.timestep
        return {
            "sigmas": self.sigmas,
            "seed": self.v.seed,
            "samples": self._count(),
            "video_shift": t.video_shift,
            "audio_shift": t.audio_shift,
            "negative": c.negative,
            "negative_visual": c.negative_visual,
            "shared_negative": None if self.shared_negative is None else digest_tensor(self.shared_negative[0]),
        }

    def _prepare_base(self, trainer: TrainerView) -> BasePredictions | None:
        """The store of this run's base predictions, written now on a fresh run (and on a resumed LoRA
        run whose store is incomplete), read as it is on a resume; rank 0 decides for every rank."""
        ctx = trainer.ctx
        source, n = self._samples(), self._count()
        decision: list[object] = [None, None]
        if ctx.is_main:
            files = [(source.entries[i].sample_id, source.path(i)) for i in range(n)]
            store = BasePredictions(Path(self.cfg.logging.dir) / FOLDER, fingerprint(files, self.settings()))
            decision = [store.fingerprint, store.matches()]
        dist.broadcast_object_list(decision, src=0)
        store = BasePredictions(Path(self.cfg.logging.dir) / FOLDER, str(decision[0]))
        found = decision[1]
        if trainer.step == 0 or (found is None and self.lora):
            self._record(trainer, store, n)
            return store
        if found:
            self._verify(trainer, store, n)
            return store
        if found is False:
            error = DatasetError(
                f"base predictions '{store.folder}' were computed for another held-out set or other validation "
                "settings (validation.dataset, num_samples, sigmas, seed, the shifts or the negative prompt); "
                "resume with the settings of the run's start, or set validation.retention=false"
            )
            error.agreed = True
            raise error
        if ctx.is_main:
            print(
                f"validation: no complete base predictions in '{store.folder}' and a full fine-tune keeps no base "
                "to compute them from: drift and guidance retention are off for this run",
                file=sys.stderr,
                flush=True,
            )
        return None

    def _verify(self, trainer: TrainerView, store: BasePredictions, n: int) -> None:
        """Each rank reads the stored samples it evaluates, before training: a damaged file stops the
        run with one line (the first rank's that found one), not at the next validation."""
        ctx = trainer.ctx
        problem = None
        try:
            for index in assigned_indices(n, ctx.dp_rank, ctx.dims.dp):
                if index is not None:
                    store.read(index)
        except SampleError as exc:
            problem = str(exc)
        found: list[str | None] = [None] * ctx.dims.world_size
        dist.all_gather_object(found, problem)
        first = next((message for message in found if message is not None), None)
        if first is not None:
            error = SampleError(first)
            error.agreed = True
            raise error

    def _record(self, trainer: TrainerView, store: BasePredictions, n: int) -> None:
        """One pass of the base over the held-out pairs; SP rank 0 of each DP group writes its samples."""
        ctx = trainer.ctx
        if ctx.is_main:
            store.begin()
        dist.barrier()
        model = trainer.model
        was_training = model.training
        model.eval()
        written = 0
        base = adapters_disabled(model.transformer) if self.lora else nullcontext()
        try:
            with torch.no_grad(), base:
                for index in assigned_indices(n, ctx.dp_rank, ctx.dims.dp):
                    counted = index is not None
                    sample: TrainingSample = self._samples()[index if counted else 0]
                    tensors = {}
                    for label, sigma in zip(self.labels, self.sigmas):
                        ti = self._inputs(sample, sigma).to(trainer.device)
                        assert ti.uncond_inputs is not None
                        negative = model(**ti.uncond_inputs)
                        conditional = model(**ti.model_inputs)
                        for name, p, n_, mask in zip(
                            MODALITIES, conditional, negative, (ti.loss_mask_video, ti.loss_mask_audio)
                        ):
                            rows = mask.bool()
                            tensors[f"{label}/{name}"] = p[0][rows]
                            tensors[f"{label}/guide_{name}"] = p[0][rows].float() - n_[0][rows].float()
                    if counted and ctx.sp_rank == 0:
                        written += store.write(index, tensors)
        finally:
            model.train(was_training)
        trainer.phase = "base predictions all-reduce"
        total = torch.tensor([written], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(total)
        if ctx.is_main:
            store.commit(n, n * len(self.sigmas), int(total.item()), self.settings())
        dist.barrier()

    # -- one validation ----------------------------------------------------------------------------

    def _inputs(self, sample: TrainingSample, sigma: float) -> TrainingInputs:
        """The fixed inputs of one pair; with retention the negative prompt's branch always (CFG or not)."""
        cfg = self.cfg
        gen = heldout_generator(self.v.seed, sample.sample_id, sigma)
        ti = make_training_inputs(
            sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, self.shared_negative, sigma=sigma
        )
        if self.v.retention and ti.uncond_inputs is None:
            # Guidance stays at scale 1: compute_loss runs this forward first and trains nothing on it.
            ti = replace(ti, uncond_inputs=negative_inputs(sample, ti, cfg.cfg, self.shared_negative))
        return ti

    def evaluate(self, trainer: TrainerView) -> dict[str, float | None]:
        """One pass over the held-out set; every rank returns the same, DP-reduced values."""
        n = self._count()
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
                    sample: TrainingSample = self._samples()[index if counted else 0]
                    # A padding repeat runs its forwards for the collectives only: no base to read.
                    base = self.base.read(index) if self.base is not None and counted else None
                    for k, (label, sigma) in enumerate(zip(self.labels, self.sigmas)):
                        values = self._pair(trainer, sample, sigma, label, base)
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

    def _pair(
        self,
        trainer: TrainerView,
        sample: TrainingSample,
        sigma: float,
        label: str,
        base: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        ti = self._inputs(sample, sigma)
        self.forwards += 1 + (ti.uncond_inputs is not None)
        ti = ti.to(trainer.device)
        calls: list[tuple[torch.Tensor, torch.Tensor]] = []

        def forward(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(out := trainer.model(**inputs))
            return out

        parts = compute_loss(forward, ti)
        has_audio = float(sample.has_audio)
        one = torch.ones((), dtype=torch.float64, device=trainer.device)
        columns = [
            parts.video_fm.double(),
            parts.audio_fm.double() * has_audio,
            parts.video.double(),
            parts.audio.double() * has_audio,
            one,
            one * has_audio,
        ]
        zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
        retention = [zero] * (2 * _RETENTION_COLUMNS)
        if base is not None:
            # compute_loss's forwards: the negative prompt's first, the conditional last.
            negative, conditional = calls[0], calls[-1]
            retention = []
            masks = (ti.loss_mask_video, ti.loss_mask_audio)
            targets = (ti.target_video, ti.target_audio)
            for m, name in enumerate(MODALITIES):
                weight = 1.0 if name == "video" else has_audio
                rows = masks[m].bool()
                p = conditional[m][0][rows].double()
                g = p - negative[m][0][rows].double()
                p_base = base[f"{label}/{name}"].to(trainer.device).double()
                g_base = base[f"{label}/guide_{name}"].to(trainer.device).double()
                drift = [(p - p_base).square().mean(), (p_base - targets[m][rows].double()).square().mean()]
                retention += [value * weight for value in (*drift, *guidance_sums(g, g_base))]
        return torch.stack(columns + retention)

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
        if self.base is not None:
            for name, present in (("video", samples), ("audio", with_audio)):
                out.update(_retention(total, name, present, ""))
        for label, row in zip(self.labels, sums.tolist()):
            out[f"val/loss_video@{label}"] = row[0] / row[4]
            out[f"val/loss_audio@{label}"] = audio(row[1], row[5])
            if self.base is not None:
                for name, present in (("video", row[4]), ("audio", row[5])):
                    out.update(_retention(row, name, present, f"@{label}", drift=False))
        return out


def _retention(row: list[float], name: str, present: float, suffix: str, drift: bool = True) -> dict[str, float | None]:
    """One modality's drift, guidance ratio and cosine from a row of sums (None without such pairs)."""
    at = _LOSS_COLUMNS + _RETENTION_COLUMNS * MODALITIES.index(name)
    moved, base_error, norm, base_norm, dot, square, base_square = row[at : at + _RETENTION_COLUMNS]
    out: dict[str, float | None] = {}
    if drift:
        out[f"val/drift_{name}"] = (moved / base_error if base_error > 0 else 0.0) if present else None
    ratio, cos = guidance_retention(norm, base_norm, dot, square, base_square) if present else (None, None)
    out[f"val/guidance_ratio_{name}{suffix}"] = ratio
    out[f"val/guidance_cos_{name}{suffix}"] = cos
    return out


def guidance_sums(g: torch.Tensor, g_base: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The guidance columns of one pair, from its `g` and `g_base` (any equal shapes, float64):
    `||g||, ||g_base||, <g, g_base>, ||g||^2, ||g_base||^2`. Sums of these over pairs feed `guidance_retention`."""
    return g.norm(), g_base.norm(), (g * g_base).sum(), g.square().sum(), g_base.square().sum()


def guidance_retention(
    norm: float, base_norm: float, dot: float, square: float, base_square: float
) -> tuple[float | None, float | None]:
    """`(ratio, cos)` from summed `guidance_sums`: `sum ||g|| / sum ||g_base||` and
    `sum <g, g_base> / sqrt(sum ||g||^2 sum ||g_base||^2)`; None where the base's guidance is zero."""
    both = square * base_square
    return (norm / base_norm if base_norm > 0 else None), (dot / math.sqrt(both) if both > 0 else None)
