"""`h3train synth --out DIR`: a synthetic cached dataset, for tests, demos and a first run on a new cluster."""

from __future__ import annotations

import argparse

from ..config import SEED_MAX
from ..tasks.table import TRAINING_TASKS
from .arguments import Parser, output_folder

NAME = "synth"
HELP = "write a synthetic cached dataset (tests, demos, a new cluster's first run)"
DEFAULT_TASK = "fl2va"
DEFAULT_TEXT_DIM = 16


def add_arguments(parser: Parser) -> None:
    parser.add_argument("--out", required=True, check=output_folder)
    parser.add_argument(
        "--config",
        default=None,
        help="a training config: samples of its task.name, each the longest released clip (15 s at 768x1344, "
        "as its plan assumes), prompt embeddings as wide as its model's text_dim",
    )
    parser.add_argument(
        "--task",
        default=None,
        choices=tuple(TRAINING_TASKS),
        help=f"a task.name: its sample tasks (default: {DEFAULT_TASK}; with --config, its task.name)",
    )
    parser.add_argument("--num-samples", type=int, default=16, at_least=1, help="samples to write")
    parser.add_argument(
        "--seed", type=int, default=0, at_least=0, at_most=SEED_MAX, help="seed of the random latents and embeddings"
    )
    parser.add_argument(
        "--text-dim",
        type=int,
        default=None,
        at_least=1,
        help=f"width of the prompt embeddings, the model's text_dim (default: {DEFAULT_TEXT_DIM}; with --config, "
        "its model's)",
    )


def run(args: argparse.Namespace) -> int:
    from ..data.synthetic_dataset import write_synthetic_dataset

    task, text_dim = args.task or DEFAULT_TASK, args.text_dim or DEFAULT_TEXT_DIM
    if args.config is not None:
        task, text_dim = _from_config(args)
    out = write_synthetic_dataset(
        args.out,
        task=task,
        num_samples=args.num_samples,
        seed=args.seed,
        text_dim=text_dim,
        released=args.config is not None,
    )
    size = "the longest released clip" if args.config is not None else "tiny"
    print(f"wrote {args.num_samples} {task} samples ({size}, text_dim {text_dim}) to {out}")
    return 0


def _from_config(args: argparse.Namespace) -> tuple[str, int]:
    """The task and text width of `--config`: its `task.name`, and the `text_dim` of its model folder's
    config.json or, where that is not readable here, of the released transformer (as `h3train check`
    plans). A `--task` or `--text-dim` that differs would write data the config refuses."""
    from ..config import load_config
    from ..errors import ConfigError
    from ..model.architecture import planned_model_dims

    cfg = load_config(args.config, [])
    dims, note = planned_model_dims(cfg)
    task, text_dim = cfg.task.name, int(dims["text_dim"])
    for flag, given, wanted in (("--task", args.task, task), ("--text-dim", args.text_dim, text_dim)):
        if given is not None and given != wanted:
            raise ConfigError(f"{flag} is {given} but --config '{args.config}' gives {wanted}; leave {flag} out")
    if note:
        print(f"assumed: {note}")
    return task, text_dim
