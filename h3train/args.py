"""Command-line values of every `h3train` command, checked once they are parsed, before any work.

Each failure is one `ConfigError` line naming the flag, what it holds and what it takes (exit 2);
the config's own keys are `config.validate`'s. Only the standard library, `config` and `infra.diskspace` are imported:
a bad flag costs no torch import.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .config import SEED_MAX
from .errors import ConfigError
from .infra.diskspace import nearest_existing

# flag -> (smallest, largest) it takes; None: unbounded above. Only flags a command defines are read.
_RANGES: dict[str, tuple[float, float | None]] = {
    "world_size": (1, None),
    "gpus_per_node": (1, None),
    "num_samples": (1, None),
    "text_dim": (1, None),
    "seed": (0, SEED_MAX),
    "short_edge": (32, None),
    "max_pixels": (32 * 32, None),
    "reference_short_edge": (32, None),
    "min_seconds": (0, None),
    "max_seconds": (0, None),
    "layers": (1, None),
    "repeats": (1, None),
    "frames": (1, None),
    "height": (32, None),
    "width": (32, None),
    "text_len": (1, None),
    "parity_tol": (0, None),
    "heldout": (0, None),
    "window_seconds": (0, None),
    "stride": (0, None),
    "max_windows": (1, None),
}
# Flags that must be above zero, not just at least it.
_POSITIVE = ("max_shard_gb", "peak_tflops", "max_seconds", "window_seconds", "stride")
# Pseudo-filesystems: nothing written there is a file anyone can read back (`/dev/shm` is memory, a disk).
_NOT_A_DISK = ("/proc", "/sys", "/dev")
_SHARED_MEMORY = Path("/dev/shm")


def check_args(args: argparse.Namespace) -> None:
    """Every number of `args` finite and in range, every output path writable; `ConfigError` on the first not."""
    for name, value in vars(args).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(value):
            raise ConfigError(f"{flag} is {value}; it takes a finite number")
        low, high = _RANGES.get(name, (-math.inf, None))
        if value < low or (high is not None and value > high) or (name in _POSITIVE and value <= 0):
            bound = f"in [{low}, {high}]" if high is not None else (f"> {low}" if name in _POSITIVE else f">= {low}")
            raise ConfigError(f"{flag} is {value}; it takes a value {bound}")
    command = getattr(args, "command", None)
    if command == "export" and args.name is not None:
        check_lora_file_name(args.name, "--name")
    if command in ("synth", "export", "encode"):
        check_output_folder(Path(args.out), "--out")
    elif command == "tiny-components":
        check_output_folder(Path(args.dir), "DIR")
    elif command in ("plot", "bench") and args.out is not None:
        check_output_folder(Path(args.out).parent, "--out's folder")


# diffusers reads a LoRA file as safetensors only by this suffix (any other it unpickles).
LORA_FILE_SUFFIX = ".safetensors"
# The longest file name the common file systems take, in bytes.
_NAME_MAX = 255


def check_lora_file_name(name: str, what: str) -> None:
    """`name` is a plain file name (no folder part; `--out` is the folder) ending in `.safetensors`."""
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
