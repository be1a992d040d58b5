"""The training loop: config -> parallel plan -> data -> packed sample -> objective -> step."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ..atomic import set_aside
from ..config import Config, model_dims, to_yaml
from ..data.prefetch import MicroBatchPosition, Prefetcher, micro_batch_positions
from ..data.sampler import DistributedSampler
from ..errors import CheckpointError, ConfigError, H3TrainError, TrainingError, UsageError
from ..lora.adapters import adapter_config
from ..lora.base import BASE_KEY, base_record, check_same_base, read_record
from ..model.build import build_meta_model, build_model, load_pretrained_shards, materialize, pretrained_folder
from ..model.sp_forward import SequenceParallelH3
from ..objective import (
    TrainingInputs,
    compute_loss,
    configured_scales,
    make_training_inputs,
    step_generator,
    text_dropped,
)
from ..parallel.dims import ParallelContext, ParallelDims, init_distributed
from ..parallel.fsdp import apply_fsdp, local_tensor, shards_nothing
from ..parallel.ulysses import SequenceParallel
from ..preflight import preflight, resolve_attention_backend
from ..tasks.layout import PackedSample
from .checkpoint import (
    AttributeState,
    Checkpointer,
    CorruptCheckpoint,
    ModelState,
    OptimizerState,
    ScheduleState,
    check_components,
    check_same_model,
    is_complete,
    read_components,
    read_trainer_state,
    resume_candidates,
    schedule_changes,
    step_of,
    validate_checkpoint,
)
from .dump import diffusers_state, lora_meta, micro_batch_tensors, write_dump
from .events import EventLog, SpikeDetector
from .faults import FaultInjector
from .hooks import ModelTransform, TrainerHook, after_load, model_transforms, step_hooks
from .metrics import MetricsLogger, set_aside_later_lines, write_resolved_config
from .optim import build_optimizer, build_scheduler
from .preemption import INTERRUPT, NONE, PREEMPT, Preemption
from .rundir import check_fresh_run, move_run_aside, probe_writable, set_aside_later_checkpoints


def load_shared_negative(cfg: Config) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`cfg.negative=shared`: one `(negative_prompt_embeds [L, D], negative_text_token_tags [L])` file."""
    if cfg.cfg.negative != "shared":
        return None
    from safetensors.torch import load_file

    path = cfg.cfg.shared_negative_path
    tensors = load_file(path)
    for key in ("negative_prompt_embeds", "negative_text_token_tags"):
        if key not in tensors:
            raise ConfigError(f"config key 'cfg.shared_negative_path': file '{path}' has no tensor '{key}'")
    return tensors["negative_prompt_embeds"].float(), tensors["negative_text_token_tags"].long()


