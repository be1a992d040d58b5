"""What the ranks of `tests/runs/test_packing.py` run: one optimizer step's gradients, packed and unpacked.

`run_on_ranks` forks `nproc` ranks from the server `helpers.ranks` preloads (torch, diffusers and h3train
imported once, `start_processes`), sets what torchrun sets for its workers, and calls a function of this
module on each;
rank 0's return value comes back. `step_gradients` is that function: on every rank it builds two trainers
with `build_trainer`, trains step 1 through `Trainer.forward_backward` and gathers each parameter's full
gradient, once unpacked, once packed and once packed under each planted fault (`MUTATIONS`), all in one
process group, since starting the ranks is most of what a tiny step costs.

Float64: `build_model` is cast to float64 before it is wrapped and sharded, and FSDP2's units gather and
reduce in float64; the loss then takes the float64 predictions in float64 (`objective.masked_mse`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h3train.packing import members
from h3train.train.hooks import MicroBatchEvent, TrainerHook, TrainerView

from helpers.ranks import start_processes, torchrun_env

# -- forked ranks that call a function --------------------------------------------------------------


def run_on_ranks(fn: Callable[..., Any], nproc: int, *args: Any, env: dict[str, str], timeout: float = 240) -> Any:
    """`fn(*args)` on `nproc` ranks forked from the preloaded server (`ranks.start_processes`), each with what
    torchrun sets for its workers; rank 0's return value.

    `fn` must be a module-level function of an importable module (the server unpickles it), `env` the
    ranks' environment (`launch.run_env`). A rank that fails stops the others and raises with its traceback.
    """
    from h3train.parallel.dims import free_port

    with tempfile.TemporaryDirectory(prefix="h3train-pack-ranks-") as tmp:
        start_processes(_torchrun_rank, (nproc, str(free_port()), env, tmp, fn, args), nprocs=nproc, timeout=timeout)
        return torch.load(Path(tmp, "result.pt"), weights_only=False)


def _torchrun_rank(
    rank: int, nproc: int, port: str, env: dict[str, str], tmp: str, fn: Callable[..., Any], args: tuple
) -> None:
    """One rank: torchrun's environment for it, then `fn(*args)`; rank 0 saves the result."""
    os.environ.update(torchrun_env(env, rank, nproc, port))
    import torch.distributed

    # The server imported torch before this rank's thread count and debug level were set.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    torch.distributed.set_debug_level_from_env()
    result = fn(*args)
    if rank == 0:
        torch.save(result, f"{tmp}/result.pt")


# -- the planted faults -------------------------------------------------------------------------------


def _whole_pack_attention(query, key, value, segments, backend):
    """`segment_attention` that ignores the samples: every row of the pack attends over every other."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=backend)


def _refine_all_prompts(block, text, segments):
    """`sp_forward._refine` that leaves the processor's `segments` None: the pack's prompts attend together."""
    block.attn.processor.segments = None
    return block(text)


def _rows_not_offset(original: Callable) -> Callable:
    """`pack_forward_rows` whose samples keep their own `timestep_indices`, not moved past the samples
    before them: every sample reads the first sample's AdaLN rows."""

    def pack(branches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = original(branches)
        out["timestep_indices"] = torch.cat([rows["timestep_indices"] for rows in branches])
        return out

    return pack


#: Planted fault -> (module, attribute, replacement given the original).
MUTATIONS: dict[str, tuple[str, str, Callable[[Callable], Callable]]] = {
    "whole_pack_attention": ("h3train.model.sp_forward", "segment_attention", lambda _: _whole_pack_attention),
    "refiner_over_all_prompts": ("h3train.model.sp_forward", "_refine", lambda _: _refine_all_prompts),
    "adaln_rows_not_offset": ("h3train.packing", "pack_forward_rows", _rows_not_offset),
}


@contextlib.contextmanager
def planted(mutation: str) -> Iterator[None]:
    """The package with fault `mutation` in place for the duration."""
    import importlib

    module_name, attr, make = MUTATIONS[mutation]
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, make(original))
    try:
        yield
    finally:
        setattr(module, attr, original)


