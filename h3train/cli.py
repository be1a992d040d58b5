"""`h3train` command line: the parser built from the commands table (`commands.COMMANDS`), and dispatch.

A bad config or bad input exits 2 with one line on stderr, before any process group or model. Each
command is a module of `commands/`; the rules a process runs under are `commands.process`'s.
"""

from __future__ import annotations

import functools
from typing import NoReturn

from .commands import COMMANDS
from .commands.arguments import HelpFormatter, Parser
from .commands.process import code_of, exit_after


def build_parser() -> Parser:
    """The `h3train` parser: one subcommand per entry of `COMMANDS`, in its order."""
    parser = Parser(
        prog="h3train", description="Train MiniMax H3 with FSDP2 + Ulysses SP.", formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # A subcommand's parser does not take its parent's formatter.
    add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    for name, command in COMMANDS.items():
        parser.commands[name] = add_parser(name, help=command.HELP)
        command.add_arguments(parser.commands[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), check its values, run its command; its exit code."""
    parser = build_parser()
    # Overrides may come after options (`check CONFIG --world-size 8 parallel.sp=4`): argparse leaves
    # such trailing `key=value` items unparsed, so they are appended to the overrides here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in item and not item.startswith("-") for item in extra):
            parser.unrecognized(extra, getattr(args, "command", None))
        args.overrides = [*args.overrides, *extra]
    command = COMMANDS[args.command]
    command_parser = parser.commands[args.command]

    def checked_run() -> int:
        command_parser.check(args)
        return command.run(args)

    return code_of(checked_run)


def run() -> NoReturn:
    """The `h3train` console script: `main()`, then the process's exit (`commands.process.exit_after`)."""
    exit_after(main)


if __name__ == "__main__":
    run()
