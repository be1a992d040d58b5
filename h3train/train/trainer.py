"""The training loop: config -> parallel plan -> data -> packed sample -> objective -> step.

`Trainer` receives its parts built (`assemble.py`) and wires them: a step is `forward_backward`
(micro-batches, losses, gradients) then `update` (norm, clip, optimizer, schedule), and `fit` runs
steps with the hooks, metrics and checkpoints around them. The step's sums travel in one all-reduce,
named by `reduction.StepTotals`.
"""

from __future__ import annotations

import math
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..checkpoint import complete_checkpoints, step_dir_name, step_of
from ..checkpoint.run_config import write_resolved_config
from ..config import Config, to_yaml
from ..data.step_composition import StepStats, batch_layout
from ..errors import TrainingError
from ..model.fsdp import requires_all_reduce
from ..model.sp_forward import SequenceParallelH3
from ..objective import cfg_enabled, compute_loss, step_sums
from ..parallel.dims import ParallelContext
from ..parallel.shards import global_norm, local_tensor
from .guard import Verdict
from .hooks import EvaluationWeights, MicroBatchEvent
from .metrics import (
    MEMORY_KEY,
    MetricsLogger,
    format_duration,
    peak_memory_gib,
    reset_peak_memory,
)
from .preemption import INTERRUPT, NONE, PREEMPT, agreed_stop
from .reduction import ReducedStep, StepTotals, to_device

if TYPE_CHECKING:
    from ..run.parts import TrainingParts

