"""Content digests of what h3train writes and later trusts: cached samples' tensors, checkpoint files.

XXH3-128 (`xxhash`, already a dependency of wandb): not a cryptographic hash, a fast one (several
GB/s on one core, far above a disk's rate), and 128 bits make an undetected flip of stored bytes
vanishingly unlikely. Digests are hex strings, recorded beside the data as `{"algorithm": ALGORITHM,
...}` so a later format can change the hash without misreading older records.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash

from .objects import RemoteDir

ALGORITHM = "xxh3_128"
# Files are read in pieces of this many bytes: a checkpoint shard never has to fit in memory.
_CHUNK = 16 * 1024 * 1024


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes safetensors stores for `tensor`: contiguous, in the machine's (little-endian) order."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def digest_tensor(tensor: torch.Tensor) -> str:
    return digest_bytes(tensor_bytes(tensor))


def digest_file(path: str | os.PathLike | RemoteDir) -> str:
    """The digest of a whole file (or object), read in `_CHUNK` pieces."""
    hasher = xxhash.xxh3_128()
    with path.open("rb") if isinstance(path, RemoteDir) else open(Path(path), "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
