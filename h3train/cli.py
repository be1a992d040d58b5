"""`h3train` command line: train, check, config, export, generate, encode, synth, tiny-components, plot, bench.

A bad config or bad input exits 2 with one line on stderr, before any process group or model.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import thread as executor_threads
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .args import check_args
from .errors import H3TrainError, did_you_mean, did_you_mean_each
from .train.events import INTERRUPTS, Interrupts

if TYPE_CHECKING:
    from .config import Config
    from .train.trainer import Trainer


def _cmd_train(args: argparse.Namespace) -> int:
    from .run.preflight import load_checked

    cfg = load_checked(args.config, args.overrides)
    from .run.assemble import build_trainer

    try:
        trainer = build_trainer(cfg, overwrite=args.overwrite)
    except BaseException as exc:
        if not _INTERRUPTS.caused(exc):
            raise
        print("h3train: interrupted during start-up; nothing was trained", file=sys.stderr)
        return 130
    try:
        trainer.fit()
    except BaseException as exc:
        code = _fit_failed(trainer, cfg, exc)
        if code is None:
            # No barrier: the other ranks may be blocked in a collective this rank will never join.
            trainer.close(clean=False)
            raise
        return code
    try:
        trainer.close()
    except BaseException as exc:
        if not _INTERRUPTS.caused(exc):
            raise
        return _stop_at_once(trainer)
    # Ctrl-C exits as an interrupted program does; a preemption signal is a clean stop (exit 0); a
    # run stopped by validation.guard says so in its status.
    if trainer.guard_stop is not None:
        from .train.guard import GUARD_EXIT

        return GUARD_EXIT
    return 130 if trainer.interrupted else 0


def _fit_failed(trainer: Trainer, cfg: Config, exc: BaseException) -> int | None:
    """The exit code of a run that `exc` ended, its one line printed; None: `exc` is to be raised."""
    if _INTERRUPTS.caused(exc):
        return _stop_at_once(trainer)
    if isinstance(exc, H3TrainError):
        _report(exc)
        trainer.close(clean=False)
        return exc.exit_code
    if not isinstance(exc, RuntimeError) or not _is_collective_failure(exc):
        return None
    # A peer died or a collective timed out (parallel.timeout_s): say what this rank waited for.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(
        f"h3train: error: rank {trainer.ctx.rank}: collective failed during {trainer.phase} "
        f"(parallel.timeout_s={cfg.parallel.timeout_s}): {first}",
        file=sys.stderr,
        flush=True,
    )
    trainer.close(clean=False)
    return 1


def _stop_at_once(trainer: Trainer) -> int:
    """A second Ctrl-C (`KeyboardInterrupt`, or the error DCP made of it inside a save): one line, exit 130.

    No save commits after it and nothing waits for the background work (`_Interrupts.left_at_once`);
    a further Ctrl-C meanwhile is ignored, as the process is already on its way out.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        _INTERRUPTS.left_at_once = True
        line = trainer.stop_at_once()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"h3train: {line}", file=sys.stderr, flush=True)
        trainer.close(clean=False)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    return 130


# The last two are torch's under TORCH_DISTRIBUTED_DEBUG=DETAIL, whose groups check every collective.
_COLLECTIVE_FAILURE_MARKS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "timed out",
    "timeout",
    "failed to pass monitoredbarrier",
    "mismatch between collectives",
)


def _is_collective_failure(exc: RuntimeError) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or any(m in str(exc).lower() for m in _COLLECTIVE_FAILURE_MARKS)


