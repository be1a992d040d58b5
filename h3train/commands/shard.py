"""`h3train shard DIR --out OUT`: copy a dataset folder's samples into shards of a few GB, with an index that
names each sample's shard, offset and length (`data.shard_files.write_shards`)."""

from __future__ import annotations

import argparse

from .arguments import Parser

NAME = "shard"
HELP = "copy a dataset's samples into shard files of about --shard-gb each, for object storage"

DESCRIPTION = (
    "Write the samples DIR/index.jsonl lists, in its order and with their bytes unchanged, into shard files "
    "OUT/shards/shard-NNNNN.h3shard of at most --shard-gb GB each, and OUT/index.jsonl naming each sample's "
    "shard, offset and length: reading a sample is then one ranged read. Train from OUT as from DIR "
    "(data.path=OUT). Every sample's header is checked against its index line first; OUT must hold no "
    "dataset yet. DIR is left as it is."
)


def add_arguments(parser: Parser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("dir", metavar="DIR", help="the dataset folder to shard (its index.jsonl lists the samples)")
    parser.add_argument("--out", required=True, metavar="OUT", help="the folder to write the sharded dataset into")
    parser.add_argument(
        "--shard-gb", type=float, default=2.0, above_zero=True, help="largest shard, in GB (default 2; 1-4 is usual)"
    )


def run(args: argparse.Namespace) -> int:
    from ..data.shard_files import write_shards

    done = write_shards(args.dir, args.out, int(args.shard_gb * 1e9))
    print(
        f"wrote {len(done.shards)} shards, {done.bytes_written / 1e9:.2f} GB, of {len(done.entries)} samples "
        f"into {args.out} (index.jsonl beside them)"
    )
    return 0
