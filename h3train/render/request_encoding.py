"""A request's conditioning, encoded once with the encoder's own recipes and cached in the run folder.

`encode_request` runs the encoder's per-task recipes (`h3train/encode/clip.py`, themselves diffusers'
H3 encoder blocks: the keyframe resize and VAE encode, the reference setup and encode, the text
presentations) on the request as a manifest entry. A request has no target clip, so the recipes see
a blank clip of its geometry (only its shape is read: keyframes are always images here).

`Conditioning` holds what diffusers' core denoise blocks take from the encoder blocks, in the
training cache's shapes (`[L, D]` prompt, `[24, 1, h, w]` keyframes, `ReferenceLatents`);
`pipeline_inputs` gives them back in the pipeline's shapes, as `tests/unit/test_layouts_match_diffusers.py`
feeds a cached sample to those blocks.

Cache: `<logging.dir>/samples/requests/<id>.safetensors`, with a digest of the request (media files
by name, size and mtime), the components folder, the text encoder dtype and the encoding settings in
its header. A resume, or a run reusing the folder, re-encodes only what changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from ..encode.clip import (
    ENCODER_VERSION,
    EncodeSettings,
    EncodingPipeline,
    check_video_references,
    encode_conditioning,
)
from ..infra.atomic import atomic_save_file
from ..tasks.conditioning import ReferenceLatents, conditioning_of, merged
from .requests import SampleRequest

CACHE_KEY = "h3train_request"


@dataclass
class Conditioning:
    """One encoded request: prompt `[L, D]` and tags `[L]`, keyframes `[24, 1, h, w]`, references."""

    request: SampleRequest
    prompt_embeds: torch.Tensor
    text_token_tags: torch.Tensor
    keyframe_anchors: tuple[str, ...] = ()
    keyframes: tuple[torch.Tensor, ...] = ()
    references: tuple[ReferenceLatents, ...] = field(default_factory=tuple)
    # The negative prompt's `([L', D], [L'])`, its vision blocks kept (`cfg.negative_visual=keep`), as the
    # encoder wrote it; `encode_request` keeps it, the cache does not (renders do not read it).
    negative: tuple[torch.Tensor, torch.Tensor] | None = None

    def pipeline_inputs(self, device: torch.device) -> dict[str, Any]:
        """What diffusers' encoder blocks hand to the task's core denoise blocks, on `device`."""
        r = self.request
        kind = conditioning_of(r.task)
        inputs: dict[str, Any] = {
            "prompt_embeds": self.prompt_embeds[None].to(device),
            "text_token_tags": self.text_token_tags,
            "height": r.height,
            "width": r.width,
            "num_frames": r.num_frames,
        }
        if kind is not None:
            inputs.update(kind.pipeline_inputs(self, device))
        return inputs


def encode_settings(request: SampleRequest, reference_short_edge: int) -> EncodeSettings:
    """The encode settings whose canvas rule puts a clip on this request's canvas (for video references)."""
    return EncodeSettings(
        short_edge=min(request.height, request.width),
        max_pixels=request.height * request.width,
        reference_short_edge=reference_short_edge,
        min_seconds=0.0,
    )


def request_digest(
    request: SampleRequest, components_id: str, text_dtype: torch.dtype, settings: EncodeSettings
) -> str:
    """Digest of everything a request's conditioning depends on."""
    payload = {
        "encoder_version": ENCODER_VERSION,
        "request": request.fingerprint(),
        "settings": asdict(settings),
        "components": components_id,
        "text_encoder_dtype": str(text_dtype),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def encode_request(pipe: EncodingPipeline, request: SampleRequest, settings: EncodeSettings) -> Conditioning:
    """Encode one request with the encoder's recipes. Raises `MediaError` for a media file that cannot be used."""
    entry = request.manifest_entry()
    check_video_references(pipe, entry)
    # A blank clip of the request's geometry, without memory of its own: the recipes read its shape.
    blank = np.broadcast_to(
        np.zeros((1, 1, 1, 3), dtype=np.uint8), (request.num_frames, request.height, request.width, 3)
    )
    conditioning, prompts = encode_conditioning(pipe, entry, settings, blank)
    negative = (prompts.negative_visual_embeds, prompts.negative_visual_tags)
    return Conditioning(request, prompts.embeds, prompts.tags, **conditioning, negative=negative)


def save_conditioning(path: Path, cond: Conditioning, digest: str) -> None:
    """Write one request's conditioning atomically, its digest in the header."""
    tensors = {"prompt_embeds": cond.prompt_embeds, "text_token_tags": cond.text_token_tags}
    tensors = {name: t.contiguous() for name, t in (tensors | merged(lambda kind: kind.tensors(cond))).items()}
    header = {"digest": digest, "id": cond.request.sample_id, **merged(lambda kind: kind.header(cond))}
    atomic_save_file(tensors, path, metadata={CACHE_KEY: json.dumps(header)})


def load_conditioning(path: Path, request: SampleRequest, digest: str) -> Conditioning | None:
    """The cached conditioning of `request`, or None when the file is missing, unreadable or from other inputs."""
    try:
        with safe_open(str(path), "pt") as handle:
            header = json.loads((handle.metadata() or {})[CACHE_KEY])
            if header.get("digest") != digest:
                return None
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
        conditioning = merged(lambda kind: kind.from_file(header[kind.header_field], tensors))
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    return Conditioning(request, tensors["prompt_embeds"], tensors["text_token_tags"], **conditioning)
