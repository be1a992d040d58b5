"""`h3train encode MANIFEST --components DIR --out DIR [--shards TARGET]`: clips into a cached dataset, alone or
under torchrun, and with `--shards` into shards at a folder or URL too (`data/shard_files.py`).

Exit codes: 0 at least one sample of the manifest is in the dataset; 1 none is (the reasons in
errors.jsonl); 130 Ctrl-C, the samples written so far kept for a rerun to go on from.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .arguments import Parser, output_folder
from .process import CTRL_C

NAME = "encode"
HELP = "encode a folder of clips or a manifest into a cached dataset (alone or under torchrun)"


def add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "manifest",
        help="a folder of clips, each with a same-named .txt caption (t2va), or a JSONL manifest, one clip per "
        "line, for keyframes and references (see README: Encoding your data)",
    )
    parser.add_argument(
        "--components", required=True, help="folder with vae, audio_vae, text_encoder, tokenizer, processor"
    )
    parser.add_argument(
        "--out",
        required=True,
        check=output_folder,
        help="dataset folder (samples, index.jsonl, clips.tsv, errors.jsonl)",
    )
    parser.add_argument(
        "--heldout",
        type=int,
        default=0,
        at_least=0,
        help="clips held out into the dataset OUT/heldout (seeded by id)",
    )
    parser.add_argument("--caption-prefix", default="", help="text put before every prompt, e.g. a trigger word")
    # Geometry flags default to the components folder's preset (a stand-in states its small canvas),
    # else to the released checkpoint's settings (`EncodeSettings`).
    preset = "default: the preset of --components, else"
    parser.add_argument(
        "--short-edge",
        type=int,
        default=None,
        at_least=32,
        help=f"canvas short edge, a multiple of 32 ({preset} 768)",
    )
    parser.add_argument(
        "--max-pixels", type=int, default=None, at_least=32 * 32, help=f"canvas area cap ({preset} 768*1344)"
    )
    parser.add_argument(
        "--reference-short-edge",
        type=int,
        default=None,
        at_least=32,
        help=f"short edge of image references ({preset} 2048)",
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        at_least=0,
        help="shorter clips are rejected, rounded down to the 17 n + 5 frame rule at 24 fps "
        f"({preset} 5: a 4.46 s clip is kept)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        at_least=0,
        above_zero=True,
        help=f"longer clips are cut ({preset} 15)",
    )
    parser.add_argument(
        "--windows",
        default="first",
        metavar="{first,uniform,slide}",
        help="which spans of a clip become samples: first (its first window), uniform (windows spread evenly "
        "over it), slide (a window every --stride seconds)",
    )
    parser.add_argument(
        "--window-seconds",
        type=float,
        default=None,
        at_least=0,
        above_zero=True,
        help="a window's length, cut to the 17 n + 5 frame rule (default: the longest --max-seconds allows)",
    )
    parser.add_argument(
        "--stride",
        type=float,
        default=None,
        at_least=0,
        above_zero=True,
        help="seconds between slide windows' starts (default: back to back)",
    )
    parser.add_argument(
        "--max-windows", type=int, default=None, at_least=1, help="windows per clip at most (default: as many as fit)"
    )
    parser.add_argument(
        "--shards",
        default=None,
        metavar="TARGET",
        help="when the encoding is done, copy the dataset into shard files at TARGET too, a folder or a URL "
        "(s3://bucket/prefix), its held-out split into TARGET/heldout: see 'h3train shard'",
    )
    parser.add_argument(
        "--shard-gb", type=float, default=2.0, above_zero=True, help="largest shard, in GB (default 2; 1-4 is usual)"
    )
    parser.add_argument("--device", default=None, help="default: cuda:$LOCAL_RANK if available, else cpu")
    parser.add_argument("--verbose", action="store_true", help="print each clip's line of clips.tsv")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..data.components import encode_preset
    from ..encode import EncodeSettings, Windowing, encode_manifest

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
    # A canvas flag against the preset's other bound: say where that bound comes from and how to change it.
    area = settings.short_edge * settings.short_edge
    if preset and args.max_pixels is None and "max_pixels" in preset and settings.max_pixels < area:
        from ..data.components import ENCODE_PRESET_FILE
        from ..errors import ConfigError

        raise ConfigError(
            f"--short-edge {settings.short_edge} needs a canvas of at least {area} pixels, but max pixels "
            f"{settings.max_pixels} comes from the preset of {args.components} ({ENCODE_PRESET_FILE}); "
            f"pass --max-pixels {area} or more too"
        )
    # Checked here too, before the settings line: a bad flag is the only line printed.
    settings.validate()
    windowing.validate(settings)
    if args.shards is not None:
        _check_shard_targets(args.shards, args.out)
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
        if not CTRL_C.caused(exc):
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
        if args.shards is not None and summary.ok:
            _write_shard_copies(args.out, args.shards, int(args.shard_gb * 1e9))
    return 0 if summary.ok else 1


def _split_pairs(out: str, target: str) -> list[tuple[Path, str]]:
    """(dataset folder, its shard target) of the encoded dataset and of its held-out split."""
    from ..encode.manifest_run import HELDOUT_NAME

    return [(Path(out), target), (Path(out) / HELDOUT_NAME, f"{target.rstrip('/')}/{HELDOUT_NAME}")]


def _check_shard_targets(target: str, out: str) -> None:
    """Before any encoding: `--shards` holds no dataset yet and lies outside `--out` (one line naming it)."""
    from ..data.shard_files import check_shard_target
    from ..data.storage import is_url
    from ..errors import ConfigError

    if not is_url(target):
        inside, above = Path(target).resolve(), Path(out).resolve()
        if inside == above or above in inside.parents:
            raise ConfigError(f"--shards '{target}' lies inside --out '{out}'; give a folder or a URL outside it")
    for _, split_target in _split_pairs(out, target):
        check_shard_target(split_target)


def _write_shard_copies(out: str, target: str, shard_bytes: int) -> None:
    """Rank 0, once every rank has written its samples: the dataset and its held-out split into shards."""
    from ..data.location import INDEX_NAME
    from ..data.shard_files import write_shards

    for folder, split_target in _split_pairs(out, target):
        if (folder / INDEX_NAME).is_file():
            done = write_shards(folder, split_target, shard_bytes)
            print(
                f"h3train encode: {len(done.entries)} samples of {folder} copied into {len(done.shards)} shards, "
                f"{done.bytes_written / 1e9:.2f} GB, at {split_target}"
            )
