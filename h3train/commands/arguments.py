"""The parser every command adds its arguments to: the range a number takes and the check a path or a
file name needs are given where the argument is added, and checked once the command line is parsed,
before any work.

Each failure is one `ConfigError` line naming the flag, what it holds and what it takes (exit 2); the
config's own keys are `config.validate`'s. Only the standard library, `errors` and `infra.diskspace`
are imported: a bad flag costs no torch import.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ..errors import ConfigError, did_you_mean, did_you_mean_each
from ..infra.diskspace import nearest_existing

# A check of one parsed value: (value, the name a message calls it by) -> None, `ConfigError` if it fails.
Check = Callable[[Any, str], None]


@dataclass(frozen=True)
class Range:
    """What a number takes: finite, at least `low`, at most `high` (None: unbounded), and above zero
    when `above_zero`. A message states the bound as `in [low, high]`, `> low` or `>= low`."""

    low: float = -math.inf
    high: float | None = None
    above_zero: bool = False

    def check(self, flag: str, value: float) -> None:
        """`ConfigError` naming `flag` if `value` is not what this range takes."""
        if not math.isfinite(value):
            raise ConfigError(f"{flag} is {value}; it takes a finite number")
        low, high = self.low, self.high
        if value < low or (high is not None and value > high) or (self.above_zero and value <= 0):
            bound = f"in [{low}, {high}]" if high is not None else (f"> {low}" if self.above_zero else f">= {low}")
            raise ConfigError(f"{flag} is {value}; it takes a value {bound}")


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors name the nearest valid subcommand, choice or flag, and whose
    arguments carry their ranges and checks (`add_argument`, `check`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before argparse's own `__init__`, which adds `--help` through `add_argument`.
        # Destination -> the range of a number a command takes; every other number is only finite.
        self.ranges: dict[str, Range] = {}
        # (destination, name in messages, check), in the order the arguments are added.
        self.checks: list[tuple[str, str, Check]] = []
        super().__init__(*args, **kwargs)
        # Python 3.14's own suggestions (`maybe you meant`) would repeat ours.
        self.suggest_on_error = False
        # Subcommand name -> its parser, once the commands are added.
        self.commands: dict[str, Parser] = {}

    def add_argument(
        self,
        *flags: str,
        at_least: float = -math.inf,
        at_most: float | None = None,
        above_zero: bool = False,
        check: Check | None = None,
        **kwargs: Any,
    ) -> argparse.Action:
        """argparse's `add_argument`, and what the parsed value takes: a number `at_least`, `at_most`,
        `above_zero`; any value (None, not given, is never checked) passes `check`."""
        action = super().add_argument(*flags, **kwargs)
        if (at_least, at_most, above_zero) != (-math.inf, None, False):
            self.ranges[action.dest] = Range(at_least, at_most, above_zero)
        if check is not None:
            name = action.option_strings[0] if action.option_strings else action.dest.upper()
            self.checks.append((action.dest, name, check))
        return action

    def check(self, args: argparse.Namespace) -> None:
        """Every number of `args` finite and in range, then every checked value; `ConfigError` on the first not."""
        for dest, value in vars(args).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.ranges.get(dest, Range()).check("--" + dest.replace("_", "-"), value)
        for dest, name, check in self.checks:
            if getattr(args, dest) is not None:
                check(getattr(args, dest), name)

    def _check_value(self, action: argparse.Action, value: object) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            hint = did_you_mean(value, map(str, action.choices)) if isinstance(value, str) and action.choices else ""
            if not hint:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}{hint}") from None

    def flags(self, command: str | None) -> list[str]:
        """The option strings `command` takes (the top level's without one)."""
        parser = self.commands.get(command or "", self)
        return [flag for action in parser._actions for flag in action.option_strings]

    def unrecognized(self, extra: list[str], command: str | None) -> NoReturn:
        """argparse's error for arguments nothing took, naming the nearest flag of `command` to each unknown one."""
        unknown = [item.split("=", 1)[0] for item in extra if item.startswith("-")]
        self.error(f"unrecognized arguments: {' '.join(extra)}{did_you_mean_each(unknown, self.flags(command))}")


class HelpFormatter(argparse.HelpFormatter):
    """Each option's default said once: `(default: X)` after its help, unless the help says it already
    or the default is no value at all (None, an empty string, an unset flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        unsaid = (
            text
            and action.option_strings
            and not action.required
            and default is not None
            and default is not argparse.SUPPRESS
            and not isinstance(default, bool)
            and default != ""
            and "default" not in text.lower()
        )
        return f"{text} (default: %(default)s)" if unsaid else text


# Pseudo-filesystems: nothing written there is a file anyone can read back (`/dev/shm` is memory, a disk).
_NOT_A_DISK = ("/proc", "/sys", "/dev")
_SHARED_MEMORY = Path("/dev/shm")
# diffusers reads a LoRA file as safetensors only by this suffix (any other it unpickles).
LORA_FILE_SUFFIX = ".safetensors"
# The longest file name the common file systems take, in bytes.
_NAME_MAX = 255


def check_output_folder(path: Path, what: str) -> None:
    """`path` is, or can be created as, a folder this process can write; nothing is created here."""
    absolute = Path(os.path.abspath(path.expanduser()))
    within = [absolute, *absolute.parents]
    pseudo = next((root for root in _NOT_A_DISK if Path(root) in within), None)
    if pseudo is not None and _SHARED_MEMORY not in within:
        raise ConfigError(f"{what} '{path}' is under {pseudo}, which holds no files; name a folder on a disk")
    if absolute.exists() and not absolute.is_dir():
        raise ConfigError(f"{what} '{path}' is a file, not a folder; name a folder to write into")
    existing = nearest_existing(absolute)
    if not existing.is_dir():
        raise ConfigError(f"{what} '{path}' lies inside the file '{existing}'; name a folder to write into")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} '{path}': '{existing}' is not writable by this user; name a folder you can write")


def output_folder(value: str, name: str) -> None:
    """A `check`: the argument names a folder to write into."""
    check_output_folder(Path(value), name)


def output_file(value: str, name: str) -> None:
    """A `check`: the argument names a file to write, in a folder that can be written."""
    check_output_folder(Path(value).parent, f"{name}'s folder")


def lora_file_name(name: str, what: str) -> None:
    """A `check`: `name` is a plain file name (no folder part; `--out` is the folder) ending in `.safetensors`."""
    example = f"my_lora{LORA_FILE_SUFFIX}"
    seps = {os.sep, os.altsep or os.sep, "/"}
    if name in ("", ".", "..") or "\0" in name or any(sep in name for sep in seps):
        raise ConfigError(f"{what} '{name}' is not a plain file name; give one such as {example} (--out is the folder)")
    if not name.endswith(LORA_FILE_SUFFIX) or name == LORA_FILE_SUFFIX:
        raise ConfigError(
            f"{what} '{name}' does not end in {LORA_FILE_SUFFIX}, the suffix diffusers reads a LoRA file by; "
            f"e.g. {example}"
        )
    if len(os.fsencode(name)) > _NAME_MAX:
        raise ConfigError(f"{what} is {len(os.fsencode(name))} bytes long; file names take at most {_NAME_MAX}")