def micro_batch_inputs(
    cfg: Config,
    sample: PackedSample,
    step: int,
    slot: int,
    shared_negative: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TrainingInputs:
    """Everything random about a micro-batch comes from (seed, step, slot in the global batch, sample)."""
    gen = step_generator(cfg.train.seed, step, slot)
    drop = text_dropped(cfg.train.seed, step, sample.sample_id, cfg.cfg.text_dropout)
    return make_training_inputs(
        sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, shared_negative, drop_text=drop
    )


def build_source(cfg: Config, text_dim: int, on_skip=None):
    """The indexable sample source named by `data.source`; `on_skip(sample_id, reason)` hears skipped samples."""
    if cfg.data.source == "synthetic":
        from ..tasks.synthetic import SyntheticSource

        return SyntheticSource(cfg.data.synthetic, text_dim, cfg.train.seed)
    from ..data.dataset import CachedDataset

    corrupt = FaultInjector(cfg.debug.fault, rank=0).corrupt_samples()
    return CachedDataset(
        cfg.data.path, cfg.task.name, on_error=cfg.data.on_error, on_skip=on_skip, injected_corrupt=corrupt
    )


# FSDP2 warns about every Linear output that is a view; nothing here writes into one in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class Trainer:
    """Builds everything from a `Config`; `fit()` runs the loop; `close()` leaves the process group."""

    def __init__(
        self,
        cfg: Config,
        transforms: Sequence[ModelTransform] | None = None,
        hooks: Sequence[TrainerHook] | None = None,
        overwrite: bool = False,
    ) -> None:
        """`transforms` / `hooks` default to what the config asks for (`model_transforms`, `step_hooks`).

        `overwrite`: start afresh, moving an earlier run in the run folders aside (`rundir.py`).
        """
        self.cfg = cfg
        # The mesh is checked against the launch before any process group exists.
        dims = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
        preflight(cfg)
        self.log_dir = Path(cfg.logging.dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.log_dir / "checkpoints"
        # The run-folder policy (rundir.py), decided the same way on every rank from the shared folders.
        probe_writable(self.log_dir, "logging.dir")
        probe_writable(self.ckpt_dir, "checkpoint.dir" if cfg.checkpoint.dir else "logging.dir")
        self.explicit_resume = cfg.checkpoint.resume not in ("auto", "none")
        if overwrite and self.explicit_resume:
            raise UsageError(
                f"--overwrite starts afresh and cannot resume checkpoint.resume='{cfg.checkpoint.resume}'; "
                "drop one of them"
            )
        candidates = [] if overwrite else resume_candidates(self.ckpt_dir, cfg.checkpoint.resume)
        if not candidates and not overwrite:
            check_fresh_run(self.log_dir, self.ckpt_dir)

        _, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, cfg.parallel.cpu_offload)
        self.ctx = ParallelContext(dims, device)
        self.device = device
        self.faults = FaultInjector(cfg.debug.fault, self.ctx.rank)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
        if self.ctx.is_main and dims.sp > 1 and per_node % dims.sp:
            warnings.warn(
                f"parallel.sp={dims.sp} does not divide the {per_node} ranks per node: Ulysses all-to-alls "
                "will cross nodes, which is far slower than NVLink; prefer an sp that divides the GPUs per node",
                stacklevel=2,
            )

        self._candidates = candidates
        pretrained = pretrained_folder(cfg) if cfg.model.pretrained else None
        # What a LoRA checkpoint records about its base, and a resume checks (`lora/base.py`).
        self.lora = cfg.lora.rank > 0
        self.lora_base = base_record(pretrained, cfg.train.seed) if self.lora else None
        self.resume_from = self._choose_checkpoint(overwrite)
        # A resumed run gets every value from its checkpoint: no rank builds or reads a full model.
        # A LoRA checkpoint holds the trainable state only, so its base is built as on a fresh start.
        from_meta = pretrained is not None or (self.resume_from is not None and not self.lora)
        transformer = build_meta_model(cfg) if from_meta else build_model(cfg, cfg.train.seed)
        transformer.set_attention_backend(
            resolve_attention_backend(cfg.model.attention_backend, device.type, cfg.model.dtype)
        )
        self.transforms = list(model_transforms(cfg) if transforms is None else transforms)
        for transform in self.transforms:
            transform(transformer, cfg)
        self.model_config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
        self.model = SequenceParallelH3(
            transformer,
            SequenceParallel(self.ctx.sp_group),
            activation_checkpointing=cfg.model.activation_checkpointing,
            checkpoint_every=cfg.model.checkpoint_every,
            compile_blocks=cfg.model.compile,
            compile_backend=cfg.model.compile_backend,
        )
        if shards_nothing(self.model, self.ctx, cfg.model.dtype, cfg.parallel.cpu_offload):
            if not from_meta:
                self.model.to(device)
        else:
            # fully_shard moves the (CPU-initialised) shards to the mesh's device.
            apply_fsdp(self.model, self.ctx, cfg.model.dtype, cpu_offload=cfg.parallel.cpu_offload)
        if self.resume_from is not None and not self.lora:
            materialize(self.model, device)
        elif pretrained:
            load_pretrained_shards(self.model, pretrained, device)
        if self.resume_from is None:
            after_load(self.transforms, self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)

        self.shared_negative = load_shared_negative(cfg)
        self._create_synthetic_dataset()
        # Every rank of an SP group skips the same samples; one of them writes the record. The step
        # recorded is the one being trained when the sample was read, up to data.prefetch samples early.
        self.data_errors = EventLog(self.log_dir / "data_errors.jsonl" if self.ctx.sp_rank == 0 else None)
        self.spikes = SpikeDetector(cfg.train.spike_factor, cfg.train.spike_window)
        self.spike_log = EventLog(self.log_dir / "loss_spikes.jsonl" if self.ctx.sp_rank == 0 else None)
        self.source = build_source(
            cfg,
            self.model_config["text_dim"],
            on_skip=lambda sample_id, reason: self.data_errors.write(
                step=self.step + 1, sample_id=sample_id, reason=reason
            ),
        )
        self.sampler = DistributedSampler(
            len(self.source),
            self.ctx.dp_rank,
            dims.dp,
            cfg.train.seed,
            lengths=self.source.lengths if cfg.data.bucket_size > 1 else None,
            bucket_size=cfg.data.bucket_size,
        )
        self._prefetcher: Prefetcher | None = None
        # What this rank is doing, so a failed collective can say what it waited for.
        self.phase = "start-up"
        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.preempt = Preemption()
        self.interrupted = False
        # Everything a checkpoint holds, by name; a later feature adds its own component here
        # (`trainer.checkpoint_state["ema"] = ema`). Loaded in this order: the optimizer after the
        # model, the schedule after the optimizer (it sets the learning rate of each group).
        self.checkpoint_state: dict[str, Stateful] = {
            "model": ModelState(self.model, trainable_only=self.lora),
            "optim": OptimizerState(self.model, self.optimizer),
            "schedule": ScheduleState(self.scheduler),
            "sampler": self.sampler,
            "progress": AttributeState(self, ("step", "skipped_steps")),
        }
        self.hooks: list[TrainerHook] = []
        for hook in step_hooks(cfg, self.ctx.rank) if hooks is None else hooks:
            self.add_hook(hook)
        self.checkpointer = Checkpointer(
            self.ckpt_dir,
            cfg.checkpoint.keep_last,
            self.ctx.is_main,
            async_save=cfg.checkpoint.async_save,
            device=device,
        )
        self.checkpointer.clean_incomplete()
        if self.resume_from is not None:
            self._resume(self.resume_from)

    def log_validation(self, step: int, values: dict[str, float]) -> None:
        """Log held-out values after step `step` (0: before training) as a validation row (rank 0 writes).

        Rows wait until the step's training row is written, so `metrics.jsonl` stays in step order.
        """
        self._pending_validation.append((step, values))

    def _flush_validation(self) -> None:
        for step, values in self._pending_validation:
            self._metrics.log_validation(step, values)
        self._pending_validation.clear()

    def hook(self, name: str) -> TrainerHook | None:
        """The added hook called `name` (e.g. `ema`), if any."""
        return next((h for h in self.hooks if h.name == name), None)

    def add_hook(self, hook: TrainerHook) -> None:
        """Run `hook` at the loop's points; a hook with state joins the checkpoint under `hook.name`.

        Hooks are added before the resume (in `__init__`), so a stateful hook's state is restored.
        """
        hook.on_attach(self)
        if callable(getattr(hook, "state_dict", None)) and callable(getattr(hook, "load_state_dict", None)):
            if not hook.name or hook.name in self.checkpoint_state:
                raise ValueError(f"a stateful hook needs a unique name for the checkpoint, got {hook.name!r}")
            self.checkpoint_state[hook.name] = hook
        self.hooks.append(hook)

    def _choose_checkpoint(self, overwrite: bool = False) -> Path | None:
        """The checkpoint every rank resumes from: rank 0 checks the candidates and all ranks follow.

        Rank 0 validates the candidates newest first (`validate_checkpoint`). With `resume=auto` a
        failing one is reported in one line, renamed `step_N.corrupt` and the next older one is
        tried; an explicit `checkpoint.resume=PATH` that fails is a CheckpointError on every rank.
        Nodes can list a shared checkpoint folder differently for a moment (directory caches on
        network filesystems); ranks loading different steps would mix shards silently.
        """
        decision: list = [None]
        if self.ctx.is_main:
            decision[0] = self._decide_resume(overwrite)
        dist.broadcast_object_list(decision, src=0)
        chosen, error, remaining = decision[0]
        self._candidates = [Path(p) for p in remaining]
        if error is not None:
            kind, message = error
            self._agreed_error({"usage": UsageError, "checkpoint": CheckpointError}[kind](message))
        if chosen is None:
            return None
        agreed = Path(chosen)
        if not is_complete(agreed):
            raise CheckpointError(
                f"config key 'checkpoint.resume': rank {self.ctx.rank} cannot see the complete "
                f"checkpoint '{agreed}' that rank 0 resumes from; check the shared filesystem"
            )
        try:
            saved = read_trainer_state(agreed)
            check_same_model(saved["model_config"], model_dims(self.cfg), agreed)
            if self.lora:
                check_same_base(read_record(saved), self.lora_base, agreed)
            elif read_record(saved) is not None:
                raise CheckpointError(
                    f"checkpoint '{agreed}' is a LoRA checkpoint (adapters only) and this run fine-tunes the "
                    "whole model; resume it with its lora settings or set checkpoint.resume=none"
                )
        except (ConfigError, CheckpointError) as exc:
            self._agreed_error(exc)
        return agreed

    def _agreed_error(self, exc: H3TrainError) -> NoReturn:
        """Raise an error every rank reached alike: rank 0 reports it, the others leave with its exit code.

        Raised after the process group exists, it would otherwise be printed once per rank.
        """
        if self.ctx.is_main:
            raise exc
        raise SystemExit(exc.exit_code)

    def _decide_resume(self, overwrite: bool) -> tuple[str | None, tuple[str, str] | None, list[str]]:
        """Rank 0: (checkpoint to resume or None, (error kind, message) or None, candidates left)."""
        if overwrite:
            aside = move_run_aside(self.log_dir, self.ckpt_dir)
            if aside is not None:
                print(f"--overwrite: moved the earlier run to {aside}", flush=True)
            return None, None, []
        candidates = list(self._candidates)
        while candidates:
            path = candidates.pop(0)
            problem = validate_checkpoint(path)
            if problem is None:
                return str(path), None, [str(p) for p in candidates]
            if self.explicit_resume:
                return None, ("checkpoint", f"checkpoint.resume '{path}' cannot be loaded: {problem}"), []
            self._report_corrupt(path, problem)
        if self._candidates:
            # Every checkpoint failed: this is now a fresh run, under the same policy as any other.
            try:
                check_fresh_run(self.log_dir, self.ckpt_dir)
            except UsageError as exc:
                return None, ("usage", str(exc)), []
        return None, None, []

    def _report_corrupt(self, path: Path, problem: str) -> None:
        """Rank 0: set a checkpoint that cannot be loaded aside (never deleted) and say so in one line."""
        moved = set_aside(path, "corrupt")
        print(
            f"h3train: warning: skipped checkpoint {path} (step {step_of(path)}): {problem}; "
            f"renamed it {moved.name} and trying the next older one",
            file=sys.stderr,
            flush=True,
        )

    def _create_synthetic_dataset(self) -> None:
        data = self.cfg.data
        if data.source != "cached" or not data.create_synthetic or (Path(data.path) / "index.jsonl").is_file():
            return
        if self.ctx.is_main:
            from ..data.synth import write_synthetic_dataset

            write_synthetic_dataset(
                data.path,
                task=self.cfg.task.name,
                num_samples=data.synthetic.num_samples,
                seed=self.cfg.train.seed,
                text_dim=self.model_config["text_dim"],
            )
        dist.barrier()

    # -- checkpoints ----------------------------------------------------------------------------

    def _resume(self, path: Path) -> None:
        """Load every component from `path`, falling back to older checkpoints as `_choose_checkpoint` does.

        All ranks read collectively and agree on the outcome with one all-reduce, so a file that
        fails on any rank fails on all, and all move on to the same older checkpoint.
        """
        while True:
            # Each part ends in an all-reduce of its outcome, so no rank enters DCP's collective read
            # while another has already failed.
            code, failure, components = self._agreed_attempt(check_components, path, self.checkpoint_state)
            if code == 0:
                code, failure, saved = self._agreed_attempt(read_components, path, components)
            if code == 0:
                break
            if failure is None:
                failure = CheckpointError(f"checkpoint '{path}' cannot be read on another rank")
            if self.explicit_resume or code == 2:
                self._agreed_error(failure)
            if self.ctx.is_main:
                self._report_corrupt(path, str(failure).split(": ", 1)[-1])
            dist.barrier()
            older = self._choose_checkpoint()
            if older is None:
                self._agreed_error(
                    CheckpointError(
                        f"no checkpoint in '{self.ckpt_dir}' could be loaded (the failing ones are set aside "
                        "as step_N.corrupt); run again to start afresh, or set checkpoint.resume to a good one"
                    )
                )
            path = older
        for name, component in components.items():
            try:
                component.load_state_dict(saved[name])
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"checkpoint '{path}': its {name} state does not fit this run: {exc}") from exc
        for name, component in self.checkpoint_state.items():
            if name not in components:
                component.start_fresh()
                if self.ctx.is_main:
                    print(f"resume: {path.name} holds no {name}; it starts from the resumed weights", flush=True)
        self.resume_from = path
        changes = schedule_changes(read_trainer_state(path).get("config_yaml", ""), self.cfg)
        # Later history is kept, under names that no resume or prune picks up.
        self.checkpointer.protected_after = self.step
        if self.ctx.is_main:
            for moved in set_aside_later_checkpoints(self.ckpt_dir, self.step):
                print(f"kept the abandoned later checkpoint as {moved}", flush=True)
            # The event logs of the steps about to be redone are kept beside them, as metrics.jsonl's.
            for log in (self.data_errors.path, self.spike_log.path):
                if log is not None:
                    set_aside_later_lines(log, self.step)
            print(f"resumed from {path} at step {self.step}", flush=True)
            if changes:
                print(
                    f"resume: {', '.join(changes)} since {path.name}: the LR schedule is rebuilt from this "
                    f"config at update {self.scheduler.last_epoch} (next lr {self.scheduler.get_last_lr()[0]:.3e})",
                    flush=True,
                )
        dist.barrier()

    def _agreed_attempt(self, attempt: Callable[..., Any], *args: Any) -> tuple[int, CheckpointError | None, Any]:
        """Run `attempt(*args)` on every rank; all agree on the worst outcome (MAX all-reduce).

        Codes: 0 it worked; 1 the checkpoint's files are damaged (an older one may serve); 2 the
        checkpoint does not fit this run. Returns (agreed code, this rank's error or None, result).
        """
        result, failure, code = None, None, 0
        try:
            result = attempt(*args)
        except CorruptCheckpoint as exc:
            failure, code = exc, 1
        except CheckpointError as exc:
            failure, code = exc, 2
        flag = torch.tensor([code], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()), failure, result

    def save_checkpoint(self) -> Path:
        info = {
            "model_config": self.model_config,
            "config_yaml": self._config_yaml(),
            "skipped_steps": self.skipped_steps,
        }
        if self.lora:
            info.update({"lora": adapter_config(self.model.transformer), BASE_KEY: self.lora_base})
        return self.checkpointer.save(
            self.checkpoint_state,
            info,
            self.step,
            before_commit=lambda: self.faults.maybe_die("kill_in_save", self.step),
        )

    def _config_yaml(self) -> str:
        """`to_yaml(self.cfg)`, rendered again only when the config changed.

        OmegaConf takes tens of milliseconds, which every save would spend on the training thread.
        """
        key = repr(self.cfg)
        cached = getattr(self, "_yaml_cache", None)
        if cached is None or cached[0] != key:
            cached = self._yaml_cache = (key, to_yaml(self.cfg))
        return cached[1]

    # -- one optimizer step ---------------------------------------------------------------------

    def _micro_batch(self, step: int, micro: int) -> tuple[PackedSample, TrainingInputs]:
        if self._prefetcher is None:
            dp, dp_rank = self.ctx.dims.dp, self.ctx.dp_rank

            def load(at: MicroBatchPosition) -> tuple[PackedSample, TrainingInputs]:
                # On the prefetch thread: reading and noising stay off the training thread.
                sample = self.source[at.index]
                slot = at.micro * dp + dp_rank
                return sample, micro_batch_inputs(self.cfg, sample, at.step, slot, self.shared_negative)

            # Started lazily so that it reads from the sampler state a resume has restored.
            positions = micro_batch_positions(self.sampler.iter_indices(), step, micro, self.cfg.train.grad_accum)
            self._prefetcher = Prefetcher(load, positions, max(1, self.cfg.data.prefetch))
            self._samples = iter(self._prefetcher)
        at, (sample, ti) = next(self._samples)
        # The sampler state counts consumed samples only, so a checkpoint never skips prefetched ones.
        expected = MicroBatchPosition(self.sampler.next_index(), step, micro)
        assert at == expected, f"prefetcher delivered {at}, the training loop expects {expected}"
        return sample, ti

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        accum = cfg.train.grad_accum
        dump = cfg.debug.dump_step == step
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        # Loss terms are summed on the device, so no micro-batch waits for the host; the host-side
        # counts join them once per step: [loss, video, audio, video_fm, audio_fm] and
        # [has_audio, rows, cfg_scale_video, cfg_scale_audio].
        device_sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        host_sums = [0.0, 0.0, 0.0, 0.0]
        dumped, metas, sample_ids, losses = {}, [], [], []
        for micro in range(accum):
            self.phase = f"loading micro-batch {micro} of step {step}"
            sample, ti = self._micro_batch(step, micro)
            sample_ids.append(sample.sample_id)
            self.phase = f"forward of step {step}"
            parts = compute_loss(self.model, ti.to(self.device))
            loss = parts.loss
            if self.faults.active("nan_loss", step):
                loss = loss * float("nan")
            self.phase = f"backward of step {step}"
            if self.ctx.dims.dp_replicate > 1:
                # HSDP: reduce-scatter every micro-batch, all-reduce across replicas once per step.
                self.model.set_requires_all_reduce(micro == accum - 1)
            (loss / accum).backward()
            losses.append(loss.detach())
            has_audio = float(sample.has_audio)
            device_sums += torch.stack(
                [
                    loss.detach(),
                    parts.video.detach(),
                    parts.audio.detach() * has_audio,
                    parts.video_fm,
                    parts.audio_fm * has_audio,
                ]
            ).double()
            for i, value in enumerate(
                (has_audio, sample.layout.seq_len, ti.guidance.scale_video, ti.guidance.scale_audio)
            ):
                host_sums[i] += value
            if dump:
                dumped.update(micro_batch_tensors(micro, ti))
                metas.append(sample.meta())
        if self.faults.active("nan_grad", step):
            grad = next(p for p in self.model.parameters() if p.grad is not None).grad
            local_tensor(grad).fill_(float("nan"))

        if dump:
            self._dump(step, dumped, metas)
        # Both reductions are global, so every rank reaches the same update decision without an
        # extra collective: the grad norm covers every parameter shard, the loss every DP rank.
        self.phase = f"gradient norm of step {step}"
        grads, norm = self._grad_norm()
        coef = self._clip_coefficient(norm)
        self.phase = f"step all-reduce of step {step}"
        s, (grad_norm, clip), loss_values, self.stop_request = self._reduce_step(
            device_sums, host_sums, [norm, coef], losses
        )
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(grad_norm) and math.isfinite(s[0])
        if finite:
            if clip < 1.0:
                # Only a step over `train.max_grad_norm` pays the pass over every gradient; below
                # it the coefficient is exactly 1. Shards scale as the whole gradient does.
                torch._foreach_mul_([local_tensor(g) for g in grads], coef)
            # The first write to the checkpoint state after a save: its background copy must be done.
            self.checkpointer.wait_staged()
            self.optimizer.step()
            self.scheduler.step()
            self.consecutive_skips = 0
        else:
            # No rank updates: weights, AdamW moments and the LR schedule stay as they were.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips > cfg.train.max_consecutive_skips:
                raise TrainingError(
                    f"step {step}: {self.consecutive_skips} consecutive steps with a non-finite loss or gradient "
                    f"(train.max_consecutive_skips={cfg.train.max_consecutive_skips}); this rank's samples: "
                    f"{', '.join(sample_ids)}"
                )
        dt = time.perf_counter() - t0
        n = accum * self.ctx.dims.dp
        n_audio = max(s[5], 1.0)
        stats = {
            "loss": s[0] / n,
            "loss_video": s[1] / n,
            "loss_audio": s[2] / n_audio,
            "grad_norm": grad_norm,
            "lr": lr,
            "seq_len": s[6] / n,
            "tokens_per_s": s[6] / dt,
            "step_time_s": dt,
            "skipped_steps": self.skipped_steps,
            "data_errors": int(s[9]),
        }
        if self.cfg_enabled:
            stats.update(
                {
                    "loss_video_fm": s[3] / n,
                    "loss_audio_fm": s[4] / n_audio,
                    "cfg_scale_video": s[7] / n,
                    "cfg_scale_audio": s[8] / n,
                }
            )
        self._report_spikes(step, sample_ids, loss_values, stats["loss"])
        return stats

    def _reduce_step(
        self,
        device_sums: torch.Tensor,
        host_sums: list[float],
        scalars: list[torch.Tensor],
        losses: list[torch.Tensor],
    ) -> tuple[list[float], list[float], list[float], int]:
        """The step's one all-reduce and its one device->host copy.

        Reduced over every rank (SUM), in one float64 tensor: the loss sums `[loss, video, audio,
        video_fm, audio_fm]`, the host counts `[has_audio, rows, cfg_scale_video, cfg_scale_audio,
        data_errors]` (both from SP rank 0 of each group only: the other SP ranks hold the same
        values, and adding zeros keeps the sum exact), and how many ranks were asked to stop by a
        preemption signal and by Ctrl-C. Copied to the host with it, unreduced: `scalars` (the
        global grad norm, already reduced, and the clip coefficient) and this rank's micro-batch
        losses (spike detection). Returns (sums, scalars, micro-batch losses, agreed stop request).
        """
        lead = float(self.ctx.sp_rank == 0)
        flag = self.preempt.flag
        host = [*(v * lead for v in (*host_sums, self.data_errors.count)), float(flag == PREEMPT)]
        host.append(float(flag == INTERRUPT))
        host_t = torch.tensor(host, dtype=torch.float64)
        if self.device.type == "cuda":
            # Pinned and non-blocking: a pageable copy would make the host wait for the backward.
            host_t = host_t.pin_memory().to(self.device, non_blocking=True)
        reduced = torch.cat([device_sums * lead, host_t])
        dist.all_reduce(reduced)
        # The norm may live on the host (parameters offloaded to the CPU); the losses on the device.
        local = torch.stack([*(t.to(self.device, torch.float64) for t in scalars), *(loss.double() for loss in losses)])
        values = torch.cat([reduced, local]).tolist()
        sums, stops = values[:10], values[10:12]
        stop = INTERRUPT if stops[1] > 0 else PREEMPT if stops[0] > 0 else NONE
        n = len(scalars)
        return sums, values[12 : 12 + n], values[12 + n :], stop

    def _report_spikes(self, step: int, sample_ids: list[str], losses: list[float], step_loss: float) -> None:
        median = self.spikes.median()
        for sample_id, value in zip(sample_ids, losses):
            if self.spikes.is_spike(value):
                self.spike_log.write(
                    step=step, sample_id=sample_id, loss=value, median=median, dp_rank=self.ctx.dp_rank
                )
        if math.isfinite(step_loss):
            self.spikes.update(step_loss)

    @property
    def cfg_enabled(self) -> bool:
        return configured_scales(self.cfg.cfg) != (1.0, 1.0)

    def _grad_norm(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients and their global L2 norm (over every shard), on the device (no sync)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return grads, norm

    def _clip_coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        """`clip_grad_norm_`'s factor for `train.max_grad_norm` (1 when it is off), on the device."""
        max_norm = self.cfg.train.max_grad_norm
        if max_norm <= 0:
            return torch.ones_like(norm)
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    def _dump(self, step: int, inputs: dict, metas: list[dict]) -> None:
        # Unsharding is collective: every rank gathers, rank 0 writes.
        weights = diffusers_state(self.model, grads=False)
        grads = diffusers_state(self.model, grads=True)
        if self.ctx.is_main:
            meta = {
                "step": step,
                "model_config": self.model_config,
                "num_micro_batches": len(metas),
                "dp_size": self.ctx.dims.dp,
                "sp_size": self.ctx.dims.sp,
                "micro_batches": metas,
                "lora": lora_meta(self.model),
            }
            write_dump(self.log_dir / "dump" / f"step_{step}", inputs, weights, grads, meta)

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> None:
        cfg = self.cfg
        if self.ctx.is_main:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            write_resolved_config(self.log_dir, self._config_yaml())
        every = cfg.checkpoint.every
        with (
            self.preempt,
            MetricsLogger(
                self.log_dir,
                self.ctx.is_main,
                cfg.logging.wandb,
                asdict(cfg),
                cfg.train.steps,
                start_step=self.step,
                progress=cfg.logging.progress,
            ) as metrics,
        ):
            self._metrics = metrics
            self._pending_validation: list[tuple[int, dict[str, float]]] = []
            for hook in self.hooks:
                hook.on_fit_start(self)
            self._flush_validation()
            for step in range(self.step + 1, cfg.train.steps + 1):
                self.faults.maybe_die("kill", step)
                self.faults.maybe_die("sigterm", step)
                for hook in self.hooks:
                    hook.before_step(self, step)
                stats = self.train_step(step)
                self.step = step
                for hook in self.hooks:
                    self.phase = f"{type(hook).__name__} after step {step}"
                    stats.update(hook.after_step(self, step, stats) or {})
                metrics.log(step, stats)
                self._flush_validation()
                # Agreed in the step's all-reduce: a signal any rank got before the step ended.
                preempted = self.stop_request
                self.interrupted = preempted == INTERRUPT
                if preempted or (every and (step % every == 0 or step == cfg.train.steps)):
                    self._finish_saves()
                    self.phase = f"checkpoint save at step {step}"
                    path = self.save_checkpoint()
                    if self.ctx.is_main:
                        background = self.checkpointer.async_save
                        print(f"{'saving' if background else 'saved'} checkpoint {path}", flush=True)
                if preempted:
                    self._finish_saves()
                    if self.ctx.is_main:
                        print(self._stop_line(step, preempted), flush=True)
                    break
            self._finish_saves()
            for hook in self.hooks:
                hook.on_fit_end(self)

    def _finish_saves(self) -> None:
        """Commit the background save in flight, if any (every rank waits for its own write)."""
        self.phase = "waiting for the background checkpoint write"
        path = self.checkpointer.wait()
        if path is not None and self.ctx.is_main:
            print(f"saved checkpoint {path}", flush=True)

    def _stop_line(self, step: int, kind: int) -> str:
        sig = self.preempt.signal
        name = signal.Signals(sig).name if sig is not None else "a signal to another rank"
        what = "interrupted" if kind == INTERRUPT else "preempted"
        return f"{what} by {name}: stopped after step {step}, checkpoint saved; resume with checkpoint.resume=auto"

    def close(self, clean: bool = True) -> None:
        """Stop the prefetcher and leave the process group.

        After a failure the group is left as it is: a peer may be dead or blocked in a collective,
        and tearing gloo down under it aborts this process before its error is reported.
        """
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self.checkpointer.close()
        if clean and dist.is_initialized():
            # Ranks leave together: one tearing down gloo while another still talks aborts it.
            dist.barrier()
            dist.destroy_process_group()
