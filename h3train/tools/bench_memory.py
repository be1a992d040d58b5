"""Activation memory, checkpointing trade and collective counts of one step, on CPU ranks over gloo.

The figures are measured on one model and one sample, those of `scripts/step_report.py`:
`MEMORY_DIMS` (a 256-wide, 2-block `MiniMaxH3Transformer3DModel`) and `MEMORY_CLIP` (an FL2VA
sample packing 2,058 rows), built by `memory_model` and `memory_inputs`.

`saved_activation_bytes(model, inputs)` is the memory one forward leaves behind for its backward:
every storage created during the forward (an op's output, a collective's buffer) that is still
alive once the forward has returned and garbage is collected, counted once per storage, parameters
and inputs excluded (a view of an input, such as a linear layer's flattened input, shares the
input's storage: that is data the caller holds, not an activation). That is what autograd keeps
(saved tensors, including a checkpointed block's inputs, which `torch.utils.checkpoint` holds
outside the saved-tensor hooks) plus the outputs themselves.
Measure an unsharded model (no `apply_fsdp`): FSDP2's unsharded parameters would count otherwise.

`run_ranks(fn, world, ...)` runs `fn(rank, world, *args)` in `world` spawned processes joined over
gloo and returns each rank's (picklable) result; the functions below use it for sp = 2.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import LossWeights, TimestepConfig
from ..model.architecture import model_kwargs
from ..model.sp_forward import SequenceParallelH3
from ..objective import TrainingInputs, compute_loss, make_training_inputs
from ..parallel.collectives import CollectiveCounts
from ..parallel.dims import free_port
from ..parallel.shards import local_tensor
from ..parallel.ulysses import SequenceParallel
from ..tasks.synthetic import Clip, clip_sample
from .bench import REDUCED_DIMS, build_bench_model

MEMORY_DIMS: dict[str, Any] = model_kwargs(
    {
        **REDUCED_DIMS,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "ffn_dim": 1024,
        "text_dim": 64,
        "time_embed_hidden_dim": 256,
        "time_embed_dim": 64,
        "num_layers": 2,
    }
)
# 352 text rows (the first 176 tagged as vision tokens), 1,520 video rows (160 of them keyframe
# conditioning) and 186 audio rows: 2,058 rows.
MEMORY_CLIP = Clip(frames=56, height=256, width=320, text_len=352, vision_tokens=176)


def memory_inputs(seed: int = 0, clip: Clip = MEMORY_CLIP, dims: dict[str, Any] | None = None) -> TrainingInputs:
    """The measured sample as training inputs (noised rows, targets, masks), float32 on the CPU."""
    dims = dims or MEMORY_DIMS
    sample = clip_sample(clip, int(dims["text_dim"]), seed)
    return make_training_inputs(sample, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights())


def memory_model(seed: int = 0, dims: dict[str, Any] | None = None):
    """The measured model, float32 on the CPU, seeded."""
    return build_bench_model(dims or MEMORY_DIMS, torch.device("cpu"), torch.float32, seed)


class _Created(TorchDispatchMode):
    """Weak references to every storage an op creates, with its size when created."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    storage = t.untyped_storage()
                    # Views share one storage; its data pointer names it (a Python storage object does not).
                    key = storage.data_ptr()
                except RuntimeError:  # a wrapper subclass (e.g. an async collective's) without storage
                    continue
                known = self.storages.get(key)
                # An address freed and handed out again names a new storage.
                if storage.nbytes() and (known is None or known[0].expired()):
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out


def _parameter_storages(model: torch.nn.Module) -> set[int]:
    keys = set()
    for p in [*model.parameters(), *model.buffers()]:
        local = local_tensor(p)
        keys.add(local.untyped_storage().data_ptr())
    return keys


def input_storages(inputs: TrainingInputs | dict[str, torch.Tensor]) -> set[int]:
    """Data pointers of every tensor in `inputs` (its model inputs, targets, masks)."""
    fields = dataclasses.fields(inputs) if dataclasses.is_dataclass(inputs) else None
    values = [getattr(inputs, f.name) for f in fields] if fields else inputs
    return {t.untyped_storage().data_ptr() for t in tree_leaves(values) if isinstance(t, torch.Tensor)}


def saved_activation_bytes(model: torch.nn.Module, inputs: TrainingInputs | dict[str, torch.Tensor]) -> int:
    """Bytes one forward of `model` on `inputs` keeps alive for backward, this rank (module docstring).

    `model` is a `SequenceParallelH3` (or anything taking the ten forward arguments); `inputs` its
    keyword arguments or `TrainingInputs`, whose loss is then included. Runs with gradients on,
    leaves no graph behind.
    """
    mode = _Created()
    with torch.enable_grad(), mode:
        if isinstance(inputs, TrainingInputs):
            out: Any = compute_loss(model, inputs).loss
        else:
            out = model(**inputs)
    gc.collect()
    owned = _parameter_storages(model) | input_storages(inputs)
    total = sum(nbytes for key, (ref, nbytes) in mode.storages.items() if key not in owned and not ref.expired())
    del out
    gc.collect()
    return total


def rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    """Rank `rank` of `run_ranks`: joins the gloo group at `port`, saves `fn(rank, world, *args)` in `out_dir`."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` in `world` spawned CPU processes over gloo; each rank's return value.

    `fn` must be importable (a module-level function) and its result picklable.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(rank_main, args=(world, free_port(), out_dir, fn, args), nprocs=world, start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _activation_worker(rank: int, world: int, modes: list[str], timed: bool) -> dict[str, Any]:
    """Saved activation bytes (and step seconds when `timed`) of each block policy at sp = world."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = dist.group.WORLD if world > 1 else None
    ti = memory_inputs()
    results: dict[str, Any] = {}
    for mode in modes:
        model = memory_model()
        forward = SequenceParallelH3(model, SequenceParallel(group), activation_checkpointing=mode)
        key = mode
        entry: dict[str, Any] = {"saved_bytes": saved_activation_bytes(forward, ti)}
        if timed:
            compute_loss(forward, ti).loss.backward()  # warm-up
            times = []
            for _ in range(2):  # the faster of two: the machine may be shared
                model.zero_grad(set_to_none=True)
                if group is not None:
                    dist.barrier()
                start = time.perf_counter()
                compute_loss(forward, ti).loss.backward()
                times.append(time.perf_counter() - start)
            entry["step_s"] = min(times)
        results[key] = entry
    return results


def _one_rank(fn: Callable, *args: Any) -> Any:
    """`fn(0, 1, *args)` in this process, without a process group (sp = 1)."""
    return fn(0, 1, *args)


def activation_memory_ratios(sp: int = 2) -> dict[str, float]:
    """Saved activations per rank at `sp` over sp = 1 on the measured model and sample, without
    checkpointing (`none`) and with full checkpointing (`full`)."""
    modes = ["none", "full"]
    one = _one_rank(_activation_worker, modes, False)
    many = run_ranks(_activation_worker, sp, modes, False)
    return {mode: many[0][mode]["saved_bytes"] / one[mode]["saved_bytes"] for mode in one}


def checkpointing_trade(sp: int = 1) -> dict[str, dict[str, float]]:
    """Per block policy: saved activation bytes and one forward+backward's seconds, and both relative to
    `none`, on the measured model and sample at `sp` (rank 0's figures)."""
    modes = ["none", "full", "selective"]
    res = _one_rank(_activation_worker, modes, True) if sp == 1 else run_ranks(_activation_worker, sp, modes, True)[0]
    base = res["none"]
    return {
        mode: {
            **entry,
            "memory_vs_none": entry["saved_bytes"] / base["saved_bytes"],
            "time_vs_none": entry["step_s"] / base["step_s"],
        }
        for mode, entry in res.items()
    }


def _collectives_worker(
    rank: int, world: int, sp: int, config: str, overrides: list[str], cpu_offload: bool
) -> dict[str, Any]:
    """Collectives of the second of two FSDP2 steps (forward, backward, clip, AdamW) of `config`."""
    from ..config import load_config
    from ..data.source import build_source
    from ..model.build import build_model
    from ..model.fsdp import apply_fsdp
    from ..objective import micro_batch_inputs
    from ..optim.kinds import build_optimizer
    from ..parallel.collectives import count_collectives
    from ..parallel.dims import ParallelContext, ParallelDims
    from ..run.blueprint import draw
    from ..run.preflight import own_job_device, preflight

    ctx = ParallelContext(ParallelDims(1, world // sp, sp, world), torch.device("cpu"))
    blueprint = draw(preflight(load_config(config, overrides)), ctx.dims, own_job_device("cpu"))
    cfg = blueprint.cfg
    transformer = build_model(cfg, cfg.train.seed)
    model = SequenceParallelH3(transformer, SequenceParallel(ctx.sp_group), activation_checkpointing=blueprint.policies)
    apply_fsdp(model, ctx, cfg.model.dtype, cpu_offload=cpu_offload, adaln_tables=cfg.parallel.adaln_tables)
    optimizer = build_optimizer(model, cfg.optim)
    source = build_source(cfg, transformer.config.text_dim)
    for step in (1, 2):
        ti = micro_batch_inputs(cfg, source[ctx.dp_rank], step=step, slot=0)
        with count_collectives(functional=True) as counts:
            compute_loss(model, ti).loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return dict(counts)  # the second step's, by entry point (`CollectiveCounts`)


def step_collectives(
    world: int = 2,
    sp: int = 2,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    cpu_offload: bool = False,
) -> CollectiveCounts:
    """Rank 0's collectives, by kind, in one training step of `config` (default the tiny FL2VA
    config) on `world` gloo ranks at `sp`: FSDP2's all-gathers and reduce-scatters, the clip's
    all-reduce, Ulysses' all-to-alls (forward and backward)."""
    config = config or Path(__file__).resolve().parents[2] / "configs" / "tiny_fl2va.yaml"
    return CollectiveCounts(
        run_ranks(_collectives_worker, world, sp, str(config), list(overrides or []), cpu_offload)[0]
    )


def format_trade(trade: dict[str, dict[str, float]]) -> str:
    lines = ["checkpointing   saved activations   vs none   step s   vs none"]
    for mode, e in trade.items():
        lines.append(
            f"{mode:<15} {e['saved_bytes'] / 2**20:14.1f} MiB   {e['memory_vs_none']:7.3f}  "
            f"{e['step_s']:7.3f}  {e['time_vs_none']:7.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    ratios = activation_memory_ratios()
    print(
        f"saved activations per rank, sp=2 / sp=1: {ratios['none']:.3f}; with full checkpointing {ratios['full']:.3f}"
    )
    print(format_trade(checkpointing_trade()))
