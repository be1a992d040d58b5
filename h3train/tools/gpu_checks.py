"""The checks `scripts/gpu_check.sh` runs after `h3train bench` (`h3train bench --checks`), one JSON section.

The bench times the plain AdamW step per attention backend. A GPU machine can still fail to train
in ways the bench never reaches: a collective backend that does not average, a low-bit optimizer
kernel, a quantized frozen base, the pinned host buffers of a background save. Each check below
builds the real trainer (`bench.trainer_config` + `run.assemble.build_trainer`, one rank,
sp = 1) with a config override, runs the code path a training run would, and records a
`CheckResult`: `passed` / `failed` / `skipped` (with the reason) / `not run`, its numbers, and its
seconds. A check that raises is `failed` with the error's first line; the others still run.

- `averaging` (`parallel/averaging.py`): FSDP2 reduces gradients with `ReduceOp.AVG` and the
  Ulysses gradient scale relies on it being the mean, so each run probes its own groups at
  start-up. Here, on the trainer's own sharding group (NCCL on a GPU, gloo on the CPU):
  `check_averaging` itself, the probe's collectives (`averaged`: a reduce-scatter and an
  all-reduce of `rank + 1`, whose mean is `(n + 1) / 2`), and a direct
  `reduce_scatter_tensor` / `all_reduce` with AVG of non-trivial float32 and bfloat16 values. One
  GPU gives a world of 1 (NCCL refuses two ranks on one device), where the mean equals the sum:
  this shows NCCL runs AVG on this machine with exact values, not that it divides; the
  multi-rank probe, which tells the two apart, runs at every real training start.
- `optim_adamw8bit`, `optim_adamw_bf16` (`optim/lowbit.py`): one timed step with `optim.name` set
  (on CUDA after a warm-up step, which compiles). Passed when the loss and grad norm are finite,
  the step was not skipped, trainable weights changed, and the state is what the kind promises
  (quantized 8-bit moments for `adamw8bit`; bfloat16 moments for `adamw_bf16`). torchao's step is
  compiled on CUDA, the path training takes; on the CPU it runs eager (inductor's C++ build of it
  takes minutes on a CPU). Without torchao `adamw8bit` is skipped, with the install line.
- `lora_int8`, `lora_float8` (`model/quant.py`): LoRA steps on a weight-only quantized frozen base
  (`lora.base_quant`). Passed when the loss is finite, the adapters changed and the base's codes
  did not. Both run on an A100 as on an H100: the codes are cast to the compute dtype before the
  matmul, so float8 needs no float8 matmul (`_scaled_mm`, compute capability 8.9), only its casts.
  int8 is skipped where the trainer refuses it
  (`check_base_quant`: FSDP2 before torch 2.12 cannot shard integer parameters).
- `async_save` (`checkpoint/staging.py`, `checkpoint/writer.py`): `checkpoint.async_save=true` copies
  the state into one host copy per rank, kept across saves (pinned on CUDA, the copy queued on a
  stream of its own that the next optimizer step waits for), and writes it on a background thread.
  A warm-up and a plain step, an async save (which allocates the copy), the next step, the wait; a
  blocking save of the state, a second async save, the next step at once, the wait. Passed when
  the second save copied into the first one's buffers (same storages), on CUDA every buffer is
  pinned, the async checkpoint equals the blocking one tensor for tensor, and a copy taken after
  the next step differs (so the comparison can fail). `step_after_save_over_plain` reports what
  the save costs the step after it.
- `block_memory_vs_rehearsal`: one full-width block (hidden 5376) on the bench's 41,774-row
  layout, its step's `torch.cuda.max_memory_allocated` against the peak the fake-tensor rehearsal
  (`run/rehearse/`) tracks for the same config; passed within `BLOCK_MEMORY_TOLERANCE`. The plan
  and the rehearsal both claim to know a run's memory before it starts; this holds them to a GPU.
  On the CPU the rehearsal runs on the reduced block and the comparison is skipped (no device
  allocator); without the rehearsal module the check is `not run`.

Sizes. On CUDA the checks train `CHECK_DIMS` (hidden 1024, 8 heads x 128, 2 blocks; 61 M
parameters) in bfloat16 on `CHECK_CLIP` (6,658 rows): the GPU's kernels and collectives at a size
that builds and steps in seconds; only the block-memory check builds a full-width block (1.5 B
parameters, about 45 GiB at its peak). On the CPU (and with `--reduced`) they train the bench's
reduced model, one block, in float32, in seconds.

Gradient parity. The bench before the checks measures every attention backend's gradients against a
float32 step (`bench/parity.py`); at full width it does so on `CHECK_DIMS` / `CHECK_CLIP`, the model
here, where the float32 step takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ..config import Config, check_values
from ..model.architecture import model_kwargs
from ..parallel import averaging
from ..parallel.shards import local_tensor
from ..tasks.synthetic import Clip
from . import bench
from .bench.case_setup import CHECK_CLIP, CHECK_DIMS

PASSED, FAILED, SKIPPED, NOT_RUN = "passed", "failed", "skipped", "not run"

LORA_RANK = {"cuda": 16, "cpu": 4}
# Class name prefix of torchao's quantized optimizer states (`OptimState8bit`, `OptimState4bit`).
QUANTIZED_STATE = "OptimState"
# The GPU's measured peak of one block's step and the rehearsal's agree within this fraction (as the
# rehearsal and the plan must, `rehearse.TOLERANCE`): kernels' workspaces and allocator rounding are
# outside what the rehearsal tracks.
BLOCK_MEMORY_TOLERANCE = 0.10


@dataclass
class CheckResult:
    """One check: what it does, its status, why it was skipped or failed, its numbers and seconds."""

    name: str
    what: str
    status: str = PASSED  # passed | failed | skipped | not run
    reason: str | None = None
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        """Mark failed; the first reason stays (later ones usually follow from it)."""
        if self.status != FAILED:
            self.status, self.reason = FAILED, reason


@dataclass(frozen=True)
class CheckSetup:
    """What every check trains: the model `dims` on `clip` in `dtype` on `device`, run folders under `root`."""

    device: torch.device
    reduced: bool
    dims: dict[str, Any]
    clip: Clip
    dtype: str
    seed: int
    root: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def check_setup(device: torch.device, reduced: bool, seed: int, root: Path) -> CheckSetup:
    """The checks' model and clip: `CHECK_DIMS` / `CHECK_CLIP` in bfloat16 on CUDA, else the bench's reduced ones."""
    small = reduced or device.type != "cuda"
    # One reduced block: on the CPU the low-bit optimizers' time is Python per parameter.
    dims = model_kwargs({**bench.REDUCED_DIMS, "num_layers": 1} if small else CHECK_DIMS)
    clip = bench.REDUCED_CLIP if small else CHECK_CLIP
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return CheckSetup(device, small, dims, clip, dtype, seed, root)


def bench_trainer_config(
    setup: CheckSetup,
    name: str,
    overrides: dict[str, Any],
    dims: dict[str, Any] | None = None,
    clip: Clip | None = None,
) -> Config:
    """The bench's trainer config (native attention, no checkpointing) of the setup's model and clip (or
    `dims` / `clip`), with `overrides` (`"optim.name": value`)."""
    cfg = bench.trainer_config(
        dims or setup.dims, clip or setup.clip, setup.dtype, "none", "native", setup.seed, setup.root / name
    )
    for key, value in overrides.items():
        section, _, attr = key.partition(".")
        part = getattr(cfg, section)
        if not hasattr(part, attr):
            raise KeyError(f"no config key {key}")
        setattr(part, attr, value)
    check_values(cfg)
    return cfg


@contextmanager
def _trainer(setup: CheckSetup, name: str, overrides: dict[str, Any]) -> Iterator[Any]:
    """A built `Trainer` for one check, closed (process group left) afterwards."""
    from ..run.assemble import build_trainer

    trainer = build_trainer(bench_trainer_config(setup, name, overrides), hooks=[])
    try:
        yield trainer
    finally:
        trainer.close()
        if setup.cuda:
            torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _sync(setup: CheckSetup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


# -- (a) gradient averaging on the run's own groups -----------------------------------------------


def run_groups(ctx: Any) -> dict[str, dist.ProcessGroup]:
    """The groups FSDP2 reduces over in this run, named as `ParallelContext` probes them."""
    if ctx.dims.dp_replicate > 1:
        return {
            "dp_shard_sp": ctx.fsdp_mesh["dp_shard_sp"].get_group(),
            "dp_replicate": ctx.mesh["dp_replicate"].get_group(),
        }
    return {"dp_shard_sp": ctx.fsdp_mesh.get_group()}


def _direct_average(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """`reduce_scatter_tensor` and `all_reduce` with AVG of `base * (rank + 1)` in `dtype`; each one's
    relative L2 error against the float32 mean of what the ranks sent (exactly 0 on one rank)."""
    n, rank = group.size(), dist.get_rank(group)
    base = torch.linspace(-2.5, 3.75, 16 * n, device=device, dtype=torch.float32)
    sent = [(base * (r + 1)).to(dtype) for r in range(n)]
    mine = sent[rank]
    mean = torch.stack([t.float() for t in sent]).mean(0)
    out = torch.empty(16, device=device, dtype=dtype)
    dist.reduce_scatter_tensor(out, mine, op=dist.ReduceOp.AVG, group=group)
    chunk = mean[16 * rank : 16 * (rank + 1)]
    whole = mine.clone()
    dist.all_reduce(whole, op=dist.ReduceOp.AVG, group=group)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want).norm() / want.norm())

    return {"reduce_scatter": rel(out, chunk), "all_reduce": rel(whole, mean)}


def check_gradient_averaging(setup: CheckSetup, res: CheckResult) -> None:
    """(a): the start-up probe, its collectives and direct AVG collectives on the trainer's own groups."""
    with _trainer(setup, res.name, {}) as trainer, warnings.catch_warnings():
        # torch 2.13 calls `reduce_scatter_tensor` deprecated; it is the collective FSDP2 and the probe make.
        warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor. is deprecated", category=FutureWarning)
        ctx = trainer.ctx
        groups = run_groups(ctx)
        backends = {name: dist.get_backend(g) for name, g in groups.items()}
        sizes = {name: g.size() for name, g in groups.items()}
        res.numbers.update(backend=backends, ranks=sizes, startup_summed=list(ctx.averaging.summed))
        probed = averaging.check_averaging(groups, ctx.device)
        res.numbers["probe_summed"] = list(probed.summed)
        # `_probe` returns before any collective on one rank; its collective runs here on every size.
        probe_values = {}
        for name, group in groups.items():
            mean = (group.size() + 1) / 2
            for kind in ("reduce-scatter", "all-reduce"):
                got = averaging.averaged(kind, group, ctx.device)
                probe_values[f"{name} {kind}"] = got
                if abs(got - mean) > 1e-6 * mean:
                    res.fail(f"{backends[name]}'s {kind} with AVG over {name} gave {got:g}, not the mean {mean:g}")
        res.numbers["probe_values"] = probe_values
        tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
        direct = {}
        for name, group in groups.items():
            for dtype, tol in tolerance.items():
                errors = _direct_average(group, ctx.device, dtype)
                direct[f"{name} {str(dtype).removeprefix('torch.')}"] = errors
                for kind, err in errors.items():
                    if not err <= tol:
                        res.fail(f"{kind} AVG over {name} in {dtype} is off the mean by {err:.2e} (relative L2)")
        res.numbers["direct_rel_l2"] = direct
        # A backend that sums is no failure: the run then reduces by SUM and divides itself (force_sum).
        res.numbers["force_sum"] = probed.force_sum
    if max(sizes.values()) == 1:
        res.numbers["coverage"] = (
            "one rank per group (one process per GPU; NCCL refuses two ranks on one device): AVG runs "
            "with exact values, but the mean of one value is also its sum; the multi-rank probe runs at "
            "every training start (ParallelContext)"
        )


