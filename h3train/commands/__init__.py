"""The `h3train` commands, one module each: its `NAME` and `HELP`, `add_arguments(parser)` (each number's
range and each path's check given where the argument is added, `arguments.Parser`) and `run(args)`, its
exit code. `process` holds the rules every command runs under (Ctrl-C, which rank reports an error, the
exit). A command imports torch and the model only inside its `run`: a bad flag costs no torch import.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from . import bench, check, config, encode, export, generate, index, plot, shard, synth, tiny_components, train
from .arguments import Parser


class Command(Protocol):
    """What a command module defines."""

    NAME: str
    HELP: str

    def add_arguments(self, parser: Parser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# Name -> command, in the order `h3train --help` lists them.
COMMANDS: dict[str, Command] = {
    command.NAME: command
    for command in (train, check, config, synth, index, shard, export, generate, plot, encode, tiny_components, bench)
}
