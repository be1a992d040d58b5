"""`h3train synth --out DIR`: a synthetic cached dataset, for tests and demos."""

from __future__ import annotations

import argparse

from ..config import SEED_MAX
from ..tasks.table import TRAINING_TASKS
from .arguments import Parser, output_folder

NAME = "synth"
HELP = "write a synthetic cached dataset (tests and demos)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("--out", required=True, check=output_folder)
    parser.add_argument("--task", default="fl2va", choices=tuple(TRAINING_TASKS), help="a task.name: its sample tasks")
    parser.add_argument("--num-samples", type=int, default=16, at_least=1, help="samples to write")
    parser.add_argument(
        "--seed", type=int, default=0, at_least=0, at_most=SEED_MAX, help="seed of the random latents and embeddings"
    )
    parser.add_argument(
        "--text-dim", type=int, default=16, at_least=1, help="width of the prompt embeddings (the model's text_dim)"
    )


def run(args: argparse.Namespace) -> int:
    from ..data.synth import write_synthetic_dataset

    out = write_synthetic_dataset(
        args.out, task=args.task, num_samples=args.num_samples, seed=args.seed, text_dim=args.text_dim
    )
    print(f"wrote {args.num_samples} {args.task} samples to {out}")
    return 0
