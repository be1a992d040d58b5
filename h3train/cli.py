"""`h3train` command line: train, check, synth, plot.

A bad config or bad input exits 2 with one line on stderr, before any process group or model.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, load_config


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from .train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.fit()
    except BaseException:
        # No barrier: the other ranks may be blocked in a collective this rank will never join.
        trainer.close(clean=False)
        raise
    trainer.close()
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from .config import model_dims
    from .parallel.dims import ParallelDims

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg.parallel, world)
    print(f"config ok: {args.config}")
    print(dims.describe())
    from .plan import estimate, format_plan

    print(format_plan(estimate(model_dims(cfg), dims, cfg)))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from .data.synth import write_synthetic_dataset

    out = write_synthetic_dataset(
        args.out, task=args.task, num_samples=args.num_samples, seed=args.seed, text_dim=args.text_dim
    )
    print(f"wrote {args.num_samples} {args.task} samples to {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, args.dtype, int(args.max_shard_gb * 1024**3))
    print(f"exported {args.checkpoint} to {out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3train", description="Train MiniMax H3 with FSDP2 + Ulysses SP.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML config (alone or under torchrun)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.sp=2")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("check", help="validate a config and its parallel plan; print memory per rank")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE or 1")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("synth", help="write a synthetic cached dataset (tests and demos)")
    p.add_argument("--out", required=True)
    p.add_argument("--task", default="fl2va", choices=("fl2va", "ref2va", "mixed"))
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-dim", type=int, default=16)
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("export", help="write a checkpoint as a diffusers transformer folder")
    p.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/x/checkpoints/step_00001000")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "bf16", "fp32"))
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("plot", help="plot loss and grad_norm from metrics.jsonl to a PNG")
    p.add_argument("metrics")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"h3train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
