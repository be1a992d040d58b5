"""Host memory of the components that render `validation.samples`, for `h3train check`.

Counted from the safetensors headers of the components folder (no weights are read): the VAEs in
float32 (their released precision, as they are loaded), the text encoder in the dtype requests are
encoded in (`render.requests.text_encoder_dtype`). Every rank holds the VAEs on the CPU for the whole
run; rank 0 also holds the text encoder while it encodes requests that are not cached yet, before
the first step. A VAE visits the accelerator only while a clip is decoded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
RENDER_COMPONENTS = ("vae", "audio_vae", "text_encoder")


def _floats_in(folder: Path) -> tuple[int, int]:
    """(floating-point elements, bytes of everything else) over the safetensors files of a folder."""
    floats = other = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in spec["shape"]:
                count *= dim
            if spec["dtype"] in ("F64", "F32", "F16", "BF16"):
                floats += count
            else:
                other += count * _BYTES.get(spec["dtype"], 1)
    return floats, other


def component_bytes(root: str | Path, text_encoder_bytes_per_value: int) -> dict[str, int] | None:
    """Bytes of `vae`, `audio_vae` (float32) and `text_encoder` as loaded, or None when unreadable here."""
    root = Path(root)
    out = {}
    try:
        for name in RENDER_COMPONENTS:
            floats, other = _floats_in(root / name)
            if not floats:
                return None
            out[name] = floats * (text_encoder_bytes_per_value if name == "text_encoder" else 4) + other
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return out
