"""What the base model predicted on the held-out pairs, stored once per run and read by later validations.

Drift and guidance retention compare the fine-tuned model with its base on the same held-out
(sample, sigma) pairs. A LoRA run could run its base again (adapters disabled), a full fine-tune
keeps no copy of it; so both compute the base's predictions once, on a fresh run before the first
step (a LoRA's with its adapters disabled), and store them in `<logging.dir>/base_predictions/`:

- `<index>.safetensors`, one file per held-out sample (sample `index` of the held-out set), written
  by SP rank 0 of the DP group that evaluated it. For each sigma label `s`, float32, only the rows
  the loss is taken on: `s/video` `[N_v, C_v]` and `s/audio` `[N_a, C_a]`, the conditional
  prediction; `s/guide_video` and `s/guide_audio`, the implicit guidance `p(c) - p(neg)`. Each
  tensor's digest is in the file's metadata, checked on every read.
- `meta.json`, written by rank 0 once every file is in: the digest of the held-out set and the
  settings the pairs depend on (`fingerprint`), so a resumed run reads them only for the same pairs.
  Without it the store is incomplete: a fresh run writes it again, a resumed LoRA run too.

Files are per sample, so a resume under another DP size reads the same values, bitwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import SampleError
from ..infra.atomic import atomic_save_file, atomic_write_text
from ..infra.digest import ALGORITHM, digest_bytes, digest_tensor
from ..tasks.layout import AUDIO_LATENT_CHANNELS, PATCH_SIZE, VIDEO_LATENT_CHANNELS, Geometry
from ..tasks.released import LONGEST_GEOMETRY, SHORT_GEOMETRY
from .location import SampleLocation
from .sample_file import sample_digest

FOLDER = "base_predictions"
# Floats per target row: a video row is a (1, 2, 2) patch of 24 latent channels, an audio row 32 wide.
VIDEO_ROW = VIDEO_LATENT_CHANNELS * math.prod(PATCH_SIZE)
AUDIO_ROW = AUDIO_LATENT_CHANNELS


def pair_bytes(geometry: Geometry) -> int:
    """Bytes one (sample, sigma) pair adds to the store: its prediction and guidance, float32, over the
    target rows of both modalities (conditioning rows are not stored)."""
    return 2 * 4 * (geometry.video_rows() * VIDEO_ROW + geometry.audio_rows() * AUDIO_ROW)


# The released 5 s and 15 s clips (`tasks.released`).
RELEASED_PAIR_BYTES = (pair_bytes(Geometry(*SHORT_GEOMETRY)), pair_bytes(Geometry(*LONGEST_GEOMETRY)))
META = "meta.json"
_DIGESTS = "digests"
# The format of the files; a change makes older stores incomplete, never misread.
VERSION = 1


def fingerprint(sample_files: list[tuple[str, Path | SampleLocation]], settings: dict[str, Any]) -> str:
    """The digest of the held-out pairs: every evaluated sample's id and bytes (its file's, or its bytes in a
    shard: the same digest), and `settings` (sigmas, noise seed, shifts, negative prompt choice), as JSON."""
    parts = [f"{sample_id}:{sample_digest(path)}" for sample_id, path in sample_files]
    text = json.dumps({"version": VERSION, "samples": parts, "settings": settings}, sort_keys=True)
    return digest_bytes(text.encode())


class BasePredictions:
    """The store in `folder` for the held-out pairs of `fingerprint` (see the module docstring)."""

    def __init__(self, folder: str | Path, fingerprint: str) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint

    def meta(self) -> dict[str, Any] | None:
        """The committed store's record, or None when it is incomplete (or unreadable as ours)."""
        try:
            record = json.loads((self.folder / META).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("version") == VERSION else None

    def matches(self) -> bool | None:
        """None: no complete store; True: one for these pairs; False: one for other pairs."""
        record = self.meta()
        return None if record is None else record.get("fingerprint") == self.fingerprint

    def begin(self) -> None:
        """Mark the store incomplete before (re)writing it: rank 0, before any rank writes a file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / META).unlink(missing_ok=True)

    def path(self, index: int) -> Path:
        return self.folder / f"{index:06d}.safetensors"

    def write(self, index: int, tensors: dict[str, torch.Tensor]) -> int:
        """Store sample `index`'s tensors (made contiguous float32 CPU copies); returns the bytes written."""
        stored = {name: t.detach().float().cpu().contiguous() for name, t in tensors.items()}
        digests = {name: digest_tensor(t) for name, t in stored.items()}
        metadata = {_DIGESTS: json.dumps({"algorithm": ALGORITHM, **digests}), "version": str(VERSION)}
        atomic_save_file(stored, self.path(index), metadata)
        return sum(t.numel() * 4 for t in stored.values())

    def commit(self, samples: int, pairs: int, stored_bytes: int, settings: dict[str, Any]) -> None:
        """Rank 0, after every rank's files are written: the store is complete."""
        record = {
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "samples": samples,
            "pairs": pairs,
            "bytes": stored_bytes,
            "settings": settings,
        }
        atomic_write_text(self.folder / META, json.dumps(record, indent=1) + "\n")

    def read(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index`'s tensors, each checked against its digest (a mismatch is a `SampleError`)."""
        path = self.path(index)
        try:
            with safe_open(str(path), framework="pt") as handle:
                recorded = json.loads((handle.metadata() or {}).get(_DIGESTS, "{}"))
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except (OSError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SampleError(
                f"base predictions '{path}' cannot be read ({first}); remove '{self.folder}' and start the run "
                "afresh, or set validation.retention=false"
            ) from None
        for name, tensor in tensors.items():
            if recorded.get(name) != digest_tensor(tensor):
                raise SampleError(
                    f"base predictions '{path}': tensor '{name}' does not match its digest (damaged on disk); "
                    f"remove '{self.folder}' and start the run afresh, or set validation.retention=false"
                )
        return tensors