def _cmd_check(args: argparse.Namespace) -> int:
    from .model.dims import planned_model_dims
    from .parallel.dims import ParallelDims
    from .run.preflight import load_checked, preflight

    cfg = load_checked(args.config, args.overrides, planning=not args.strict)

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg.parallel, world)
    # Without --strict, what is not on this machine is planned for and named, not required.
    notes = preflight(cfg, planning=not args.strict)
    print(f"config ok: {args.config}")
    for note in notes:
        print(f"assumed: {note}")
    print(dims.describe())
    if cfg.data.source == "cached" and not isinstance(cfg.data.path, str) and not notes:
        from .data.mixture import DatasetMixture
        from .data.source import build_source

        if isinstance(source := build_source(cfg), DatasetMixture):
            print(source.describe())
    from .plan import dropped_line, estimate, format_plan, refuse_over_plan

    per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "8"))
    plan = estimate(planned_model_dims(cfg)[0], dims, cfg, ranks_per_node=per_node)
    dropped = dropped_line(cfg)
    if dropped:
        print(dropped)
    print(format_plan(plan), flush=True)
    if args.rehearse:
        from .tools.rehearse import format_rehearsal, rehearse

        print(format_rehearsal(rehearse(cfg, world)))
    refuse_over_plan(plan, "cuda", cfg.train.ignore_memory_plan)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from .config import load_config
    from .tools.config_report import report

    # The values' checks only (`check` also reads the files the config names and plans the model):
    # a config for another machine prints here as it resolves.
    cfg = load_config(args.config, args.overrides)
    print(report(cfg, args.config, args.overrides), end="")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from .data.synth import write_synthetic_dataset

    out = write_synthetic_dataset(
        args.out, task=args.task, num_samples=args.num_samples, seed=args.seed, text_dim=args.text_dim
    )
    print(f"wrote {args.num_samples} {args.task} samples to {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .export.transformer import checkpoint_to_export, export_checkpoint

    checkpoint, chosen = checkpoint_to_export(Path(args.checkpoint))
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


def _cmd_generate(args: argparse.Namespace) -> int:
    from .errors import UsageError
    from .render.weights import default_components, default_shape, detect_source

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
    from .data.components import check_components_folder

    components = check_components_folder(components)
    from .run.generate import announce, default_device, generate, read_requests, request_partition

    flags = {"seed": args.seed, "frames": args.frames, "resolution": args.resolution}
    defaults = default_shape(source) if source is not None else {}
    defaults.update({k: v for k, v in flags.items() if v is not None})
    requests = read_requests(args.prompt or [], args.requests, defaults)
    partition = request_partition(source, requests)
    if not (components / partition).is_dir():
        raise UsageError(f"--components '{components}' has no {partition}/ folder, the partition SOURCE renders with")
    import torch

    device = torch.device(args.device) if args.device else default_device()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    ]
    if int(os.environ.get("RANK", "0")) == 0:
        print(announce(source, components, len(requests), args.steps, args.compare), flush=True)
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
        if not _INTERRUPTS.caused(exc):
            raise
        # Each file is written whole under a temporary name first: those listed so far are complete.
        print("h3train generate: interrupted; the files written so far are kept", file=sys.stderr)
        return 130
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .tools.plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0


def _cmd_encode(args: argparse.Namespace) -> int:
    from .data.components import encode_preset
    from .data.encode import EncodeSettings, Windowing, encode_manifest

    # A flag given wins; then the components folder's preset; then the released checkpoint's settings.
    flags = {
        "short_edge": args.short_edge,
        "max_pixels": args.max_pixels,
        "reference_short_edge": args.reference_short_edge,
        "min_seconds": args.min_seconds,
        "max_seconds": args.max_seconds,
    }
    preset = encode_preset(args.components) or {}
    settings = EncodeSettings(**{**preset, **{k: v for k, v in flags.items() if v is not None}})
    windowing = Windowing(args.windows, args.window_seconds, args.stride, args.max_windows)
    # Checked here too, before the settings line: a bad flag is the only line printed.
    settings.validate()
    windowing.validate(settings)
    if int(os.environ.get("RANK", "0")) == 0:
        given = [k for k, v in flags.items() if v is not None]
        origin = f"the preset of {args.components}" if preset else "the defaults"
        print(
            f"encode settings: short edge {settings.short_edge}, max pixels {settings.max_pixels}, "
            f"reference short edge {settings.reference_short_edge}, "
            f"{settings.min_seconds:g}-{settings.max_seconds:g} s "
            f"(from {origin}{', flags: ' + ', '.join(given) if given else ''}); {windowing.describe(settings)}",
            flush=True,
        )
    try:
        summary = encode_manifest(
            args.manifest,
            args.components,
            args.out,
            settings,
            device=args.device,
            progress=not args.no_progress,
            heldout=args.heldout,
            caption_prefix=args.caption_prefix,
            verbose=args.verbose,
            windowing=windowing,
        )
    except BaseException as exc:
        if not _INTERRUPTS.caused(exc):
            raise
        # The samples written so far are complete (atomic writes); a rerun skips them.
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"h3train encode: interrupted; the samples in {args.out} are kept, run again to go on",
                file=sys.stderr,
            )
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary.describe())
        for warning in summary.warnings():
            print(f"h3train encode: warning: {warning}", file=sys.stderr)
    return 0 if summary.ok else 1


