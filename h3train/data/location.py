"""Where a dataset's bytes lie: the names of its files, a sample's place (its own file, or its bytes in a
shard), and a shard's header, which lists its samples.

A shard (`.h3shard`, written by `data/shard_files.py`) holds many samples back to back, each the unchanged
bytes of its sample file. Its layout (little-endian):

    bytes 0-7      magic `H3SHARD\\n`
    bytes 8-15     uint64: length of the JSON header that follows
    JSON header    {"format": "h3train-shard", "version", "samples": [{"id", "offset", "length"}, ...],
                   "inputs": {sample id: its encoder's inputs record}, for the samples that have one}
    samples        each sample's bytes at its offset (from the start of the file), in index order
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SampleError

if TYPE_CHECKING:
    from .storage import RemoteStore

INDEX_NAME = "index.jsonl"
SAMPLE_SUFFIX = ".safetensors"
# What the encoder records of a sample's inputs and settings, beside its file.
INPUTS_SUFFIX = ".inputs.json"
SHARD_SUFFIX = ".h3shard"
_MAGIC = b"H3SHARD\n"
_FORMAT = "h3train-shard"
_VERSION = 1
_MAX_SHARD_HEADER = 1 << 30


@dataclass(frozen=True)
class ShardHeader:
    """A shard's header: each sample's (id, offset, length) in file order, and the encoder's inputs record
    (the digest of its settings, its clip's length) of each sample that has one, by sample id."""

    samples: tuple[tuple[str, int, int], ...]
    inputs: dict[str, Any]


def read_shard_header(path: Path) -> ShardHeader:
    """The header of the shard at `path`. Raises `SampleError` naming the shard when it is not one."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(_MAGIC) + 8)
            if len(head) < len(_MAGIC) + 8 or head[: len(_MAGIC)] != _MAGIC:
                raise SampleError(f"shard '{path}': not an h3train shard (no {_MAGIC!r} at its start)")
            length = int.from_bytes(head[len(_MAGIC) :], "little")
            if length > _MAX_SHARD_HEADER:
                raise SampleError(f"shard '{path}': its header claims {length:,} bytes; the shard is damaged")
            text = handle.read(length)
    except OSError as exc:
        raise SampleError(f"shard '{path}': cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(text)
        if header.get("format") != _FORMAT or header.get("version") != _VERSION:
            raise ValueError(f"format {header.get('format')!r} version {header.get('version')!r}")
        samples = tuple((str(s["id"]), int(s["offset"]), int(s["length"])) for s in header["samples"])
        inputs = dict(header.get("inputs", {}))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SampleError(f"shard '{path}': its header is not readable ({exc}); the shard is damaged") from None
    return ShardHeader(samples, inputs)


def shard_samples(path: Path) -> list[SampleLocation]:
    """Where each sample of the shard at `path` lies, in file order (from its header alone)."""
    return [SampleLocation(path, offset, length) for _, offset, length in read_shard_header(path).samples]


def shard_header_bytes(samples: list[tuple[str, int, int]], inputs: dict[str, Any]) -> bytes:
    """The bytes a shard starts with: its magic, its header's length and the header listing `samples`
    (id, offset, length) and the encoder's `inputs` records."""
    header = {"format": _FORMAT, "version": _VERSION, "samples": [], "inputs": inputs}
    header["samples"] = [{"id": i, "offset": o, "length": n} for i, o, n in samples]
    text = json.dumps(header, sort_keys=True).encode()
    return _MAGIC + len(text).to_bytes(8, "little") + text


@dataclass(frozen=True)
class SampleLocation:
    """Where a sample's bytes lie: the whole of the file `path` (`length` -1), or the `length` bytes of a
    shard (`data/shard_files.py`) from byte `offset`, the bytes the sample's own file would hold. With a
    `store` (a dataset on object storage, `data/storage.py`) `path` is the object's path in the dataset."""

    path: Path
    offset: int = 0
    length: int = -1
    store: RemoteStore | None = field(default=None, compare=False)

    def __str__(self) -> str:
        name = str(self.path) if self.store is None else self.store.name(self.path.as_posix())
        return name if self.length < 0 else f"{name}, bytes {self.offset}-{self.offset + self.length}"
