"""`h3train plot METRICS --out FILE.png`: losses (smoothed; under CFG the objective on its own axis), grad_norm,
lr and samples per step from metrics.jsonl."""

from __future__ import annotations

import argparse

from .arguments import Parser, output_file

NAME = "plot"
HELP = "plot losses (smoothed; under CFG the objective on its own axis), grad_norm, lr and samples from metrics.jsonl"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("metrics")
    parser.add_argument("--out", required=True, check=output_file)


def run(args: argparse.Namespace) -> int:
    from ..tools.curves import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0