def _cmd_tiny_components(args: argparse.Namespace) -> int:
    from .data.components import write_tiny_components

    print(f"wrote tiny random components to {write_tiny_components(args.dir, seed=args.seed)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.checks:
        from .tools.gpu_checks import bench_with_checks

        return bench_with_checks(args)
    from .tools.bench import bench_command

    return bench_command(args)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors name the nearest valid subcommand, choice or flag."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Python 3.14's own suggestions (`maybe you meant`) would repeat ours.
        self.suggest_on_error = False
        # Subcommand name -> its parser, once `build_parser` has added them.
        self.commands: dict[str, argparse.ArgumentParser] = {}

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


class _HelpFormatter(argparse.HelpFormatter):
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="h3train", description="Train MiniMax H3 with FSDP2 + Ulysses SP.", formatter_class=_HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices
    # A subcommand's parser does not take its parent's formatter.
    add_parser = functools.partial(sub.add_parser, formatter_class=_HelpFormatter)

    p = add_parser("train", help="train from a YAML config (alone or under torchrun)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.sp=2")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a folder that holds an earlier run, moving it into <logging.dir>/previous-<n>",
    )
    p.set_defaults(func=_cmd_train)

    p = add_parser("check", help="validate a config and its parallel plan; print memory per rank")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE or 1")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks on one node, for the host memory a node needs (default: $LOCAL_WORLD_SIZE or 8)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="also require what training needs here: the model folder and the dataset (launchers use it)",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="also build the run and take one step at --world-size on a fake process group with fake tensors "
        "(no GPU, no weights) and print its tracked memory beside the plan",
    )
    p.set_defaults(func=_cmd_check)

    p = add_parser(
        "config", help="print the resolved config as YAML, every default filled in, each value's source as a comment"
    )
    p.add_argument("config", help="a YAML config, e.g. configs/tiny_lora.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lora.rank=16")
    p.set_defaults(func=_cmd_config)

    p = add_parser("synth", help="write a synthetic cached dataset (tests and demos)")
    p.add_argument("--out", required=True)
    from .tasks.table import TRAINING_TASKS

    p.add_argument("--task", default="fl2va", choices=tuple(TRAINING_TASKS), help="a task.name: its sample tasks")
    p.add_argument("--num-samples", type=int, default=16, help="samples to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random latents and embeddings")
    p.add_argument("--text-dim", type=int, default=16, help="width of the prompt embeddings (the model's text_dim)")
    p.set_defaults(func=_cmd_synth)

    p = add_parser(
        "export", help="write a checkpoint as a diffusers transformer folder (a LoRA checkpoint as a LoRA file)"
    )
    p.add_argument(
        "checkpoint",
        help="a run folder (logging.dir: its newest complete checkpoint) or a checkpoint folder, "
        "e.g. runs/x/checkpoints/step_00001000",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "bf16", "fp32"),
        help="dtype of the written weights",
    )
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GB")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out folder whole, once the new one is complete"
    )
    p.add_argument(
        "--format",
        default=None,
        help="LoRA checkpoints: diffusers (default, pytorch_lora_weights.safetensors) or comfyui",
    )
    p.add_argument(
        "--merge", action="store_true", help="LoRA checkpoints: a transformer folder, the adapters folded into the base"
    )
    p.add_argument(
        "--base", type=Path, default=None, help="LoRA --merge: the pretrained base folder, if moved from where it was"
    )
    p.add_argument("--ema", action="store_true", help="write the EMA weights (train.ema.decay) in place of the trained")
    p.add_argument(
        "--name",
        default=None,
        help="LoRA files: the file's name in --out, ending in .safetensors "
        "(default: pytorch_lora_weights.safetensors, lora_comfyui.safetensors with --format comfyui)",
    )
    p.set_defaults(func=_cmd_export)

    p = add_parser(
        "generate",
        help="render prompts with a run, checkpoint, LoRA file or exported transformer (--compare: beside the base)",
    )
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="a run folder (logging.dir), a checkpoint folder, a LoRA file (diffusers or ComfyUI format) or a "
        "transformer folder from h3train export; omitted: the base of --components alone",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt to render as a t2va request; repeatable (by default none: then --requests)",
    )
    p.add_argument(
        "--requests",
        type=Path,
        default=None,
        help="a JSONL file, one request a line with the fields of validation.samples "
        "(id, prompt, task, keyframes, references, frames, resolution, seed)",
    )
    p.add_argument("--out", required=True, help="the .mp4 to write; several requests write <name>.<id>.mp4 beside it")
    p.add_argument(
        "--components",
        type=Path,
        default=None,
        help="the pipeline folder (vae, audio_vae, text_encoder, tokenizer, processor, transformer/); "
        "default for a run or checkpoint: its model.pretrained, else its validation.components",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also render the base, same seed and noise: one mp4, base left and fine-tune right, two audio "
        "streams; prints the guidance ratio and cosine",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of each request's generator (default 0)")
    p.add_argument("--steps", type=int, default=50, help="num_inference_steps: sigma points, the terminal 0 included")
    p.add_argument(
        "--frames", type=int, default=None, help="17 n + 5 at 24 fps (default: a run's first sample's, else 124)"
    )
    p.add_argument(
        "--resolution",
        default=None,
        help="WIDTHxHEIGHT, multiples of 32 (default: a run's first sample's, else 1344x768)",
    )
    p.add_argument(
        "--reference-short-edge",
        type=int,
        default=None,
        help="short edge of image references (default: the preset of --components, else 2048)",
    )
    p.add_argument("--device", default=None, help="default: cuda:$LOCAL_RANK if available, else cpu")
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on the CPU"
    )
    p.set_defaults(func=_cmd_generate)

    p = add_parser("plot", help="plot losses (smoothed), grad_norm and lr from metrics.jsonl to a PNG")
    p.add_argument("metrics")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_plot)

    p = add_parser(
        "encode", help="encode a folder of clips or a manifest into a cached dataset (alone or under torchrun)"
    )
    p.add_argument(
        "manifest",
        help="a folder of clips, each with a same-named .txt caption (t2va), or a JSONL manifest, one clip per "
        "line, for keyframes and references (see README: Encoding your data)",
    )
    p.add_argument("--components", required=True, help="folder with vae, audio_vae, text_encoder, tokenizer, processor")
    p.add_argument("--out", required=True, help="dataset folder (samples, index.jsonl, clips.tsv, errors.jsonl)")
    p.add_argument("--heldout", type=int, default=0, help="clips held out into the dataset OUT/heldout (seeded by id)")
    p.add_argument("--caption-prefix", default="", help="text put before every prompt, e.g. a trigger word")
    # Geometry flags default to the components folder's preset (a stand-in states its small canvas),
    # else to the released checkpoint's settings (`EncodeSettings`).
    preset = "default: the preset of --components, else"
    p.add_argument("--short-edge", type=int, default=None, help=f"canvas short edge, a multiple of 32 ({preset} 768)")
    p.add_argument("--max-pixels", type=int, default=None, help=f"canvas area cap ({preset} 768*1344)")
    p.add_argument(
        "--reference-short-edge", type=int, default=None, help=f"short edge of image references ({preset} 2048)"
    )
    p.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="shorter clips are rejected, rounded down to the 17 n + 5 frame rule at 24 fps "
        f"({preset} 5: a 4.46 s clip is kept)",
    )
    p.add_argument("--max-seconds", type=float, default=None, help=f"longer clips are cut ({preset} 15)")
    p.add_argument(
        "--windows",
        default="first",
        metavar="{first,uniform,slide}",
        help="which spans of a clip become samples: first (its first window), uniform (windows spread evenly "
        "over it), slide (a window every --stride seconds)",
    )
    p.add_argument(
        "--window-seconds",
        type=float,
        default=None,
        help="a window's length, cut to the 17 n + 5 frame rule (default: the longest --max-seconds allows)",
    )
    p.add_argument(
        "--stride", type=float, default=None, help="seconds between slide windows' starts (default: back to back)"
    )
    p.add_argument("--max-windows", type=int, default=None, help="windows per clip at most (default: as many as fit)")
    p.add_argument("--device", default=None, help="default: cuda:$LOCAL_RANK if available, else cpu")
    p.add_argument("--verbose", action="store_true", help="print each clip's line of clips.tsv")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_encode)

    p = add_parser(
        "tiny-components",
        help="write a tiny random MiniMax-H3 pipeline folder (encoders, transformers, schedulers, an encode preset)",
    )
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (the same seed, the same folder)")
    p.set_defaults(func=_cmd_tiny_components)

    p = add_parser(
        "bench", help="the trainer's step per attention backend: forward_backward and update times, MFU, grad parity"
    )
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; 2 when reduced)")
    p.add_argument("--out", default=None, help="write every figure to this JSON file")
    p.add_argument("--reduced", action="store_true", help="tiny widths and a short clip (always on CPU)")
    p.add_argument("--backends", default=None, help="comma list of flash, cudnn, native, math (default: available)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak for MFU (default: by device name)")
    p.add_argument(
        "--gradient-checkpointing",
        default="auto",
        choices=("auto", "on", "off"),
        help="auto: on when the step would not fit the device without it",
    )
    p.add_argument("--parity-tol", type=float, default=None, help="default 2e-2 in bf16, 1e-4 in float32")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed steps after a warm-up step, medians reported (default 3)"
    )
    p.add_argument("--frames", type=int, default=None, help="17 n + 5 (default 124; 22 when reduced)")
    p.add_argument("--height", type=int, default=None, help="pixels, multiple of 32 (default 768)")
    p.add_argument("--width", type=int, default=None, help="pixels, multiple of 32 (default 1344)")
    p.add_argument("--text-len", type=int, default=None, help="text prefix rows (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample and the training noise")
    p.add_argument(
        "--checks",
        action="store_true",
        help="then the trainer checks of h3train/tools/gpu_checks.py (gradient averaging, low-bit optimizers, "
        "quantized LoRA bases, async save, one block's memory against the rehearsal), in the same JSON "
        "(scripts/gpu_check.sh)",
    )
    p.set_defaults(func=_cmd_bench)
    return parser