# -- (b) one step with a low-bit optimizer, (c) LoRA on a quantized base --------------------------


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every trainable parameter, copied (on its device)."""
    return {n: local_tensor(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _quantized_codes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's codes of every quantized frozen Linear (`QuantizedLinear.qweight`), copied."""
    return {n: local_tensor(p).detach().clone() for n, p in model.named_parameters() if n.endswith(".qweight")}


def _changes(before: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[int, float]:
    """How many of `before`'s tensors differ in `model` now, and the largest absolute change."""
    now = dict(model.named_parameters())
    changed, largest = 0, 0.0
    for name, old in before.items():
        new = local_tensor(now[name]).detach()
        if not torch.equal(old, new):
            changed += 1
            largest = max(largest, float((new.float() - old.float()).abs().max()))
    return changed, largest


def _moment_kinds(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """`exp_avg` of each parameter by kind: a tensor subclass's class name (torchao's quantized
    states), else the plain tensor's dtype."""
    kinds: dict[str, int] = {}
    for state in optimizer.state.values():
        moment = state.get("exp_avg")
        if moment is None:
            continue
        moment = local_tensor(moment)
        key = str(moment.dtype).removeprefix("torch.") if type(moment) is torch.Tensor else type(moment).__name__
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


@contextmanager
def eager_torch_compile() -> Iterator[None]:
    """`torch.compile` returns the function it is given: torchao's optimizer step runs as plain Python.

    Nothing else compiles where it is used (`model.compile: auto` leaves the blocks eager on the CPU). For the
    CPU and quick checks: inductor builds torchao's step in C++ on a CPU, minutes on a small machine.
    """

    def no_compile(fn: Any = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    with mock.patch.object(torch, "compile", no_compile):
        yield


def _steps(setup: CheckSetup, trainer: Any, res: CheckResult) -> dict[str, torch.Tensor]:
    """One timed step (on CUDA after a warm-up step, which compiles and autotunes): loss, grad norm and
    times into `res`. Returns the trainable weights as they were before the timed step."""
    step = 1
    if setup.cuda:
        start = time.perf_counter()
        first = trainer.train_step(step)
        _sync(setup)
        res.numbers.update(first_step_s=time.perf_counter() - start, first_loss=first.get("loss"))
        torch.cuda.reset_peak_memory_stats(setup.device)
        step += 1
    before = _trainable(trainer.model)
    timed = bench.timed_step(trainer, step, bench.Clock(setup.device), sync_check=False)
    stats = timed.stats or {}
    loss, norm = stats.get("loss"), stats.get("grad_norm")
    res.numbers.update(
        loss=loss,
        grad_norm=norm,
        forward_backward_s=timed.forward_backward_s,
        update_s=timed.update_s,
        step_s=timed.forward_backward_s + timed.update_s,
        skipped_steps=stats.get("skipped_steps"),
    )
    if setup.cuda:
        res.numbers["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(setup.device))
    if loss is None or not math.isfinite(loss):
        res.fail(f"loss is not finite: {loss}")
    if norm is None or not math.isfinite(norm):
        res.fail(f"grad norm is not finite: {norm}")
    if stats.get("skipped_steps"):
        res.fail("the trainer skipped the step (non-finite loss or gradients)")
    return before


def _weights_changed(trainer: Any, before: dict[str, torch.Tensor], res: CheckResult, what: str) -> None:
    changed, largest = _changes(before, trainer.model)
    res.numbers.update(changed_tensors=changed, trainable_tensors=len(before), max_abs_change=largest)
    if not before:
        res.fail(f"no trainable {what}")
    elif changed == 0:
        res.fail(f"the step changed none of the {len(before)} trainable {what}")


def check_optimizer(kind: str) -> Callable[[CheckSetup, CheckResult], None]:
    """(b): one step with `optim.name=kind` through the real trainer."""

    def run(setup: CheckSetup, res: CheckResult) -> None:
        from ..optim.kinds import optimizer_kind
        from ..optim.lowbit import QUANT_BLOCK

        missing = optimizer_kind(kind).missing()
        if missing:
            res.status, res.reason = SKIPPED, missing
            return
        eager = kind in QUANT_BLOCK and not setup.cuda
        if kind in QUANT_BLOCK:
            res.numbers["torchao_step"] = "eager (CPU)" if eager else "compiled"
        with eager_torch_compile() if eager else nullcontext(), _trainer(setup, res.name, {"optim.name": kind}) as t:
            before = _steps(setup, t, res)
            _weights_changed(t, before, res, "weights")
            moments = _moment_kinds(t.parts.optimizer)
            res.numbers["moments"] = moments
            res.numbers["optimizer"] = type(t.parts.optimizer).__name__
            if kind == "adamw_bf16":
                dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in before.values()})
                res.numbers["weight_dtypes"] = dtypes
                if not moments.get("bfloat16"):
                    res.fail(f"adamw_bf16 kept no bfloat16 moments: {moments}")
                if "bfloat16" not in dtypes:
                    res.fail(f"adamw_bf16 trained no bfloat16 weights: {dtypes}")
            elif not sum(v for k, v in moments.items() if k.startswith(QUANTIZED_STATE)):
                res.fail(f"{kind} quantized no moment ({moments}): the low-bit state never ran")

    return run


def check_lora(base_quant: str) -> Callable[[CheckSetup, CheckResult], None]:
    """(c): LoRA steps on the `lora.base_quant` frozen base through the real trainer."""

    def run(setup: CheckSetup, res: CheckResult) -> None:
        from ..errors import ConfigError
        from ..model.quant import check_base_quant

        try:
            # The trainer's own refusal of a base this torch cannot shard (int8 before torch 2.12).
            check_base_quant(base_quant)
        except ConfigError as exc:
            res.status, res.reason = SKIPPED, f"unsupported on torch {torch.__version__}: {exc}"
            return
        rank = LORA_RANK[setup.device.type]
        overrides = {"lora.rank": rank, "lora.base_quant": base_quant}
        with _trainer(setup, res.name, overrides) as trainer:
            codes = _quantized_codes(trainer.model)
            res.numbers.update(lora_rank=rank, quantized_layers=len(codes))
            if not codes:
                res.fail(f"lora.base_quant={base_quant} quantized no Linear of the base")
            code_dtypes = sorted({str(c.dtype).removeprefix("torch.") for c in codes.values()})
            res.numbers["code_dtypes"] = code_dtypes
            before = _steps(setup, trainer, res)
            _weights_changed(trainer, before, res, "adapter weights")
            moved, _ = _changes(codes, trainer.model)
            res.numbers["base_codes_changed"] = moved
            if moved:
                res.fail(f"the step changed {moved} frozen quantized weights")

    return run


# -- (d) async save with pinned staging --------------------------------------------------------


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint `path`, read in this process (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
    with warnings.catch_warnings():
        # One process reads on purpose (no_dist=True); DCP warns about it on every read.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys held by one only, or whose tensors differ."""
    return sorted((a.keys() ^ b.keys()) | {k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])})


def _staged_buffers(trainer: Any) -> list[torch.Tensor]:
    """The host buffers the trainer's background saves copy into (`HostStaging`), those that hold bytes."""
    return [b for b in trainer.parts.checkpointer.staging.host_buffers() if b.numel()]


def check_async_save(setup: CheckSetup, res: CheckResult) -> None:
    """(d): two async saves, each followed at once by the next step: the second copies into the first's
    host buffers (pinned on CUDA) and equals a blocking save of the same state; the step after it
    against a plain step is reported (`step_after_save_over_plain`)."""
    from ..checkpoint import Checkpointer

    overrides = {"checkpoint.async_save": True, "checkpoint.keep_last": 0}
    with _trainer(setup, res.name, overrides) as trainer:

        def step() -> float:
            start = time.perf_counter()
            trainer.train_step(trainer.step + 1)
            trainer.step += 1
            _sync(setup)
            return time.perf_counter() - start

        def blocking_copy(name: str) -> tuple[dict[str, torch.Tensor], float]:
            """The checkpoint state as it is now, through a plain (blocking) save of its own."""
            start = time.perf_counter()
            saver = Checkpointer(setup.root / name, keep_last=0, is_main=True)
            path = saver.save(trainer.parts.checkpoint_state, {}, trainer.step)
            return checkpoint_tensors(path), time.perf_counter() - start

        def async_save(label: str) -> Path:
            """Save in the background, the next step at once, then wait; `label`'s times into the numbers."""
            start = time.perf_counter()
            path = trainer.save_checkpoint()
            res.numbers[f"{label}save_call_s"] = time.perf_counter() - start
            res.numbers[f"{label}step_after_save_s"] = step()
            start = time.perf_counter()
            committed = trainer.parts.checkpointer.wait()
            res.numbers[f"{label}wait_s"] = time.perf_counter() - start
            if committed != path:
                res.fail(f"wait() committed {committed}, not the save's {path}")
            return path

        # A warm-up step (AdamW's moments exist from it on; on CUDA it also compiles), then a plain one.
        step()
        res.numbers["plain_step_s"] = step()
        # The first save allocates (and on CUDA page-locks) the host copy; the second must reuse it.
        async_save("first_")
        first = [b.untyped_storage().data_ptr() for b in _staged_buffers(trainer)]
        expected, res.numbers["blocking_save_s"] = blocking_copy("expected")
        path = async_save("")
        buffers = _staged_buffers(trainer)
        second = [b.untyped_storage().data_ptr() for b in buffers]
        pinned = trainer.parts.checkpointer.staging.pinned
        res.numbers.update(
            staging=f"background write from one host copy kept across saves ({'pinned' if pinned else 'not pinned'})",
            pinned_requested=pinned,
            staged_buffers=len(buffers),
            staged_bytes=sum(b.nbytes for b in buffers),
            reused_buffers=len(set(first) & set(second)),
            # Read before `close()` unlocks them.
            pinned_buffers=sum(bool(b.is_pinned()) for b in buffers) if pinned else 0,
            step_after_save_over_plain=res.numbers["step_after_save_s"] / res.numbers["plain_step_s"],
        )
        del buffers
        later, _ = blocking_copy("later")
    saved = checkpoint_tensors(path)
    differing = _differing(expected, saved)
    changed = _differing(expected, later)
    res.numbers.update(
        tensors=len(saved),
        bytes=sum(t.numel() * t.element_size() for t in saved.values()),
        differing_from_blocking=len(differing),
        changed_by_next_step=len(changed),
    )
    if differing:
        res.fail(f"{len(differing)} tensors differ from the blocking save at the same step, e.g. {differing[0]}")
    if not any(k.startswith("model.") for k in changed) or not any(k.startswith("optim.") for k in changed):
        res.fail("the next step changed no weight or no AdamW moment: the comparison could not catch a late copy")
    if not second:
        res.fail("the background saves kept no host buffer")
    elif first != second:
        res.fail(
            f"the second save copied into new host memory: {len(second) - len(set(first) & set(second))} "
            f"of {len(second)} buffers moved"
        )
    if pinned and res.numbers["pinned_buffers"] != len(second):
        res.fail(f"{res.numbers['pinned_buffers']} of {len(second)} staged host buffers are pinned")


# -- (e) one full-width block against the rehearsal's memory -------------------------------------


def check_block_memory_vs_rehearsal(setup: CheckSetup, res: CheckResult) -> None:
    """(e): one full-width block (hidden 5376, the bench's 768x1344 x 124-frame layout, bfloat16 with
    float32 master weights, AdamW) trained on the GPU, its step's `torch.cuda.max_memory_allocated`
    against the peak the fake-tensor rehearsal (`rehearse.rehearse`, per-category tracking) finds for
    the same config with `num_layers=1`.

    The second step is measured, as the rehearsal models it: optimizer state resident, the trainer
    resetting the peak as the step starts. The rehearsal runs after the GPU run (it takes the default
    process group for a fake one, which needs none to exist). Passed within
    `BLOCK_MEMORY_TOLERANCE`. On the CPU (and with `--reduced`) the rehearsal runs on the reduced
    block, and the comparison is skipped: there is no device allocator, or no full-width block, to measure.

    A rehearsal module that cannot be imported leaves the check `not run`.
    """
    try:
        from ..run.rehearse import rehearse
    except ImportError as exc:
        res.status, res.reason = NOT_RUN, f"not yet: the fake-tensor rehearsal cannot be imported ({_first_line(exc)})"
        return
    # Measured only at full width: a reduced block's peak is mostly kernel workspaces no rehearsal tracks.
    full = setup.cuda and not setup.reduced
    dims = model_kwargs({"num_layers": 1}) if full else {**setup.dims, "num_layers": 1}
    clip = bench.FULL_CLIP if full else setup.clip
    # In bfloat16 on the CPU too: the rehearsal stands in for a GPU run, FSDP2 and its casts included.
    cfg = bench_trainer_config(dataclasses.replace(setup, dtype="bfloat16"), res.name, {}, dims=dims, clip=clip)
    res.numbers.update(hidden_size=dims["hidden_size"], blocks=1)
    if full:
        from ..run.assemble import build_trainer

        trainer = build_trainer(cfg, hooks=[])
        try:
            trainer.train_step(1)  # the optimizer state exists from here on, as the rehearsal's step has it
            resident = torch.cuda.memory_allocated(setup.device)
            trainer.train_step(2)  # `forward_backward` resets the peak as the step starts
            _sync(setup)
            measured = int(torch.cuda.max_memory_allocated(setup.device))
        finally:
            trainer.close()
            torch.cuda.empty_cache()
        res.numbers.update(measured_peak_bytes=measured, measured_resident_bytes=int(resident))
    start = time.perf_counter()
    rehearsal = rehearse(cfg, world_size=1, num_layers=1, save_plan=False)
    rehearsed = int(rehearsal.device_peak_bytes)
    res.numbers.update(
        rehearsal_s=time.perf_counter() - start,
        rows=rehearsal.rows,
        rehearsed_peak_bytes=rehearsed,
        rehearsed_peak_phase=rehearsal.peak_phase,
        rehearsed_at_peak=dict(rehearsal.at_peak),
        planned_bytes=int(rehearsal.planned_bytes),
    )
    if not full:
        res.status = SKIPPED
        res.reason = (
            "--reduced: no full-width block to measure (the rehearsal ran, on the reduced block)"
            if setup.cuda
            else "no CUDA: nothing to measure the rehearsal against (it ran, on the reduced block)"
        )
        return
    ratio = measured / rehearsed if rehearsed else float("inf")
    res.numbers.update(measured_over_rehearsed=ratio, tolerance=BLOCK_MEMORY_TOLERANCE)
    if not abs(ratio - 1.0) <= BLOCK_MEMORY_TOLERANCE:
        res.fail(
            f"the GPU's peak {measured / bench.GIB:.2f} GiB is {100 * (ratio - 1):+.1f} % of the rehearsal's "
            f"{rehearsed / bench.GIB:.2f} GiB (tolerance {100 * BLOCK_MEMORY_TOLERANCE:.0f} %)"
        )


# -- running them --------------------------------------------------------------------------------

# name, what it checks, how.
CHECKS: tuple[tuple[str, str, Callable[[CheckSetup, CheckResult], None]], ...] = (
    (
        "averaging",
        "ReduceOp.AVG on the run's own groups: the start-up probe, its collectives, direct reduce-scatter / all-reduce",
        check_gradient_averaging,
    ),
    ("optim_adamw8bit", "one trainer step with optim.name=adamw8bit (torchao)", check_optimizer("adamw8bit")),
    ("optim_adamw_bf16", "one trainer step with optim.name=adamw_bf16", check_optimizer("adamw_bf16")),
    ("lora_int8", "LoRA steps on the lora.base_quant=int8 frozen base", check_lora("int8")),
    ("lora_float8", "LoRA steps on the lora.base_quant=float8 frozen base", check_lora("float8")),
    (
        "async_save",
        "checkpoint.async_save: save, the next step at once, wait; equal to a blocking save (pinned staging on CUDA)",
        check_async_save,
    ),
    (
        "block_memory_vs_rehearsal",
        "one full-width block: torch.cuda.max_memory_allocated against the rehearsal's tracked peak",
        check_block_memory_vs_rehearsal,
    ),
)


@dataclass
class ChecksReport:
    """Every check's result and the setup they ran on; `ok` unless a check that ran failed."""

    device: str
    model: dict[str, Any]
    layout: dict[str, Any]
    torch: str
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.status != FAILED for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _progress(message: str) -> None:
    print(f"checks: {message}", file=sys.stderr, flush=True)


def run_checks(
    reduced: bool = False, seed: int = 0, device: torch.device | None = None, only: tuple[str, ...] = ()
) -> ChecksReport:
    """Run every check of `CHECKS` (or those named in `only`) in order, each on its own trainer."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    with tempfile.TemporaryDirectory(prefix="h3train-checks-") as tmp:
        setup = check_setup(device, reduced, seed, Path(tmp))
        for name, what, run in CHECKS:
            if only and name not in only:
                continue
            res = CheckResult(name, what)
            start = time.perf_counter()
            try:
                run(setup, res)
            except Exception as exc:  # a check that cannot run is reported; the others still run
                res.fail(_first_line(exc))
                res.numbers["traceback"] = traceback.format_exc(limit=-4).strip().splitlines()[-6:]
            res.seconds = time.perf_counter() - start
            results.append(res)
            _progress(f"{name}: {res.status}{f' ({res.reason})' if res.reason else ''}, {res.seconds:.1f} s")
    dims = setup.dims
    return ChecksReport(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        model={
            "hidden_size": dims["hidden_size"],
            "heads": dims["num_attention_heads"],
            "head_dim": dims["attention_head_dim"],
            "blocks": dims["num_layers"],
            "dtype": setup.dtype,
        },
        layout=dataclasses.asdict(setup.clip),
        torch=torch.__version__,
        results=results,
    )


_SHOWN = {
    "averaging": ("backend", "ranks", "probe_values"),
    "optim_adamw8bit": ("loss", "step_s", "update_s", "changed_tensors", "moments"),
    "optim_adamw_bf16": ("loss", "step_s", "update_s", "changed_tensors", "moments"),
    "lora_int8": ("loss", "step_s", "changed_tensors", "quantized_layers"),
    "lora_float8": ("loss", "step_s", "changed_tensors", "quantized_layers"),
    "async_save": ("save_call_s", "step_after_save_s", "wait_s", "staging", "pinned_buffers"),
    "block_memory_vs_rehearsal": (
        "rows",
        "measured_peak_bytes",
        "rehearsed_peak_bytes",
        "measured_over_rehearsed",
        "rehearsed_peak_phase",
    ),
}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_checks(report: ChecksReport) -> str:
    """The readable lines `h3train bench --checks` prints after the bench's table."""
    m = report.model
    lines = [
        "",
        f"checks on {report.device}: hidden {m['hidden_size']}, {m['heads']} x {m['head_dim']} heads, "
        f"{m['blocks']} blocks, {m['dtype']}; torch {report.torch}",
    ]
    for r in report.results:
        lines.append(f"  {r.name:<26} {r.status:<8} {r.seconds:6.1f} s  {r.reason or ''}".rstrip())
        shown = [f"{k} {_short(r.numbers[k])}" for k in _SHOWN.get(r.name, ()) if k in r.numbers]
        if shown:
            lines.append(f"  {'':<26} {'; '.join(shown)}")
    lines.append(f"checks: {'ok' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def bench_with_checks(args: argparse.Namespace) -> int:
    """`h3train bench --checks`: the bench, then every check; one JSON, the checks under `checks`.

    0 when the bench holds and no check that ran failed; 1 otherwise.
    """
    report = bench.report_from_args(args)
    print(bench.format_report(report), flush=True)
    checks = run_checks(reduced=report.mode == "reduced", seed=args.seed)
    print(format_checks(checks), flush=True)
    ok = report.ok and checks.ok
    if args.out:
        bench.write_json(Path(args.out), {**report.to_json(), "checks": checks.to_json(), "ok": ok})
    return 0 if ok else 1
