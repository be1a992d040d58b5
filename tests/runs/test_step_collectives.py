"""Collectives per training step under the FSDP2 unit plan (`model/fsdp.py`), counted, not timed.

Two gloo ranks at sp = 2 train the tiny FL2VA model (2 blocks, 1 refiner block); the second step's
collectives are counted by wrapping the `torch.distributed` and functional-collective entry points.
The plan before it (one unit per float32 island, every unit but the root resharded after forward)
issued 17 all-gathers and 9 reduce-scatters here, 26 in all.
"""

from __future__ import annotations

import pytest
import yaml

from h3train.parallel.collectives import fsdp_collectives_per_step, functional_all_to_alls_per_step
from h3train.tools.bench_memory import step_collectives

from helpers.launch import tiny_overrides
from helpers.paths import TINY_FL2VA
from helpers.ranks import run_ranks


@pytest.mark.slow
def test_sp2_step_issues_the_planned_collectives() -> None:
    dims = yaml.safe_load(TINY_FL2VA.read_text())["model"]["config"]
    layers, refiner = dims["num_layers"], dims["num_refiner_layers"]
    counts = step_collectives(world=2, sp=2, config=TINY_FL2VA, overrides=["parallel.adaln_tables=true"])

    planned = fsdp_collectives_per_step(layers, refiner, shard_size=2)
    assert counts.fsdp() == planned
    # Islands in one unit, the last block kept unsharded for backward: 12 where there were 26.
    assert sum(planned.values()) == 12
    # Ulysses: one fused q/k/v all-to-all and one back per block, each way; the AdaLN tables computed where
    # their weights live (sp 2 is a shard group of 2): every block's table slices in one all-to-all each way
    # a step, the embeddings all-gathered once and their gradients reduce-scattered back once.
    assert functional_all_to_alls_per_step(layers, sp=2) == 4 * layers
    assert counts.kind("all_to_all") == 4 * layers + 2
    assert counts["op.all_gather_into_tensor"] == counts["op.reduce_scatter_tensor"] == 1
    # The output heads travel back in one all-gather; the clip's norm in one all-reduce, and nothing else
    # is reduced (the tables' rows are the host's bound, not agreed).
    assert counts["dist.all_gather"] == 1
    assert counts["funcol.all_reduce"] == 1
    assert counts["dist.all_reduce"] == 0


def _stale_worker(rank: int, world: int) -> dict[str, float]:
    """A forward without gradients, then new sharded values (as the EMA swap writes them), then a forward."""
    import torch

    from h3train.config import load_config
    from h3train.model.build import build_model
    from h3train.model.fsdp import apply_fsdp
    from h3train.model.sp_forward import SequenceParallelH3
    from h3train.objective import compute_loss, micro_batch_inputs
    from h3train.parallel.dims import ParallelContext, ParallelDims
    from h3train.parallel.ulysses import SequenceParallel
    from h3train.tasks.synthetic import SyntheticSource

    cfg = load_config(TINY_FL2VA)
    ctx = ParallelContext(ParallelDims(1, world, 1, world), torch.device("cpu"))
    transformer = build_model(cfg, cfg.train.seed)
    model = apply_fsdp(SequenceParallelH3(transformer, SequenceParallel(None)), ctx, "float32")
    ti = micro_batch_inputs(cfg, SyntheticSource(cfg.data.synthetic, 16, 0)[0], step=1, slot=0)
    sharded = list(model.parameters())  # held as the EMA holds them
    with torch.no_grad():
        compute_loss(model, ti)
        for p in sharded:
            p.to_local().mul_(0.5)
        halved = float(compute_loss(model, ti).loss)
    fresh = build_model(cfg, cfg.train.seed)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
        expected = float(compute_loss(SequenceParallelH3(fresh, SequenceParallel(None)), ti).loss)
    return {"halved": halved, "expected": expected}


@pytest.mark.slow
def test_forward_without_gradients_leaves_no_stale_unsharded_copy() -> None:
    # One rank: no unit reshards after forward there, the case where a stale copy would hide most.
    result = run_ranks(_stale_worker, 1)[0]
    assert result["halved"] == pytest.approx(result["expected"], rel=1e-6)


@pytest.mark.parametrize(
    ("dtype", "lora_rank", "sharded"),
    [("float32", 0, False), ("bfloat16", 0, True), ("float32", 4, True)],
    ids=["float32", "bf16_compute", "lora_bf16_base"],
)
def test_one_rank_run_keeps_fsdp2_only_where_it_casts(tmp_path, dtype, lora_rank, sharded) -> None:
    # Alone and in float32, FSDP2 would only copy every unit into an unsharded twin and back.
    import math

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    overrides = tiny_overrides(tmp_path, "checkpoint.every=0", "train.steps=1")
    cfg = load_config(TINY_FL2VA, [*overrides, f"model.dtype={dtype}", f"lora.rank={lora_rank}"])
    trainer = build_trainer(cfg, hooks=[])
    try:
        units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        distributed = [p for p in trainer.model.parameters() if isinstance(p, DTensor)]
        stats = trainer.train_step(1)
    finally:
        trainer.close()
    assert bool(units) is sharded and bool(distributed) is sharded
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
