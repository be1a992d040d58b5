"""`h3train generate [SOURCE] --out FILE.mp4`: render prompts with a run, checkpoint, LoRA file or exported
transformer, or with the base alone; `--compare` renders the base beside SOURCE."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import SEED_MAX
from .arguments import Parser
from .process import CTRL_C

NAME = "generate"
HELP = "render prompts with a run, checkpoint, LoRA file or exported transformer (--compare: beside the base)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "source",
        nargs="?",
        default=None,
        help="a run folder (logging.dir), a checkpoint folder, a LoRA file (diffusers or ComfyUI format) or a "
        "transformer folder from h3train export; omitted: the base of --components alone",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt to render as a t2va request; repeatable (by default none: then --requests)",
    )
    parser.add_argument(
        "--requests",
        type=Path,
        default=None,
        help="a JSONL file, one request a line with the fields of validation.samples "
        "(id, prompt, task, keyframes, references, frames, resolution, seed)",
    )
    parser.add_argument(
        "--out", required=True, help="the .mp4 to write; several requests write <name>.<id>.mp4 beside it"
    )
    parser.add_argument(
        "--components",
        type=Path,
        default=None,
        help="the pipeline folder (vae, audio_vae, text_encoder, tokenizer, processor, transformer/); "
        "default for a run or checkpoint: its model.pretrained, else its validation.components",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also render the base, same seed and noise: one mp4, base left and fine-tune right, two audio "
        "streams; prints the guidance ratio and cosine",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        at_least=0,
        at_most=SEED_MAX,
        help="seed of each request's generator (default 0)",
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="num_inference_steps: sigma points, the terminal 0 included"
    )
    parser.add_argument(
        "--frames",
        type=int,
        default=None,
        at_least=1,
        help="17 n + 5 at 24 fps (default: a run's first validation sample's, else its training data's, else 124)",
    )
    parser.add_argument(
        "--resolution",
        default=None,
        help="WIDTHxHEIGHT, multiples of 32 (default: a run's first validation sample's, else its training "
        "canvas, else 1344x768)",
    )
    parser.add_argument(
        "--reference-short-edge",
        type=int,
        default=None,
        at_least=32,
        help="short edge of image references (default: the preset of --components, else 2048)",
    )
    parser.add_argument("--device", default=None, help="default: cuda:$LOCAL_RANK if available, else cpu")
    parser.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on the CPU"
    )


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..render.weights import default_components, default_shape, detect_source

    # Every check is on names and files, before a model loads.
    source = detect_source(args.source) if args.source is not None else None
    if args.compare and source is None:
        raise UsageError("--compare renders SOURCE beside its base; give a SOURCE, or drop --compare")
    if bool(args.prompt) == (args.requests is not None):
        raise UsageError("give the requests as --prompt TEXT (repeatable) or as --requests FILE.jsonl, one of the two")
    out = Path(args.out)
    if out.suffix != ".mp4" or out.is_dir():
        raise UsageError(f"--out '{out}' must name an .mp4 file (several requests write <name>.<id>.mp4 beside it)")
    if args.steps < 2:
        raise UsageError(f"--steps must be >= 2 (sigma grid points, the terminal 0 included), got {args.steps}")
    components = args.components or (default_components(source) if source is not None else None)
    if components is None:
        said = "" if source is None else f"; SOURCE '{source.path}' names no components folder in its config"
        raise UsageError(f"--components DIR: the pipeline folder to render with is not given{said}")
    from ..data.components import check_components_folder

    components = check_components_folder(components)
    from ..run.rendering import RELEASED_SHAPE, announce, default_device, generate, read_requests, request_partition

    flags = {"seed": args.seed, "frames": args.frames, "resolution": args.resolution}
    shape = default_shape(source) if source is not None else None
    defaults = dict(shape.values) if shape is not None else {}
    defaults.update({k: v for k, v in flags.items() if v is not None})
    requests = read_requests(args.prompt or [], args.requests, defaults)
    # Where the shape of a request that sets neither came from; flags and request lines win over it.
    unset = args.frames is None or args.resolution is None
    origin = (shape.origin if shape is not None and shape.values else RELEASED_SHAPE) if unset else ""
    partition = request_partition(source, requests)
    if not (components / partition).is_dir():
        raise UsageError(f"--components '{components}' has no {partition}/ folder, the partition SOURCE renders with")
    import torch

    device = torch.device(args.device) if args.device else default_device()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    ]
    if int(os.environ.get("RANK", "0")) == 0:
        print(announce(source, components, requests, args.steps, args.compare, origin), flush=True)
    try:
        generate(
            source,
            components,
            requests,
            out,
            steps=args.steps,
            compare=args.compare,
            device=device,
            dtype=dtype,
            reference_short_edge=args.reference_short_edge,
        )
    except BaseException as exc:
        if not CTRL_C.caused(exc):
            raise
        # Each file is written whole under a temporary name first: those listed so far are complete.
        print("h3train generate: interrupted; the files written so far are kept", file=sys.stderr)
        return 130
    return 0
