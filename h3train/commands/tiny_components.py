"""`h3train tiny-components DIR`: a tiny random MiniMax-H3 pipeline folder, the same for the same seed."""

from __future__ import annotations

import argparse

from ..config import SEED_MAX
from .arguments import Parser, output_folder

NAME = "tiny-components"
HELP = "write a tiny random MiniMax-H3 pipeline folder (encoders, transformers, schedulers, an encode preset)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("dir", check=output_folder)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        at_least=0,
        at_most=SEED_MAX,
        help="seed of the random weights (the same seed, the same folder)",
    )


def run(args: argparse.Namespace) -> int:
    from ..data.components import write_tiny_components

    print(f"wrote tiny random components to {write_tiny_components(args.dir, seed=args.seed)}")
    return 0
