"""`h3train config CONFIG [key=value ...]`: the resolved config as YAML, each value's source as a comment."""

from __future__ import annotations

import argparse

from .arguments import Parser

NAME = "config"
HELP = "print the resolved config as YAML, every default filled in, each value's source as a comment"


def add_arguments(parser: Parser) -> None:
    parser.add_argument("config", help="a YAML config, e.g. configs/tiny_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lora.rank=16")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..tools.config_report import report

    # The values' checks only (`check` also reads the files the config names and plans the model):
    # a config for another machine prints here as it resolves.
    cfg = load_config(args.config, args.overrides)
    print(report(cfg, args.config, args.overrides), end="")
    return 0
