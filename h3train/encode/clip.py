"""One manifest clip -> one `CachedSample`, through diffusers' own pipeline blocks (the package docstring)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep, MiniMaxH3ResizeStep
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3FL2VATextEncoderStep,
    MiniMaxH3KeyframeVaeEncoderStep,
    MiniMaxH3Ref2VAReferenceEncoderStep,
    MiniMaxH3Ref2VATextEncoderStep,
    MiniMaxH3TextEncoderStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_FPS,
    MiniMaxH3ModularPipeline,
    audio_latent_num_frames,
)
from PIL import Image

from ..data.components import Components, reads_videos
from ..data.sample_file import CachedSample
from ..errors import ConfigError
from ..tasks.conditioning import ConditioningKind, Reference, ReferenceLatents, conditioning_of
from ..tasks.released import CANVAS
from .manifest import ManifestEntry
from .media import (
    MediaError,
    TargetClip,
    fit_audio,
    load_clip,
    load_still,
    load_video,
)

# Bump when the encoding recipe changes, so that resuming re-encodes what an older recipe wrote.
ENCODER_VERSION = 1
CANVAS_MULTIPLE = 32


@dataclass(frozen=True)
class EncodeSettings:
    """Geometry of the encoded data. Defaults are the released checkpoint's.

    `short_edge` / `max_pixels`: the canvas rule of the target and of video references (multiples of
    32); `reference_short_edge`: the short edge image references are encoded at (no area cap, as in the
    pipeline); `min_seconds` / `max_seconds`: the clip durations kept (the frame count is the largest
    `17 n + 5` within the clip and `max_seconds`); `video_sample_fps`: the rate the text encoder reads
    reference videos at.
    """

    short_edge: int = CANVAS[0]
    max_pixels: int = CANVAS[0] * CANVAS[1]
    reference_short_edge: int = 2048
    min_seconds: float = 5.0
    max_seconds: float = 15.0
    video_sample_fps: float = 2.0

    def validate(self) -> None:
        """Raise `ConfigError` naming the first bad setting."""
        for name in ("short_edge", "reference_short_edge"):
            value = getattr(self, name)
            if value < CANVAS_MULTIPLE or value % CANVAS_MULTIPLE:
                raise ConfigError(f"encode setting '{name}' is {value}, expected a positive multiple of 32")
        if self.max_pixels < self.short_edge * self.short_edge:
            raise ConfigError(f"encode setting 'max_pixels' is {self.max_pixels}, below short_edge^2")
        if not 0 <= self.min_seconds <= self.max_seconds:
            raise ConfigError(
                f"encode settings 'min_seconds' / 'max_seconds' are {self.min_seconds} / {self.max_seconds}, "
                "expected 0 <= min <= max"
            )
        if self.video_sample_fps <= 0:
            raise ConfigError(f"encode setting 'video_sample_fps' is {self.video_sample_fps}, expected > 0")

    @property
    def min_frames(self) -> int:
        return math.ceil(self.min_seconds * MINIMAX_H3_FPS)

    @property
    def max_frames(self) -> int:
        return math.floor(self.max_seconds * MINIMAX_H3_FPS)


class EncodingPipeline(MiniMaxH3ModularPipeline):
    """The released pipeline's components, properties and canvas configs.

    Its setup step refuses durations outside 5-15 s; here the clip length is chosen by
    `EncodeSettings.min_seconds` / `max_seconds` instead, before the blocks run.
    """

    min_duration = 0.0
    max_duration = math.inf


def build_pipeline(components: Components, settings: EncodeSettings) -> EncodingPipeline:
    """A pipeline holding the loaded components, with the settings' canvas rules as its configs."""
    pipe = EncodingPipeline()
    pipe.update_components(
        vae=components.vae,
        audio_vae=components.audio_vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        processor=components.processor,
        canvas_short_edge=settings.short_edge,
        canvas_max_pixels=settings.max_pixels,
        reference_image_short_edge=settings.reference_short_edge,
    )
    return pipe


