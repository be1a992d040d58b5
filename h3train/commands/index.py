"""`h3train index DIR`: rebuild a dataset folder's `index.jsonl` (and its compact index) from the headers of
the sample files it lists, one line per fix (`data.dataset_index.rebuild_index`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Parser

NAME = "index"
HELP = "rebuild a dataset's index.jsonl from its sample files' headers, keeping the lines you deleted out"

DESCRIPTION = (
    "Rewrite DIR/index.jsonl from the headers of the sample files it lists: a line whose sample id, task, "
    "seq_len, geometry or has_audio disagree with its file is rewritten, a line whose file does not exist or "
    "that lists a file again is dropped, one line each said. Only the files index.jsonl lists are read, so a "
    "sample file whose line you deleted stays out of training; to list every sample file under DIR again, "
    "move index.jsonl aside first (without one, every sample file is listed). The index replaced is kept "
    "beside it as index.jsonl.bak-<UTC time>; with nothing to fix nothing is written."
)


def add_arguments(parser: Parser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("dir", metavar="DIR", help="the dataset folder (data.path)")


def run(args: argparse.Namespace) -> int:
    from ..data.dataset_index import rebuild_index
    from ..data.location import INDEX_NAME

    done = rebuild_index(args.dir)
    index = Path(args.dir) / INDEX_NAME
    for fix in done.fixes:
        print(fix)
    if not done.fixes:
        print(f"{index}: its {len(done.entries)} lines agree with their sample files; nothing to fix")
    elif done.backup is None:
        print(f"wrote {index}: {len(done.entries)} samples")
    else:
        print(f"wrote {index}: {len(done.entries)} samples; the index it replaced is kept as {done.backup}")
    return 0
