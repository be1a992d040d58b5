"""`h3train check CONFIG [key=value ...]`: validate a config and its parallel plan; print memory per rank and
the estimated time of a step (`plan/step_time.py`), or with `--layouts` every layout of the ranks that fits."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .arguments import Parser

if TYPE_CHECKING:
    from ..config import Config
    from ..plan import Rates
    from ..run.blueprint import Blueprint

NAME = "check"
HELP = "validate a config and its parallel plan; print memory per rank and the estimated step time"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world-size", type=int, default=None, at_least=1, help="default: $WORLD_SIZE or 1")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        at_least=1,
        help="ranks on one node, for the host memory a node needs (default: $LOCAL_WORLD_SIZE or 8)",
    )
    parser.add_argument(
        "--device",
        choices=("a100", "h100", "h200"),
        default="a100",  # the plan's default card (`plan.DEFAULT_DEVICE`)
        help="the GPU the plan and the step-time estimate are for: its memory as torch reports it, bf16 peak "
        "and assumed link bandwidths (default: a100, 79.3 GiB)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        default=None,
        above_zero=True,
        help="sustained TFLOP/s of one GPU on this model (measured: docs/cluster.md); default: the H200's "
        "measured figure, elsewhere assumed at its MFU",
    )
    parser.add_argument(
        "--intra-node-gbps",
        type=float,
        default=None,
        above_zero=True,
        help="bus bandwidth per GPU within a node in GB/s (h3train.tools.nccl_bandwidth, group 'node'); "
        "default: assumed per --device",
    )
    parser.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        above_zero=True,
        help="bus bandwidth per GPU across nodes in GB/s (h3train.tools.nccl_bandwidth, group 'world' over two "
        "nodes); default: assumed per --device",
    )
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="list the layouts (sp, dp_shard, dp_replicate) of --world-size ranks that fit, fastest first",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="also require what training needs here: the model folder and the dataset (launchers use it)",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="also build the run and take one step at --world-size on a fake process group with fake tensors "
        "(no GPU, no weights) and print its tracked memory beside the plan",
    )


def compile_line(blueprint: Blueprint) -> str:
    """Whether the planned (CUDA) run compiles its transformer blocks, and the `model.compile` that says so.

    A packed run says how its packs attend when compiled (one varlen call each); `model.compile: true`
    with packs this torch cannot compile is the one-line `ConfigError` of `resolve_compile`.
    """
    from ..config.values import packed_compile_missing

    cfg = blueprint.cfg
    given = str(cfg.model.compile).lower()
    if blueprint.compile_blocks:
        packs = ", each pack attending in one varlen call" if cfg.data.pack else ""
        return f"compile: each transformer block, on CUDA{packs} (model.compile: {given})"
    why = ""
    if given == "auto":
        why = ": it compiles bfloat16 compute on CUDA"
        missing = packed_compile_missing(cfg, "cuda") if cfg.data.pack and cfg.model.dtype == "bfloat16" else None
        if missing is not None:
            why += f", packs with torch >= 2.10's varlen attention, and {missing}"
    return f"compile: off (model.compile: {given}{why})"


def device_rates(args: argparse.Namespace) -> Rates:
    """The estimate's rates for `--device` and the measured figures given as flags; the card's dense bf16
    peak is the bench's (`tools/bench/flops.py`), which the MFU is of."""
    from ..plan import DEVICE_KINDS
    from ..plan import device_rates as rates_of
    from ..plan.step_time import peak_tflops_for

    peak = peak_tflops_for(DEVICE_KINDS[args.device].name)
    assert peak is not None, f"no bf16 peak for {DEVICE_KINDS[args.device].name}"
    return rates_of(
        args.device,
        peak,
        tflops=args.tflops,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..parallel.dims import ParallelDims
    from ..plan import estimate
    from ..run.blueprint import draw
    from ..run.preflight import JobDevice, preflight

    cfg = load_config(args.config, args.overrides)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    # Without --strict, what is not on this machine is planned for and named, not required.
    checked = preflight(cfg, planning=not args.strict, world_size=world)
    notes = checked.notes
    dims = ParallelDims.from_config(cfg.parallel, world)
    per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "8"))
    model_dims = checked.model_dims
    rates = device_rates(args)
    memory_gib = rates.device.memory_gib

    def plan_of(c: Config, d: ParallelDims = dims):
        return estimate(model_dims, d, c, ranks_per_node=per_node, device_memory_gib=memory_gib)

    print(f"config ok: {args.config}")
    for note in notes:
        print(f"assumed: {note}")
    print(dims.describe())
    # The run on CUDA draws the same blueprint (`run.blueprint.draw`); what follows plans it.
    blueprint = draw(
        checked,
        dims,
        JobDevice(memory_gib, args.device),
        device_kind="cuda",
        ranks_per_node=per_node,
        plan_of=plan_of,
        both_tables=True,
        rates=rates,
    )
    print(compile_line(blueprint))
    if cfg.data.source == "cached" and not isinstance(cfg.data.path, str) and not notes:
        from ..data.mixture import DatasetMixture
        from ..data.source import build_source

        if isinstance(source := build_source(cfg), DatasetMixture):
            print(source.describe())
    from ..plan import (
        format_layouts,
        format_plan,
        format_step,
        layout_estimates,
        planned_step,
        refuse_over_plan,
        samples_lines,
    )
    from ..plan.tables import tables_line

    if blueprint.tables is not None:
        print(tables_line(blueprint.tables))
    cfg, plan = blueprint.cfg, blueprint.memory_plan
    for line in blueprint.data_lines():
        print(line)
    print(format_plan(plan), flush=True)
    if plan.fits:
        step = planned_step(cfg, dims, plan, model_dims, rates, ranks_per_node=per_node)
        print(format_step(step, packed=plan.packed), flush=True)
    if args.layouts:
        found = layout_estimates(
            cfg,
            world,
            model_dims,
            rates,
            ranks_per_node=per_node,
            plan_of=plan_of,
        )
        print(format_layouts(found, world, rates, per_node), flush=True)
    for line in samples_lines(cfg, blueprint.composer, model_dims) if not notes else []:
        print(line)
    if args.rehearse:
        from ..run.rehearse import rehearse
        from ..run.rehearse.formatting import format_rehearsal

        print(format_rehearsal(rehearse(cfg, world)))
    refuse_over_plan(plan, "cuda", cfg.train.ignore_memory_plan)
    return 0