def _run(block: Any, pipe: MiniMaxH3ModularPipeline, **inputs: Any) -> PipelineState:
    """Run one pipeline block on a fresh state holding `inputs`; return the state."""
    state = PipelineState()
    for key, value in inputs.items():
        state.set(key, value)
    block(pipe, state)
    return state


# --------------------------------------------------------------------------------------------------
# Recipes.


@torch.no_grad()
def encode_video_latents(pipe: MiniMaxH3ModularPipeline, frames: np.ndarray) -> torch.Tensor:
    """`[T, H, W, 3]` uint8 (T = 17 n + 5) -> `[24, 5 n + 2, H / 16, W / 16]` float32 normalized posterior mean."""
    vae, device = pipe.vae, pipe._execution_device
    pixel_mean = torch.tensor(pipe.pixel_mean, device=device).view(1, -1, 1, 1, 1)
    pixel_std = torch.tensor(pipe.pixel_std, device=device).view(1, -1, 1, 1, 1)
    pixels = torch.from_numpy(frames).to(device).permute(3, 0, 1, 2)[None]
    pixels = (pixels.to(torch.float32).div(255.0) - pixel_mean) / pixel_std
    latents = vae.encode(pixels).latent_dist.mode().float().cpu()
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return ((latents - latents_mean) / latents_std)[0]