# FSDP2 warns about every Linear output that is a view; nothing here writes into one in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def compile_seconds() -> float | None:
    """Wall seconds this process has spent in torch.compile so far (dynamo's own count of frame and
    backward compiles), or None where this torch does not keep it."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent()["total_wall_time"])
    except (ImportError, KeyError, TypeError, ValueError):
        return None


@dataclass
class StepGradients:
    """What `forward_backward` leaves for `update`: gradients on the parameters, and these sums.

    `device_sums` float64 on the device: `StepTotals.loss_names` summed over micro-batches (audio
    terms of silent clips zeroed). `host_sums`: the host's counts by their `StepTotals` names.
    `losses`: each sample's own loss on the device (spike detection), `sample_ids` their ids, in the
    order trained; `samples` how many samples the step trains over all DP ranks, whose mean the loss
    and the gradient are.
    """

    started: float
    device_sums: torch.Tensor
    host_sums: dict[str, float] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    plan: StepStats | None = None

    @property
    def samples(self) -> int:
        """Samples the step trains over all DP ranks: the loss and the gradient are their mean."""
        assert self.plan is not None, "the step's first micro-batch sets its plan"
        return self.plan.samples


class Trainer:
    """Runs the loop over the parts `assemble` built; `fit()` trains; `close()` leaves the process group."""

    def __init__(self, parts: TrainingParts) -> None:
        """Wire `parts` into the loop: each hook attaches (before any resume restores its state)."""
        self.parts = parts
        self.cfg_enabled = cfg_enabled(parts.cfg.cfg)
        # What this rank is doing, so a failed collective can say what it waited for.
        self.phase = "start-up"
        self.consecutive_skips = 0
        self.stop_request = NONE
        self.interrupted = False
        # The logger while `fit` runs (opened at the step it starts from), else None.
        self._metrics: MetricsLogger | None = None
        self._pending_validation: list[tuple[int, dict[str, float]]] = []
        # The last step after which this run validated or rendered (every rank logs both).
        self._evaluated_at = -1
        # What this step's validation rows ask for (`guard.py`); the reason a guard stopped the run.
        self._verdict = Verdict()
        self.guard_stop: str | None = None
        # For the closing summary: this run's last checkpoint and the folder of its last rendered samples.
        self._last_checkpoint: Path | None = None
        self._last_samples: Path | None = None
        # Until the first step of a run that compiles its blocks is said (`_say_compile_time`): True.
        self._compile_unsaid = False
        self._compile_before: float | None = None
        # For the summary: samples this process trained, and where the data order is (epochs done).
        self._samples_trained = 0
        self._epoch: float | None = None
        for hook in parts.hooks:
            hook.on_attach(self)

    # -- what hooks see (`hooks.TrainerView`) ---------------------------------------------------

    @property
    def cfg(self) -> Config:
        return self.parts.cfg

    @property
    def ctx(self) -> ParallelContext:
        return self.parts.ctx

    @property
    def device(self) -> torch.device:
        return self.parts.ctx.device

    @property
    def model(self) -> SequenceParallelH3:
        return self.parts.model

    @property
    def step(self) -> int:
        """Optimizer steps done (0 before training; restored by a resume)."""
        return self.parts.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.parts.progress.step = value

    @property
    def skipped_steps(self) -> int:
        return self.parts.progress.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.parts.progress.skipped_steps = value

    def log_validation(self, step: int, values: Mapping[str, float]) -> None:
        """Log held-out values after step `step` (0: before training) as a validation row (rank 0 writes).

        Rows wait until the step's training row is written, so `metrics.jsonl` stays in step order.
        """
        self._pending_validation.append((step, dict(values)))
        self._evaluated_at = step
        self._verdict.merge(self.parts.watch.judge(step, values))

    def _flush_validation(self) -> None:
        for step, values in self._pending_validation:
            self._metrics.log_validation(step, values)
        self._pending_validation.clear()

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        """Log rendered clips (id -> (mp4, caption)) after step `step`; rank 0 sends them to the dashboards."""
        self._evaluated_at = step
        for path, _ in videos.values():
            self._last_samples = Path(path).parent
        if self._metrics is not None:
            self._metrics.log_videos(step, dict(videos))

    def evaluation_weights(self, use_ema: bool) -> AbstractContextManager[None]:
        """The weights evaluation runs with: the EMA's swapped in for the duration when `use_ema`."""
        if not use_ema:
            return nullcontext()
        provider = next((h for h in self.parts.hooks if isinstance(h, EvaluationWeights)), None)
        if provider is None:
            raise RuntimeError("validation.use_ema needs a hook that keeps evaluation weights (train.ema.decay > 0)")
        return provider.swapped_in()

    def wait_staged(self) -> None:
        """Wait for a background checkpoint's copy of the state before writing to the state."""
        self.parts.checkpointer.wait_staged()

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Save `parts.checkpoint_state` at the current step (in the background with `checkpoint.async_save`)."""
        parts = self.parts
        info = {
            "model_config": parts.model_config,
            "config_yaml": self._config_yaml(),
            "skipped_steps": self.skipped_steps,
            "batch": batch_layout(
                self.ctx.dims.dp, self.cfg.train.grad_accum, self.cfg.data.pack, self.cfg.train.global_batch
            ),
        }
        if parts.adapter is not None:
            info.update(parts.adapter.checkpoint_info(self.model))
        return parts.checkpointer.save(
            parts.checkpoint_state,
            info,
            self.step,
            before_commit=lambda: parts.faults.maybe_die("kill_in_save", self.step),
            before_write=parts.faults.before_write(self.step),
        )

    def _config_yaml(self) -> str:
        """`to_yaml(self.cfg)` with `parallel.adaln_tables` as configured (`TrainingParts.configured_tables`:
        a requeue compares it with the config it is given), rendered again only when the config changed.

        OmegaConf takes tens of milliseconds, which every save would spend on the training thread.
        """
        cfg = replace(self.cfg, parallel=replace(self.cfg.parallel, adaln_tables=self.parts.configured_tables))
        key = repr(cfg)
        cached = getattr(self, "_yaml_cache", None)
        if cached is None or cached[0] != key:
            cached = self._yaml_cache = (key, to_yaml(cfg))
        return cached[1]

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float | None]:
        """Optimizer step `step` (1-based): `forward_backward`, then `update`; returns its logged values."""
        return self.update(step, self.forward_backward(step))

    def forward_backward(self, step: int) -> StepGradients:
        """Every micro-batch of step `step`: forward, loss, backward; the gradients accumulate on the parameters.

        Loss terms are summed on the device, so no micro-batch waits for the host; the host-side
        counts join them once per step in `update`. The step's peak memory is measured from here
        (`metrics.peak_memory_gib`).
        """
        reset_peak_memory(self.device)
        accum = self.cfg.train.grad_accum
        zero = torch.zeros(len(StepTotals.loss_names()), dtype=torch.float64, device=self.device)
        # No gradient is held here: `update` freed the last step's (a fresh model has none).
        grads = StepGradients(time.perf_counter(), zero)
        for micro in range(accum):
            self.phase = f"loading micro-batch {micro} of step {step}"
            sample, ti = self.parts.batches.next(step, micro)
            # Every rank plans the whole step, so all agree on its sample count without a collective.
            grads.plan = self.parts.batches.step_stats()
            self.phase = f"forward of step {step}"
            parts = compute_loss(self.model, ti.to(self.device))
            event = MicroBatchEvent(step, micro, sample, ti, parts.loss)
            for hook in self.parts.hooks:
                hook.on_micro_batch(self, event)
            loss = event.loss
            self.phase = f"backward of step {step}"
            if self.ctx.dims.dp_replicate > 1:
                # HSDP: reduce-scatter every micro-batch, all-reduce across replicas once per step.
                requires_all_reduce(self.model, micro == accum - 1)
            # The step's gradient is the mean over its samples; FSDP2's reduction averages over the DP
            # ranks, so each rank divides by its share (`grad_accum` with one sample per micro-batch).
            (loss / (grads.samples / self.ctx.dims.dp)).backward()
            # Spikes are looked for sample by sample: a pack's mean would hide one sample's.
            for inputs, own in zip(ti.samples, parts.per_sample(), strict=True):
                grads.losses.append(own.loss.detach())
                grads.sample_ids.append(inputs.sample_id)
            terms, counts = step_sums(ti, parts)
            grads.device_sums += StepTotals.loss_terms(loss=loss.detach(), **terms)
            for name, value in counts.items():
                grads.host_sums[name] = grads.host_sums.get(name, 0.0) + value
        for hook in self.parts.hooks:
            hook.after_backward(self, step)
        return grads

    def update(self, step: int, grads: StepGradients) -> dict[str, float | None]:
        """Norm, clip, optimizer and schedule for step `step`, or a skip when anything is non-finite.

        Both reductions are global, so every rank reaches the same update decision without an
        extra collective: the grad norm covers every parameter shard, the loss every DP rank.
        Returns the step's logged values; the audio losses are means over the samples with
        sound, and None when no micro-batch of the step (on any DP rank) had sound.
        """
        cfg, parts = self.cfg, self.parts
        self.phase = f"gradient norm of step {step}"
        params, norm = self._grad_norm()
        coef = self._clip_coefficient(norm)
        self.phase = f"step all-reduce of step {step}"
        reduced = self._reduce_step(grads.device_sums, grads.host_sums, [norm, coef], grads.losses)
        totals, (grad_norm, clip), loss_values = reduced.totals, reduced.scalars, reduced.losses
        self.stop_request = agreed_stop(totals.preempting, totals.interrupting)
        lr = parts.scheduler.get_last_lr()[0]
        finite = math.isfinite(grad_norm) and math.isfinite(totals.loss)
        if finite:
            if clip < 1.0:
                # Only a step over `train.max_grad_norm` pays the pass over every gradient; below
                # it the coefficient is exactly 1. Shards scale as the whole gradient does. By the
                # host's copy of the factor (exact: the reduction reads it in float64), not the
                # device's tensor: offloaded gradients live on the host, and no kernel scales a host
                # tensor by a device one; a number reaches every device as a kernel argument, with no
                # copy and no sync.
                torch._foreach_mul_([local_tensor(g) for g in params], clip)
            # The first write to the checkpoint state after a save: its background copy must be done.
            parts.checkpointer.wait_staged()
            parts.optimizer.step()
            parts.scheduler.step()
            self.consecutive_skips = 0
        else:
            # No rank updates: weights, AdamW moments and the LR schedule stay as they were.
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips > cfg.train.max_consecutive_skips:
                raise self._too_many_skips(step, grads.sample_ids)
        # Gradients are dead once the step is taken or skipped: freed now, not at the next step's
        # start, so validation, renders, the EMA and a checkpoint's staging never sit beside them.
        parts.optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - grads.started
        n = grads.samples
        # A mean over no clip is no number: a step without sound logs null, not a loss of 0.
        n_audio = totals.audio_samples
        stats: dict[str, float | None] = {
            "loss": totals.loss / n,
            "loss_video": totals.loss_video / n,
            "loss_audio": totals.loss_audio / n_audio if n_audio else None,
            "grad_norm": grad_norm,
            "lr": lr,
            "seq_len": totals.rows / (cfg.train.grad_accum * self.ctx.dims.dp),
            "samples": n,
            "imbalance": grads.plan.imbalance,
            "tokens_per_s": totals.rows / dt,
            "step_time_s": dt,
            "skipped_steps": self.skipped_steps,
            "data_errors": int(totals.data_errors),
            MEMORY_KEY: peak_memory_gib(self.device),
        }
        if grads.plan.fill is not None:
            stats["pack_fill"] = grads.plan.fill
        if grads.plan.epoch is not None:
            stats["epoch"] = grads.plan.epoch
        if self.cfg_enabled:
            stats.update(
                {
                    "loss_video_fm": totals.loss_video_fm / n,
                    "loss_audio_fm": totals.loss_audio_fm / n_audio if n_audio else None,
                    "cfg_scale_video": totals.cfg_scale_video / n,
                    "cfg_scale_audio": totals.cfg_scale_audio / n,
                }
            )
        self._report_spikes(step, grads.sample_ids, loss_values, stats["loss"])
        return stats

    def _reduce_step(
        self,
        device_sums: torch.Tensor,
        host_sums: Mapping[str, float],
        scalars: list[torch.Tensor],
        losses: list[torch.Tensor],
    ) -> ReducedStep:
        """The step's one all-reduce and its one device->host copy (`parts.reduction`).

        Summed over every rank: the `StepTotals`, the loss sums and counts from SP rank 0 of each
        group only (the other SP ranks hold the same values, and adding zeros keeps the sum exact),
        this rank's data errors and stop request. Copied with it, unreduced: `scalars` (the global
        grad norm, already reduced, and the clip coefficient) and this rank's micro-batch losses.
        """
        lead = float(self.ctx.sp_rank == 0)
        counts = {name: value * lead for name, value in host_sums.items()}
        counts["data_errors"] = self.parts.data_errors.count * lead
        counts.update(self._stop_counts())
        return self.parts.reduction(device_sums * lead, counts, scalars, losses)

    def _stop_counts(self) -> dict[str, float]:
        """This rank's stop request as the step's all-reduce sums it (`StepTotals`)."""
        flag = self.parts.preemption.flag
        return {"preempting": float(flag == PREEMPT), "interrupting": float(flag == INTERRUPT)}

    def _agree_stop(self) -> int:
        """The stop any rank was asked for so far (`INTERRUPT` over `PREEMPT`), in one all-reduce of the
        step's stop counts. Collective: called by every rank at the same points of a step."""
        counts = self._stop_counts()
        summed = torch.tensor(list(counts.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return agreed_stop(*summed.tolist())

    def _too_many_skips(self, step: int, sample_ids: list[str]) -> TrainingError:
        """The error that stops a run after too many skipped steps, naming every rank's samples of `step`.

        Collective: the skip is decided in the step's all-reduce, so every rank is here at the same
        step; rank 0 alone reports the error (`agreed`).
        """
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, sample_ids)
        # SP ranks of one group hold the same samples: each id once, in rank order.
        ids = list(dict.fromkeys(i for part in gathered for i in part))
        max_skips = self.cfg.train.max_consecutive_skips
        error = TrainingError(
            f"step {step}: {self.consecutive_skips} consecutive steps with a non-finite loss or gradient "
            f"(train.max_consecutive_skips={max_skips}); the step's samples: {', '.join(ids)}"
        )
        error.agreed = True
        return error

    def _report_spikes(self, step: int, sample_ids: list[str], losses: list[float], step_loss: float) -> None:
        spikes = self.parts.spikes
        median = spikes.median()
        for sample_id, value in zip(sample_ids, losses):
            if spikes.is_spike(value):
                self.parts.spike_log.write(
                    step=step, sample_id=sample_id, loss=value, median=median, dp_rank=self.ctx.dp_rank
                )
        if math.isfinite(step_loss):
            spikes.update(step_loss)

    def _grad_norm(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients and their global L2 norm (over every shard), on the device (no sync).

        Offloaded gradients (`parallel.cpu_offload`) give a norm on the host, taken and reduced there
        (gloo): it joins the step's sums on the device by `to_device`, which does not wait for the device.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        mesh = self.ctx.fsdp_mesh
        sharded = any(isinstance(g, DTensor) for g in grads)
        return grads, to_device(global_norm(grads, mesh.get_group(mesh.ndim - 1) if sharded else None), self.device)

    def _clip_coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        """`clip_grad_norm_`'s factor for `train.max_grad_norm` (1 when it is off), on the device."""
        max_norm = self.cfg.train.max_grad_norm
        if max_norm <= 0:
            return torch.ones_like(norm)
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train from the step after `self.step` to `train.steps`, or until a stop is agreed or a guard asks.

        One way out: the loop ends, the background save in flight is committed, the reason for an
        early stop is said, the hooks close, the summary is printed. An error leaves at once instead
        (a peer may be gone, and a collective would hang).
        """
        cfg, parts = self.cfg, self.parts
        if self.ctx.is_main:
            parts.log_dir.mkdir(parents=True, exist_ok=True)
            write_resolved_config(parts.log_dir, self._config_yaml())
        with parts.preemption, parts.metrics.open(self.step) as metrics:
            self._metrics = metrics
            for hook in parts.hooks:
                hook.on_fit_start(self)
            self._flush_validation()
            first_step = self.step
            self._compile_unsaid = parts.blueprint.compile_blocks
            self._compile_before = compile_seconds()
            metrics.start_clock()
            while self.step < cfg.train.steps and not self.stop_request and self.guard_stop is None:
                self._loop_step(self.step + 1, metrics)
            self._finish_saves()
            if self.ctx.is_main:
                if self.stop_request:
                    print(self._stop_line(self.step, self.stop_request), flush=True)
                elif self.guard_stop is not None:
                    line = f"h3train: stopped by {self.guard_stop}; checkpoint {self._last_checkpoint} saved"
                    print(line, file=sys.stderr, flush=True)
            for hook in parts.hooks:
                hook.on_fit_end(self)
            if self.ctx.is_main:
                print("\n".join(self._summary(first_step, metrics.elapsed_s)), flush=True)

    def run_step(
        self, step: int, show: Callable[[int, dict[str, float | None]], None] | None = None
    ) -> dict[str, float | None]:
        """Optimizer step `step` with its hooks: `before_step`, `train_step`, then each hook's `after_step`,
        whose values join the returned row. `show(step, row)` runs before the hooks' `after_step`, so what
        they print (validation, rendering) follows the step's console line."""
        for hook in self.parts.hooks:
            hook.before_step(self, step)
        stats = self.train_step(step)
        self.step = step
        self._samples_trained += int(stats["samples"] or 0)
        self._epoch = stats.get("epoch", self._epoch)
        if show is not None:
            show(step, stats)
        for hook in self.parts.hooks:
            self.phase = f"{type(hook).__name__} after step {step}"
            stats.update(hook.after_step(self, step, stats) or {})
        return stats

    def _loop_step(self, step: int, metrics: MetricsLogger) -> None:
        """`run_step`, its metrics row, the validation's verdict and, when due or asked for, a checkpoint.

        Leaves `stop_request` set when a stop signal is agreed, else `guard_stop` when a guard asks.
        """
        every = self.cfg.checkpoint.every
        stats = self.run_step(step, metrics.show)
        metrics.log(step, stats)
        if self._compile_unsaid:
            self._say_compile_time(step, stats)
        self._flush_validation()
        verdict, self._verdict = self._verdict, Verdict()
        if self.ctx.is_main:
            for line in verdict.lines:
                print(line, file=sys.stderr, flush=True)
        # Agreed in the step's all-reduce: a signal any rank got before the step ended. One that comes
        # while the step validates, renders (every rank does both at the same steps) or saves stops
        # the run on this step's save, not after another step: agreed once more after the save, or
        # after the evaluation when no save is due.
        due = every and (step % every == 0 or step == self.cfg.train.steps)
        saving = bool(self.stop_request or verdict.save or due)
        if not saving and self._evaluated_at == step:
            self.stop_request = self._agree_stop()
            saving = bool(self.stop_request)
        if saving:
            self._save_at(step)
            if not self.stop_request:
                # A signal during the save stops on the save just made.
                self.stop_request = self._agree_stop()
        self.interrupted = self.stop_request == INTERRUPT
        if not self.stop_request and verdict.stop is not None:
            self.guard_stop = verdict.stop

    def _say_compile_time(self, step: int, stats: Mapping[str, float | None]) -> None:
        """Once, on rank 0, after the first step of a run that compiles its blocks: how much of the step
        was spent in torch.compile (its own count since `fit` started: any other compile in the step, a
        low-bit AdamW's, is in it too), beside the step's time."""
        self._compile_unsaid = False
        if not self.ctx.is_main:
            return
        took, now = float(stats.get("step_time_s") or 0.0), compile_seconds()
        if now is None or self._compile_before is None:
            line = f"step {step} took {took:.1f} s, compiling the blocks included"
        else:
            line = (
                f"step {step} spent {now - self._compile_before:.1f} s of its {took:.1f} s in torch.compile "
                "(the blocks; a new sequence length compiles them once more)"
            )
        print(line, file=sys.stderr, flush=True)

    def _save_at(self, step: int) -> None:
        """Save at `step`, once the save before it (if still in flight) is committed and said."""
        self._finish_saves()
        self.phase = f"checkpoint save at step {step}"
        path = self._last_checkpoint = self.save_checkpoint()
        if self.ctx.is_main:
            background = self.parts.checkpointer.async_save
            print(f"{'saving' if background else 'saved'} checkpoint {path}", flush=True)

    def _finish_saves(self) -> None:
        """Commit the background save in flight, if any (every rank waits for its own write)."""
        self.phase = "waiting for the background checkpoint write"
        path = self.parts.checkpointer.wait()
        if path is not None and self.ctx.is_main:
            print(f"saved checkpoint {path}", flush=True)

    def _summary(self, first_step: int, elapsed_s: float) -> list[str]:
        """The lines that close a run (rank 0): steps and time, the last checkpoint and how to export it,
        its adapter files (`checkpoint.export`), the best checkpoint, the first and last held-out values
        (each hook's `summary_lines`), samples.

        A run that saved no checkpoint names the one it resumed from when it trained no step, else none.
        """
        cfg = self.cfg
        trained = self.step - first_step
        if trained:
            stopped = "stopped" if self.step < cfg.train.steps else "done"
            steps = f"{stopped}: trained steps {first_step + 1}-{self.step} of {cfg.train.steps}"
            n = self._samples_trained
            counts = f"{trained} step{'s' * (trained != 1)}, {n:,} samples: {n / trained:,.1f} per step"
            lines = [f"{steps} ({counts}) in {format_duration(elapsed_s)}"]
            if self._epoch is not None:
                lines[0] += f"; the data order is at epoch {self._epoch:.2f}"
        else:
            lines = [f"done: nothing to train, the run is at step {self.step} of {cfg.train.steps}"]
        checkpoint = self._last_checkpoint or (None if trained else self.parts.resumed_from)
        if checkpoint is None:
            lines.append("no checkpoint of this run to export (checkpoint.every=0)")
        else:
            out = Path(cfg.logging.dir) / "export" / checkpoint.name
            lines.append(f"last checkpoint: {checkpoint}")
            lines.append(f"export it with: h3train export {shlex.quote(str(checkpoint))} --out {shlex.quote(str(out))}")
        adapter_files, watch = self.parts.adapter_files, self.parts.watch
        files = adapter_files.newest if adapter_files is not None else []
        if files:
            lines.append(f"adapter file{'s' * (len(files) > 1)}: {', '.join(map(str, files))}")
        best = watch.describe()
        if best is not None:
            step = watch.best_checkpoint
            lines.append(f"best checkpoint: {self.parts.checkpointer.root / step_dir_name(step)} ({best})")
        for hook in self.parts.hooks:
            lines += hook.summary_lines()
        if self._last_samples is not None:
            lines.append(f"samples: {self._last_samples}")
        return lines

    def _stop_line(self, step: int, kind: int) -> str:
        sig = self.parts.preemption.signal
        name = signal.Signals(sig).name if sig is not None else "a signal to another rank"
        what = "interrupted" if kind == INTERRUPT else "preempted"
        return f"{what} by {name}: stopped after step {step}, checkpoint saved; resume with checkpoint.resume=auto"

    def stop_at_once(self) -> str:
        """A second Ctrl-C: commit no save from now on and say in a line what was cut short and what is kept.

        The save in progress, if any, stays a temporary folder that no resume reads; the newest
        complete checkpoint is what `checkpoint.resume=auto` starts from.
        """
        checkpointer = self.parts.checkpointer
        checkpointer.abandon()
        saving = checkpointer.saving
        during = f"the save of step {saving}" if saving is not None else self.phase
        root = checkpointer.root
        try:
            kept = complete_checkpoints(root)
        except OSError:
            return f"interrupted during {during}; the last complete checkpoint in {root} is kept"
        if not kept:
            return f"interrupted during {during}; no complete checkpoint is in {root}"
        return (
            f"interrupted during {during}; the checkpoint of step {step_of(kept[-1])} is kept ({kept[-1]}): "
            "resume with checkpoint.resume=auto"
        )

    def close(self, clean: bool = True) -> None:
        """Stop the prefetcher, leave the process group, release the run folders' lock.

        After a failure the group is left as it is: a peer may be dead or blocked in a collective,
        and tearing gloo down under it aborts this process before its error is reported.
        """
        self.parts.batches.close()
        self.parts.checkpointer.close()
        if clean and dist.is_initialized():
            # Ranks leave together: one tearing down gloo while another still talks aborts it.
            dist.barrier()
            dist.destroy_process_group()
        if self.parts.lock is not None:
            self.parts.lock.release()