class _Interrupts:
    """Ctrl-C raises `KeyboardInterrupt`, as Python's default handler does, and is noted in the process's
    interrupt record (`train.events.INTERRUPTS`), which the trainer's handler notes a second Ctrl-C in too.

    A library may turn the interrupt into another error: torch, building a tensor from a buffer
    when the interrupt lands, raises `ValueError("could not determine the shape of object type
    'torch.storage.UntypedStorage'")`, which a safetensors load then reports as an unreadable file.
    An error that follows a Ctrl-C is the Ctrl-C's (`caused`), so the user sees the interrupt, not a
    damaged components folder.
    """

    def __init__(self, record: Interrupts) -> None:
        self.record = record
        # A second Ctrl-C stopped a run (`_stop_at_once`): `run()` leaves without waiting for its
        # background threads (a checkpoint write, a deletion), whose `.tmp-*` folders the next start removes.
        self.left_at_once = False

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.record.note()
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def watching(self):
        """Note Ctrl-C while the body runs, where Python's own handler is the one in place."""
        self.record.noted = self.left_at_once = False
        ours = threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        previous = signal.signal(signal.SIGINT, self._handle) if ours else None
        try:
            yield self
        finally:
            if ours:
                signal.signal(signal.SIGINT, previous)

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc` is an interrupt, or an error raised after one (the interrupt, disguised)."""
        return self.record.caused(exc)


_INTERRUPTS = _Interrupts(INTERRUPTS)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`check CONFIG --world-size 8 parallel.sp=4`): argparse leaves
    # such trailing `key=value` items unparsed, so they are appended to the overrides here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in item and not item.startswith("-") for item in extra):
            parser.unrecognized(extra, getattr(args, "command", None))
        args.overrides = [*args.overrides, *extra]
    try:
        with _INTERRUPTS.watching():
            check_args(args)
            return args.func(args)
    except H3TrainError as exc:
        _report(exc)
        return exc.exit_code
    except BaseException as exc:
        # A write that ran out of space anywhere (a metrics line, an export shard, an encoded clip):
        # one line naming where, not a traceback. Checkpoint saves say more (`Checkpointer`).
        from .infra.diskspace import full_disk_line, no_space

        full = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else no_space(exc)
        if full is None:
            raise
        print(f"h3train: error: {full_disk_line(full)}", file=sys.stderr)
        return 1


def _report(exc: H3TrainError) -> None:
    """Print `exc` as one line where this rank speaks for it (`_reports_errors`).

    An error the ranks reached together (`exc.agreed`) is printed by rank 0 before any rank leaves:
    torchrun stops the ranks left as soon as one exits, which would cut rank 0 off before its line.
    """
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    if _reports_errors(exc):
        line = f"h3train: error: {exc}"
        print(line, file=sys.stderr, flush=True)
        _repeat_after_launcher(line)
    elif not grouped:
        # A silent rank before the process group: its node's first rank meets the same error and
        # prints it. Leaving at once could let torchrun stop that rank before its line (a loaded
        # node starts ranks seconds apart); the speaking rank's exit ends this wait.
        time.sleep(_SILENT_RANK_GRACE_S)
    if exc.agreed and grouped:
        # Leaving anyway if the barrier fails: the line above is what matters.
        with contextlib.suppress(Exception):
            dist.barrier()


# How long a rank that does not print a start-up error waits before it exits.
_SILENT_RANK_GRACE_S = 10.0

# How long the repeated line waits for torchrun to exit: it stops the other ranks (30 s at most) and
# reports; one still running after this is stuck elsewhere (another node), and the line is dropped.
_REPEAT_WAIT_S = 120.0

# Run by `_repeat_after_launcher` as `python -c _REPEAT PID LINE SECONDS`: LINE on stderr once the
# process PID is gone (or a zombie: a parent that reads this process's output reaps it only then).
_REPEAT = """
import sys, time
pid, line, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])

def running():
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(") ")[2][:1] not in ("Z", "X")
    except OSError:
        return False

while running() and time.monotonic() < deadline:
    time.sleep(0.05)
if not running():
    print(line, file=sys.stderr, flush=True)
"""


def _repeat_after_launcher(line: str) -> None:
    """Print `line` again once torchrun, this rank's parent, has exited, so that it is the last line.

    torchrun ends a failed run with its own report and a traceback of its own (about 40 lines): a
    tailed log would show `ChildFailedError` and not why. A process of its own (a session apart, so
    that torchrun's signals to the ranks miss it) waits for torchrun and repeats the line after
    the report. Only under torchrun (`TORCHELASTIC_RUN_ID`), in its last attempt: with restarts
    left it starts the ranks again, and a line repeated at its end would follow a later attempt's
    output (a run that then succeeded). On a system without `/proc` the line is repeated at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if restarts_left > 0:
        return
    import subprocess

    with contextlib.suppress(OSError):
        subprocess.Popen(
            [sys.executable, "-c", _REPEAT, str(os.getppid()), line, str(_REPEAT_WAIT_S)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )


def _reports_errors(exc: H3TrainError) -> bool:
    """Whether this process prints an `H3TrainError`, so that torchrun shows a bad input once, not once per rank.

    An error raised before the process group exists comes from the config, the command line or
    files, which the ranks of one node see alike: the node's first rank (`LOCAL_RANK` 0; rank 0
    on a single node) prints it, the others exit with the same code in silence. One rank per node
    speaks, because another node may lack a file this one has. After the process group exists an
    error may be this rank's alone (it cannot see the checkpoint rank 0 chose), so every rank prints,
    unless the ranks reached it together (`exc.agreed`): then rank 0 alone does.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or (int(os.environ.get("LOCAL_RANK", "0")) == 0 and not exc.agreed):
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized()) and not exc.agreed


def run() -> NoReturn:
    """The `h3train` command: `main()`, then, after a process group, an exit that skips the
    interpreter's final teardown.

    When the interpreter finalizes, a gloo worker thread may still be releasing the tensors of the
    run's last collective; it needs the GIL for that, a finalizing interpreter ends such a thread
    inside a C++ destructor, and the process aborts (SIGABRT, or SIGSEGV) after a run that
    succeeded. So everything the run owns is finished first, while the interpreter is whole (the
    threads that are not daemons joined, `atexit` handlers run, the standard streams flushed), and
    the process then leaves with `os._exit` and `main()`'s code; an uncaught exception is printed
    as the interpreter prints it and exits 1. A process that never joined a group (a bad input
    found first, `check`, `export`) exits the ordinary way. A run stopped by a second Ctrl-C
    (`_Interrupts.left_at_once`) joins no thread: it stops at once, a write in progress with it.
    """

    def joined_process_group() -> bool:
        # Not imported means no group: `init_distributed` lives there.
        dims = sys.modules.get(f"{__package__}.parallel.dims")
        return dims is not None and dims.joined_process_group()

    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        if not joined_process_group():
            raise
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        if not joined_process_group():
            raise
        traceback.print_exc()
        code = 1
    if not joined_process_group():
        sys.exit(code)
    if _INTERRUPTS.left_at_once:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Thread-pool workers (inductor's compile pool, for one) stop only when their executors are told
    # to, which interpreter shutdown does after this join; joining them first would wait forever.
    stop_executors = getattr(executor_threads, "_python_exit", None)
    if callable(stop_executors):
        stop_executors()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
