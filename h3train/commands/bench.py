"""`h3train bench`: the trainer's step per attention backend (forward_backward and update times, MFU,
gradient parity); `--checks` then runs the trainer checks of `tools/gpu_checks.py`."""

from __future__ import annotations

import argparse

from ..config import SEED_MAX
from .arguments import Parser, output_file

NAME = "bench"
HELP = "the trainer's step per attention backend: forward_backward and update times, MFU, grad parity"


def add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "--layers", type=int, default=None, at_least=1, help="transformer blocks (default 4; 2 when reduced)"
    )
    parser.add_argument("--out", default=None, check=output_file, help="write every figure to this JSON file")
    parser.add_argument("--reduced", action="store_true", help="tiny widths and a short clip (always on CPU)")
    parser.add_argument(
        "--backends", default=None, help="comma list of flash, cudnn, native, math (default: available)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        above_zero=True,
        help="bf16 peak for MFU (default: by device name)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        default="auto",
        choices=("auto", "on", "selective", "off"),
        help="what each block recomputes: auto (the memory plan's least recompute that fits the device), "
        "on (full), selective (keeps the attention output), off",
    )
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="print (and with --out write) the plan of the case a GPU would run, full width in bf16, without "
        "building the model; runs anywhere",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        above_zero=True,
        help="the device --plan-only plans for (default 80)",
    )
    parser.add_argument(
        "--parity-tol",
        type=float,
        default=None,
        at_least=0,
        help="the gate on each backend's gradient error against a float32 step, in units of native's (default 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        at_least=1,
        help="timed steps after a warm-up step, medians reported (default 3)",
    )
    parser.add_argument("--frames", type=int, default=None, at_least=1, help="17 n + 5 (default 124; 22 when reduced)")
    parser.add_argument("--height", type=int, default=None, at_least=32, help="pixels, multiple of 32 (default 768)")
    parser.add_argument("--width", type=int, default=None, at_least=32, help="pixels, multiple of 32 (default 1344)")
    parser.add_argument("--text-len", type=int, default=None, at_least=1, help="text prefix rows (default 2048)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        at_least=0,
        at_most=SEED_MAX,
        help="seed of the sample and the training noise",
    )
    parser.add_argument(
        "--checks",
        action="store_true",
        help="then the trainer checks of h3train/tools/gpu_checks.py (gradient averaging, low-bit optimizers, "
        "quantized LoRA bases, async save, one block's memory against the rehearsal), in the same JSON "
        "(scripts/gpu_check.sh)",
    )


def run(args: argparse.Namespace) -> int:
    if args.checks:
        from ..tools.gpu_checks import bench_with_checks

        return bench_with_checks(args)
    from ..tools.bench import bench_command

    return bench_command(args)