def mixed_overrides(data: Path, log_dir: Path) -> list[str]:
    """A forked trainer's overrides on the mixed dataset `data` (`conftest.mixed_data`): its samples up to
    100 rows, no checkpoint, no progress bar, its files in `log_dir`."""
    return [
        f"logging.dir={log_dir}",
        "logging.progress=false",
        "task.name=mixed",
        f"data.path={data}",
        "data.create_synthetic=false",
        "data.max_rows=100",
        "checkpoint.every=0",
    ]


def close_trainer(trainer: Any) -> None:
    """Stop what a trainer built in a forked rank holds open: its prefetch, its checkpointer, its run lock."""
    trainer.parts.batches.close()
    trainer.parts.checkpointer.close()
    if trainer.parts.lock is not None:
        trainer.parts.lock.release()


# -- one step, packed and unpacked ---------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one run of step 1 trained, gathered over every rank.

    `grads`: each parameter's full gradient (float64). `losses`: each sample's own loss by id.
    `micro_batches[dp_rank]`: the sample ids of each micro-batch that DP rank trained, in order.
    `stats`: the step's logged `loss`, `grad_norm` and `samples` (after `Trainer.update`; None when
    the step was not taken).
    """

    grads: dict[str, torch.Tensor]
    losses: dict[str, float]
    micro_batches: list[list[list[str]]]
    stats: dict[str, float] | None = None


@dataclass
class StepRuns:
    """Step 1 unpacked, packed, and packed under each planted fault (`MUTATIONS`)."""

    unpacked: StepRecord
    packed: StepRecord
    mutated: dict[str, StepRecord] = field(default_factory=dict)


def float64_training() -> None:
    """This process's trainers build a float64 model and shard it with float64 gathers and reductions."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import h3train.model.fsdp as fsdp
    import h3train.run.assemble as assemble

    build = assemble.build_model
    assemble.build_model = lambda cfg, seed: build(cfg, seed).to(torch.float64)
    fsdp._policy = lambda dtype: MixedPrecisionPolicy(
        param_dtype=torch.float64, reduce_dtype=torch.float64, cast_forward_inputs=False
    )


class MicroBatches(TrainerHook):
    """A step hook that records the sample ids of each micro-batch this rank trains."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        self.seen.append([s.sample_id for s in members(batch.sample)])


def train_step_one(trainer, recorder: MicroBatches, start: dict, update: bool) -> StepRecord:
    """Step 1 of `trainer` from sampler state `start`, its gradients gathered (and then taken, with `update`)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    batches = trainer.parts.batches
    batches.close()
    batches.load_state_dict(dict(start))
    trainer.parts.optimizer.zero_grad(set_to_none=True)
    recorder.seen.clear()
    step = trainer.forward_backward(1)
    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad
        if grad is not None:
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    ctx = trainer.ctx
    mine = (ctx.dp_rank, ctx.sp_rank, [float(v) for v in step.losses], list(step.sample_ids), recorder.seen)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    leads = sorted((entry for entry in everyone if entry[1] == 0), key=lambda entry: entry[0])
    losses = {sample_id: loss for entry in leads for loss, sample_id in zip(entry[2], entry[3], strict=True)}
    record = StepRecord(grads, losses, [[list(m) for m in entry[4]] for entry in leads])
    if update:
        stats = trainer.update(1, step)
        record.stats = {key: float(stats[key]) for key in ("loss", "grad_norm", "samples")}
    return record


def step_gradients(config: str, unpacked: list[str], packed: list[str], mutations: list[str]) -> StepRuns:
    """On each rank: step 1 of `config` with the `unpacked` overrides, then with the `packed` ones, clean and
    under each of `mutations`. Both trainers are built from the same seed, so they hold the same weights."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    float64_training()
    trainers, records = [], {}
    for name, overrides in (("unpacked", unpacked), ("packed", packed)):
        recorder = MicroBatches()
        trainer = build_trainer(load_config(config, overrides), hooks=[recorder])
        trainers.append(trainer)
        start = trainer.parts.batches.state_dict()
        if name == "packed":
            # The faults first: the clean step's update changes the weights they must share.
            for mutation in mutations:
                with planted(mutation):
                    records[mutation] = train_step_one(trainer, recorder, start, update=False)
        records[name] = train_step_one(trainer, recorder, start, update=True)
    for trainer in trainers:
        close_trainer(trainer)
    dist.barrier()
    dist.destroy_process_group()
    unpacked_record, packed_record = records.pop("unpacked"), records.pop("packed")
    return StepRuns(unpacked_record, packed_record, records)
