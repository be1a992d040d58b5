"""`h3train export CHECKPOINT --out DIR`: a checkpoint as a diffusers transformer folder or a LoRA file."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Parser, lora_file_name, output_folder

NAME = "export"
HELP = "write a checkpoint as a diffusers transformer folder (a LoRA checkpoint as a LoRA file)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a run folder (logging.dir: its newest complete checkpoint) or a checkpoint folder (or its URL on "
        "object storage), e.g. runs/x/checkpoints/step_00001000",
    )
    parser.add_argument("--out", required=True, check=output_folder)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "bf16", "fp32"),
        help="dtype of the written weights",
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, above_zero=True, help="largest safetensors file, in GB"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out folder whole, once the new one is complete"
    )
    parser.add_argument(
        "--format",
        default=None,
        help="LoRA checkpoints: diffusers (default, pytorch_lora_weights.safetensors) or comfyui",
    )
    parser.add_argument(
        "--merge", action="store_true", help="LoRA checkpoints: a transformer folder, the adapters folded into the base"
    )
    parser.add_argument(
        "--base", type=Path, default=None, help="LoRA --merge: the pretrained base folder, if moved from where it was"
    )
    parser.add_argument(
        "--ema", action="store_true", help="write the EMA weights (train.ema.decay) in place of the trained"
    )
    parser.add_argument(
        "--name",
        default=None,
        check=lora_file_name,
        help="LoRA files: the file's name in --out, ending in .safetensors "
        "(default: pytorch_lora_weights.safetensors, lora_comfyui.safetensors with --format comfyui)",
    )


def run(args: argparse.Namespace) -> int:
    from ..export.transformer import checkpoint_to_export, export_checkpoint

    checkpoint, chosen = checkpoint_to_export(args.checkpoint)
    if chosen is not None:
        # Before the work: a full model's export takes minutes, and this says which step it is.
        print(f"exporting {checkpoint}: {chosen}", flush=True)
    summary = export_checkpoint(
        checkpoint,
        args.out,
        args.dtype,
        int(args.max_shard_gb * 1024**3),
        overwrite=args.overwrite,
        fmt=args.format,
        merge=args.merge,
        ema=args.ema,
        base=args.base,
        name=args.name,
    )
    print("\n".join(summary.lines()))
    return 0
