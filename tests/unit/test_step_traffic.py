"""`plan.traffic.step_traffic` on the released dims: its FSDP2 units are FSDP2's own, its blocks are the
parameter arithmetic's, its calls are the step's structure, and its sums agree with each other.

The units are held to FSDP2 itself: the released transformer is built on `meta`, wrapped and sharded by
the composition root's `wrap_and_shard` over a fake process group (this process rank 0 of N), and each
unit's all-gather input (every parameter's padded shard in its gather dtype) and reduce-scatter output are
read off FSDP2's parameter groups. The collectives a real step issues are held to the same function by
`tests/runs/test_traffic.py`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from h3train.config import Config, load_config
from h3train.model.architecture import model_defaults, planned_model_dims
from h3train.parallel.collectives import wire_bytes
from h3train.parallel.dims import ParallelDims
from h3train.plan import parameter_counts
from h3train.plan.inputs import adapter_counts
from h3train.plan.traffic import (
    STEP_VALUES,
    ForwardShape,
    fsdp_units,
    group_link,
    planned_forwards,
    planned_transformer,
    served_projections,
    step_traffic,
)

from helpers.paths import ROOT

CONFIGS = ROOT / "configs"
RANKS_PER_NODE = 8


def load(name: str, *overrides: str) -> Config:
    return load_config(CONFIGS / name, list(overrides))


def world_of(cfg: Config, world: int) -> ParallelDims:
    return ParallelDims.from_config(cfg.parallel, world)


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16])
def test_wire_bytes_move_what_a_ring_moves(n: int) -> None:
    share = 1000 * n
    whole = share * n
    gathered = wire_bytes("all_gather", n, share)
    # A reduce-scatter to a share moves what an all-gather of that share does; an all-reduce is both.
    assert wire_bytes("reduce_scatter", n, share) == gathered
    assert wire_bytes("all_reduce", n, whole) == tuple(2 * x for x in gathered)
    # An all-to-all sends every chunk but its own: an all-gather of one chunk.
    assert wire_bytes("all_to_all", n, whole) == gathered
    assert gathered[0] == gathered[1] == whole - share
    assert wire_bytes("broadcast", n, whole) == wire_bytes("all_to_all", n, whole)
    assert all(wire_bytes(kind, 1, whole) == (0, 0) for kind in ("all_gather", "all_reduce", "all_to_all"))
    with pytest.raises(ValueError):
        wire_bytes("barrier", n, whole)


def _released(cfg: Config) -> Config:
    """`cfg` building the released transformer from `model.config` (its pretrained folder is not here)."""
    return replace(cfg, model=replace(cfg.model, pretrained=None, config=dict(model_defaults())))


def _fsdp2_units(cfg: Config, world: int) -> list[tuple[int, int]]:
    """`(all-gather input bytes, reduce-scatter output bytes)` of each FSDP2 unit `wrap_and_shard` makes of
    `cfg`'s model on `meta`, over a fake group of `world` ranks, as FSDP2's parameter groups hold them."""
    from torch.distributed.fsdp import FSDPModule

    from h3train.lora.transforms import model_transforms
    from h3train.parallel.dims import ParallelContext
    from h3train.run.assemble import wrap_and_shard
    from h3train.run.rehearse import fake_process_group

    from helpers.blueprints import blueprint_of

    out, seen = [], set()
    with fake_process_group(world):
        ctx = ParallelContext(world_of(cfg, world), torch.device("cpu"))
        blueprint = blueprint_of(_released(cfg), "cpu", 80.0, world)
        model = wrap_and_shard(blueprint, ctx, model_transforms(cfg), from_meta=True)
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None or id(group) in seen:  # the islands' modules share one group
                continue
            seen.add(id(group))
            group._init_mp_dtypes()  # what FSDP2's lazy init sets before the first all-gather
            params = group.fsdp_params
            gathered = sum(p._sharded_param_data.numel() * (p.param_dtype or p.orig_dtype).itemsize for p in params)
            reduced = sum(
                p._sharded_param_data.numel() * (p.reduce_dtype or p.param_dtype or p.orig_dtype).itemsize
                for p in params
                if p.sharded_param.requires_grad
            )
            out.append((gathered, reduced))
    return out


@pytest.mark.parametrize("tables", ["false", "true"])
@pytest.mark.parametrize(
    ("name", "world", "overrides"),
    [
        ("h3_a100_64gpu.yaml", 64, ()),
        # A shard group of 7 divides no norm_q (128 values): FSDP2 pads those shards.
        ("h3_fl2va_a100.yaml", 7, ("parallel.sp=7",)),
    ],
    ids=["hsdp_4x16", "sp7_padded"],
)
def test_units_are_the_ones_fsdp2_shards(name: str, world: int, overrides: tuple[str, ...], tables: str) -> None:
    cfg = load(name, f"parallel.adaln_tables={tables}", *overrides)
    dims = world_of(cfg, world)
    transformer = planned_transformer(cfg)
    served = served_projections(cfg, dims, transformer)
    assert any(served) == (tables == "true")
    units = fsdp_units(transformer, torch.bfloat16, dims.shard_size, dims.dp_replicate * dims.shard_size, served)
    assert sorted((u.gathered, u.reduced) for u in units) == sorted(_fsdp2_units(cfg, world))


def test_released_block_gathers_its_parameters_without_the_tables_projection() -> None:
    # 16 ranks divide every released block parameter's first dim: no padding, the arithmetic's count exactly.
    cfg = load("h3_a100_16gpu.yaml", "parallel.adaln_tables=true")
    dims = world_of(cfg, 16)
    counts = parameter_counts(planned_model_dims(cfg)[0])
    bf16 = torch.bfloat16.itemsize
    before = step_traffic(
        load("h3_a100_16gpu.yaml", "parallel.adaln_tables=false"), dims, ranks_per_node=RANKS_PER_NODE
    )
    after = step_traffic(cfg, dims, ranks_per_node=RANKS_PER_NODE)
    assert before.block_all_gather_bytes() == counts.block * bf16
    assert after.block_all_gather_bytes() == (counts.block - counts.block_adaln) * bf16
    assert not before.tables and after.tables
    print(f"released block all-gathered: {before.block_all_gather_bytes():,} B -> {after.block_all_gather_bytes():,} B")


def _calls(traffic, what: str, phase: str | None = None) -> int:
    return sum(e.calls for e in traffic.exchanges if e.what == what and (phase is None or e.phase == phase))


@pytest.mark.parametrize("tables", ["false", "true"])
def test_released_step_issues_each_collective_the_step_makes(tables: str) -> None:
    cfg = load("h3_a100_32gpu.yaml", f"parallel.adaln_tables={tables}")
    dims = world_of(cfg, 32)
    dp_replicate, shard = dims.dp_replicate, dims.shard_size
    transformer = planned_transformer(cfg)
    forwards = planned_forwards(cfg, dims)
    accum = cfg.train.grad_accum
    # No CFG: one forward with gradients per micro-batch, of the planned rows.
    assert [f.grad for f in forwards] == [True] * accum
    policies = ("full", "selective") * (transformer.config.num_layers // 2)
    traffic = step_traffic(cfg, dims, ranks_per_node=RANKS_PER_NODE, forwards=forwards, policies=policies)
    layers, refiners = transformer.config.num_layers, transformer.config.num_refiner_layers
    units = layers + refiners + 2
    assert _calls(traffic, "fsdp all-gather", "forward") == accum * units
    # Backward gathers again every block but the last; every unit reduce-scatters.
    assert _calls(traffic, "fsdp all-gather", "backward") == accum * (layers + refiners - 1)
    assert _calls(traffic, "fsdp reduce-scatter") == accum * units
    assert _calls(traffic, "hsdp all-reduce") == units
    recomputed = sum(p != "none" for p in policies)
    for what in ("ulysses q/k/v all-to-all", "ulysses output all-to-all"):
        assert _calls(traffic, what, "forward") == accum * layers
        assert _calls(traffic, what, "backward") == accum * (layers + recomputed)
    if tables == "true":
        # Every block's table in one exchange a forward, before the block loop: a recomputed block re-issues
        # none, and no count of timesteps is agreed (the rows are the host's bound).
        assert not [e for e in traffic.exchanges if e.kind == "all_reduce" and e.what.startswith("table timesteps")]
        assert _calls(traffic, "table all-to-all", "forward") == _calls(traffic, "table all-to-all") == accum
        assert _calls(traffic, "table embeddings all-gather") == accum
        assert _calls(traffic, "table gradient all-to-all") == accum
        # Across replicas once a step, as FSDP2's units: the accumulated weight and bias gradients.
        assert _calls(traffic, "table weight all-reduce") == _calls(traffic, "table bias all-reduce") == layers
    else:
        assert not [e for e in traffic.exchanges if e.what.startswith("table")]
    # The HSDP all-reduce carries every gradient shard once, in float32: 2 (R - 1) / R of them.
    counts = parameter_counts(planned_model_dims(cfg)[0])
    in_units = counts.total - (layers * counts.block_adaln if tables == "true" else 0)
    hsdp = sum(e.sent for e in traffic.exchanges if e.what == "hsdp all-reduce")
    assert hsdp == 2 * (dp_replicate - 1) * in_units * 4 // shard // dp_replicate
    # The gradient norm: one float32, the sum of the squares of the rank's shards; the step's sums:
    # STEP_VALUES float64.
    norm = next(e for e in traffic.exchanges if e.what == "grad-norm all-reduce")
    assert norm.calls == 1 and norm.sent == wire_bytes("all_reduce", shard, 4)[0]
    step = next(e for e in traffic.exchanges if e.what == "step all-reduce")
    assert (step.group, step.group_size) == ("world", dims.world_size)
    assert step.sent == wire_bytes("all_reduce", dims.world_size, 8 * STEP_VALUES)[0]


def test_sums_by_link_and_by_group_are_the_exchanges() -> None:
    cfg = load("h3_a100_64gpu.yaml")
    traffic = step_traffic(cfg, world_of(cfg, 64), ranks_per_node=RANKS_PER_NODE)
    by_group = traffic.per_group()
    by_link = traffic.per_link()
    for link, (sent, received) in by_link.items():
        assert sent == sum(s for (_, lk), (s, _) in by_group.items() if lk == link)
        assert received == sum(r for (_, lk), (_, r) in by_group.items() if lk == link)
    assert sum(s for s, _ in by_link.values()) == traffic.sent == sum(e.sent for e in traffic.exchanges) > 0


def test_links_follow_the_row_major_mesh() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2, sp=8, world_size=32)
    # 8 ranks a node: an sp group is one node; the shard group spans 2, the replicas 4 nodes apart.
    assert group_link("sp", dims, 8) == "intra_node"
    assert group_link("dp_shard_sp", dims, 8) == "inter_node"
    assert group_link("dp_replicate", dims, 8) == "inter_node"
    assert group_link("dp_shard_sp", dims, 16) == "intra_node"
    assert group_link("world", dims, 32) == "intra_node"
    # sp 4 in nodes of 6: some sp groups straddle two nodes.
    assert group_link("sp", ParallelDims(1, 3, 4, 12), 6) == "inter_node"


def test_lora_step_reduces_the_adapters_alone_and_exchanges_no_table_gradient() -> None:
    cfg = load("h3_fl2va_lora_a100.yaml", "parallel.adaln_tables=true")
    dims = world_of(cfg, 8)
    traffic = step_traffic(cfg, dims, ranks_per_node=RANKS_PER_NODE)
    lora = adapter_counts(planned_model_dims(cfg)[0], cfg)
    shard, accum = dims.shard_size, cfg.train.grad_accum
    scattered = sum(e.sent for e in traffic.exchanges if e.what == "fsdp reduce-scatter")
    # float32 adapters, padded per tensor to the shard size: at least their own bytes.
    per_step = accum * (shard - 1) * lora.trainable * 4 // shard
    assert per_step <= scattered < per_step * 1.01
    assert traffic.tables
    assert not [e for e in traffic.exchanges if e.what in ("table gradient all-to-all", "table weight all-reduce")]
    # Every block is recomputed (`full`), and none of them exchanges its table again in backward.
    assert _calls(traffic, "table all-to-all", "backward") == 0
    assert _calls(traffic, "table all-to-all", "forward") == accum


def test_cfg_step_runs_a_negative_forward_without_gradient_first() -> None:
    cfg = load("h3_ref2va_cfg_a100.yaml", "parallel.adaln_tables=true")
    dims = world_of(cfg, 8)
    forwards = planned_forwards(cfg, dims)
    accum = cfg.train.grad_accum
    assert [f.grad for f in forwards] == [False, True] * accum
    traffic = step_traffic(cfg, dims, ranks_per_node=RANKS_PER_NODE, forwards=forwards)
    units = len(traffic.units)
    # The negative gathers every unit and is resharded after; only the positive's backward gathers again.
    assert _calls(traffic, "fsdp all-gather", "forward") == 2 * accum * units
    assert _calls(traffic, "table all-to-all", "forward") == 2 * accum
    no_grad = step_traffic(
        cfg, dims, ranks_per_node=RANKS_PER_NODE, forwards=[f for f in forwards if not f.grad], policies=None
    )
    assert _calls(no_grad, "fsdp reduce-scatter") == 0 and _calls(no_grad, "fsdp all-gather", "backward") == 0


def test_ulysses_bytes_grow_with_the_rows_of_the_rank() -> None:
    cfg = load("h3_a100_16gpu.yaml", "model.activation_checkpointing=none")
    dims = world_of(cfg, 16)
    transformer = planned_transformer(cfg)
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    rows = 10_001

    def ulysses(forwards: list[ForwardShape]) -> int:
        traffic = step_traffic(cfg, dims, ranks_per_node=RANKS_PER_NODE, forwards=forwards, transformer=transformer)
        return sum(e.sent for e in traffic.exchanges if e.what.startswith("ulysses"))

    one = ulysses([ForwardShape(rows, 3, False)])
    local = math.ceil(rows / dims.sp)
    # q, k, v and the output back: 4 x local rows x width per block, all but the rank's own chunk.
    assert one == config.num_layers * wire_bytes("all_to_all", dims.sp, 4 * local * width * 2)[0]
    assert ulysses([ForwardShape(rows, 3, True)]) == 2 * one


def test_step_values_are_the_loops() -> None:
    from h3train.train.reduction import StepTotals

    assert len(StepTotals.names()) == STEP_VALUES