def audio_rows_to_latents(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    """The pipeline's channel-major soundtrack rows `[2 n, C]` -> `[2, C, n]` latents."""
    return rows.reshape(channels, -1, rows.shape[-1]).transpose(1, 2).contiguous()


def encode_audio_latents(pipe: MiniMaxH3ModularPipeline, waveform: torch.Tensor) -> torch.Tensor:
    """`[2, N]` at the audio VAE's rate -> `[2, 32, ceil(N / 800)]`, encoded as the pipeline encodes a soundtrack."""
    reference = MiniMaxH3AudioReference(audio=waveform, sample_rate=pipe.audio_sampling_rate)
    rows = _run(MiniMaxH3Ref2VAReferenceEncoderStep(), pipe, normalized_references=[reference])
    return audio_rows_to_latents(rows.get("audio_condition_latents")[0], pipe.audio_channels)


@dataclass
class _Prompts:
    """Prompt embeddings `[L, D]` and tags `[L]` of the presentation, and of the negative prompt two ways."""

    embeds: torch.Tensor
    tags: torch.Tensor
    negative_embeds: torch.Tensor
    negative_tags: torch.Tensor
    negative_visual_embeds: torch.Tensor
    negative_visual_tags: torch.Tensor


def _presentation(state: PipelineState) -> tuple[torch.Tensor, torch.Tensor]:
    return state.get("prompt_embeds")[0].cpu(), state.get("text_token_tags").cpu().long()


def _prompts(pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, visual_step: Any = None, **vision: Any) -> _Prompts:
    """Encode the prompt with `visual_step` (the task's text block, given `vision`) or as plain text (t2va).

    The negative prompt is encoded as plain text, and with `visual_step` too: its vision blocks kept.
    """
    embeds, tags = _presentation(_run(visual_step or MiniMaxH3TextEncoderStep(), pipe, prompt=entry.prompt, **vision))
    negative = _presentation(_run(MiniMaxH3TextEncoderStep(), pipe, prompt=entry.negative_prompt))
    # Without vision blocks (t2va) the visual variant is the text one; writing it lets every sample
    # train under either `cfg.negative_visual` choice.
    visual = negative
    if visual_step is not None:
        visual = _presentation(_run(visual_step, pipe, prompt=entry.negative_prompt, **vision))
    return _Prompts(embeds, tags, *negative, *visual)


def encode_keyframes(
    pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, settings: EncodeSettings, frames: np.ndarray
) -> tuple[dict[str, Any], _Prompts]:
    """Keyframes (the clip's own first / last frame, or an image) -> anchors, latents `[24, 1, h, w]`, prompts."""
    clip_frame = {"first": frames[0], "last": frames[-1]}
    images = {
        k.anchor: load_still(k.image.path) if k.image else Image.fromarray(clip_frame[k.anchor])
        for k in entry.keyframes
    }
    height, width = frames.shape[1:3]
    resized = _run(
        MiniMaxH3ResizeStep(),
        pipe,
        image=images.get("first"),
        last_image=images.get("last"),
        height=height,
        width=width,
    )
    keyframes = resized.get("keyframes")
    latents = _run(MiniMaxH3KeyframeVaeEncoderStep(), pipe, keyframes=keyframes).get("condition_latents")
    prompts = _prompts(pipe, entry, MiniMaxH3FL2VATextEncoderStep(), keyframes=keyframes)
    fields = {
        "keyframe_anchors": tuple(resized.get("keyframe_anchors")),
        "keyframes": tuple(latent[0] for latent in latents),
    }
    return fields, prompts


def torchaudio_available() -> bool:
    """Whether torchaudio imports: the pipeline resamples a reference soundtrack with it."""
    try:
        importlib.import_module("torchaudio")
    except (ImportError, OSError):
        return False
    return True


def _pipeline_reference(pipe: MiniMaxH3ModularPipeline, ref: Reference, seconds: float) -> Any:
    """Decode one manifest reference into the pipeline's reference type, at the rates its file carries.

    An audio file is decoded by diffusers' own `MiniMaxH3AudioReference.from_file`; a video's frames at
    most `seconds` of them, at its own fps and size, with its soundtrack decoded the same way. The setup
    step then normalizes both (24 fps, canvas, 32 kHz stereo) as inference does.
    """
    if ref.kind == "image":
        return MiniMaxH3ImageReference(image=load_still(ref.media.path))
    if ref.kind == "audio":
        try:
            reference = MiniMaxH3AudioReference.from_file(ref.media.path)
        except Exception as exc:  # noqa: BLE001 - PyAV and the decoder raise many types for a bad file
            raise MediaError(f"cannot read audio reference '{ref.media.path}': {type(exc).__name__}: {exc}") from None
    else:
        video = load_video(ref.media.path, seconds)
        reference = MiniMaxH3VideoReference(
            frames=video.frames, fps=video.fps, audio=video.audio, sample_rate=video.sample_rate
        )
    rate = reference.sample_rate
    if reference.has_audio and rate != pipe.audio_sampling_rate and not torchaudio_available():
        raise MediaError(
            f"{ref.kind} reference '{ref.media.relative}' has its sound at {rate} Hz; the pipeline resamples it to "
            f"{pipe.audio_sampling_rate} Hz with torchaudio, which is not installed (install the torchaudio build "
            f"matching torch {torch.__version__.split('+')[0]}, or give the reference at {pipe.audio_sampling_rate} Hz)"
        )
    return reference


def encode_references(
    pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, settings: EncodeSettings, frames: np.ndarray
) -> tuple[dict[str, Any], _Prompts]:
    """References in request order -> their latents (visual `[24, f, h, w]`, audio `[2, 32, n]`) and prompts."""
    num_frames, height, width = frames.shape[:3]
    refs = [_pipeline_reference(pipe, ref, num_frames / pipe.fps) for ref in entry.references]
    try:
        setup = _run(
            MiniMaxH3Ref2VASetupStep(), pipe, references=refs, height=height, width=width, num_frames=num_frames
        )
    except ValueError as exc:
        raise MediaError(f"references: {exc}") from None
    normalized = setup.get("normalized_references")
    encoded = _run(MiniMaxH3Ref2VAReferenceEncoderStep(), pipe, normalized_references=normalized)
    visual = iter(encoded.get("condition_latents"))
    sounds = iter(encoded.get("audio_condition_latents"))
    latents = tuple(
        ReferenceLatents(
            kind=ref.kind,
            video=next(visual)[0] if ref.kind in ("image", "video") else None,
            audio=audio_rows_to_latents(next(sounds), pipe.audio_channels) if ref.has_audio else None,
        )
        for ref in normalized
    )
    step = MiniMaxH3Ref2VATextEncoderStep(video_sample_fps=settings.video_sample_fps)
    return {"references": latents}, _prompts(pipe, entry, step, normalized_references=normalized)


def conditioning_recipe(kind: ConditioningKind) -> Callable[..., tuple[dict[str, Any], _Prompts]]:
    """The encoder's recipe of `kind`: the function its `encoder` names (`module:function`)."""
    module, _, name = kind.encoder.partition(":")
    return getattr(importlib.import_module(module), name)


def encode_conditioning(
    pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, settings: EncodeSettings, frames: np.ndarray
) -> tuple[dict[str, Any], _Prompts]:
    """The entry's conditioning by its kind's recipe, and its prompts (the prompt alone for t2va)."""
    kind = conditioning_of(entry.task)
    if kind is None:
        return {}, _prompts(pipe, entry)
    return conditioning_recipe(kind)(pipe, entry, settings, frames)


def check_video_references(pipe: EncodingPipeline, entry: ManifestEntry) -> None:
    """Raise `MediaError` when `entry` has a video reference and `pipe` cannot read videos; called before
    anything is decoded, by the encoder (a manifest clip) and the renderer (a request) alike."""
    if any(r.kind == "video" for r in entry.references) and not reads_videos(pipe.processor):
        raise MediaError("video references need Qwen3-VL's video processor, which transformers builds on torchvision")


def encode_entry(
    pipe: EncodingPipeline,
    entry: ManifestEntry,
    settings: EncodeSettings,
    start: int = 0,
    max_frames: int | None = None,
    sample_id: str | None = None,
) -> tuple[CachedSample, TargetClip]:
    """Encode one manifest clip into a `CachedSample`; also returns the decoded clip (its canvas, its file).

    The sample is the clip's window from 24 fps frame `start`, of at most `max_frames` frames (default
    `settings.max_frames`), with its soundtrack from the same instant; its id `sample_id` (default the
    entry's). A keyframe taken from the clip is the window's own first / last frame. Raises `MediaError`
    (or the blocks' errors) for a bad clip.
    """
    check_video_references(pipe, entry)
    clip = load_clip(
        entry.video.path,
        settings.short_edge,
        settings.max_pixels,
        pipe.canvas_multiple,
        settings.min_frames,
        settings.max_frames if max_frames is None else max_frames,
        pipe.audio_sampling_rate,
        start,
    )
    num_audio = audio_latent_num_frames(clip.num_frames, pipe.fps)
    if clip.audio is None:
        audio = torch.zeros(pipe.audio_channels, pipe.audio_latent_channels, num_audio)
    else:
        audio = encode_audio_latents(pipe, fit_audio(clip.audio, num_audio * pipe.audio_vae.hop_length))

    conditioning, prompts = encode_conditioning(pipe, entry, settings, clip.frames)
    sample = CachedSample(
        sample_id=entry.sample_id if sample_id is None else sample_id,
        task=entry.task,
        num_frames=clip.num_frames,
        video_latents=encode_video_latents(pipe, clip.frames),
        audio_latents=audio,
        prompt_embeds=prompts.embeds,
        text_token_tags=prompts.tags,
        negative_prompt_embeds=prompts.negative_embeds,
        negative_text_token_tags=prompts.negative_tags,
        has_audio=clip.audio is not None,
        **conditioning,
        negative_visual_prompt_embeds=prompts.negative_visual_embeds,
        negative_visual_text_token_tags=prompts.negative_visual_tags,
        source=entry.video.relative,
    )
    return sample, clip
