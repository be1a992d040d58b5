"""Stage-1 encoding: media files and prompts -> cached samples, with diffusers' own pipeline blocks.

Per clip (`encode_entry`):

    target video  [T, H, W, 3] uint8, T = 17 n + 5 at 24 fps  -> video_latents [24, 5 n + 2, H/16, W/16]
                  the video VAE's posterior mean, ImageNet-normalized pixels in, latents normalized by
                  the VAE's `latents_mean` / `latents_std` (the inverse of `MiniMaxH3VideoDecodeStep`)
    target audio  [2, N] at 32 kHz                           -> audio_latents [2, 32, round(T / 24 * 40)]
                  as `MiniMaxH3Ref2VAReferenceEncoderStep` encodes a soundtrack (posterior mean,
                  normalized); zeros and `has_audio = False` for a clip without an audio track
    fl2va         `MiniMaxH3ResizeStep` puts the keyframes on the canvas, `MiniMaxH3KeyframeVaeEncoderStep`
                  encodes them (`encode_vae_condition`), `MiniMaxH3FL2VATextEncoderStep` presents them
    ref2va        `MiniMaxH3Ref2VASetupStep` normalizes the references, `MiniMaxH3Ref2VAReferenceEncoderStep`
                  encodes them, `MiniMaxH3Ref2VATextEncoderStep` presents them
    t2va          `MiniMaxH3TextEncoderStep`
    negatives     the negative prompt through `MiniMaxH3TextEncoderStep` (text only) and through the task's
                  own text step with the same vision blocks (`negative_visual_*`; for t2va the two agree)

The blocks run on a `MiniMaxH3ModularPipeline` holding the loaded components, so the canvas rules,
the prompt presentations (labels, vision blocks tagged 0) and the conditioning recipes are the
pipeline's, not a copy of them.

References reach the pipeline at their own rates (`MiniMaxH3AudioReference.from_file`, a video
reference's frames at their fps and its soundtrack at its own sample rate), so the setup step's
`_normalize_audio_condition` / `_normalize_video_condition` run as at inference. Resampling a
soundtrack that is not at the audio VAE's 32 kHz needs torchaudio there; without it the clip is
recorded in `errors.jsonl` rather than resampled another way.

`encode_manifest` runs a whole manifest, alone or under torchrun (`accelerate.PartialState` splits the
manifest into contiguous shares and gathers the counts): a sample already written from the same inputs
and settings is skipped (`<id>.inputs.json` beside it holds the digest), a failing clip is appended to
`errors.jsonl` and the run goes on, samples are written atomically, and `index.jsonl` is rebuilt at the end.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
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
from tqdm import tqdm

from ..atomic import atomic_write_text, is_temporary, set_aside
from ..diskspace import no_space
from ..errors import ConfigError
from ..runlock import RunLock
from .components import Components, check_components_folder, components_fingerprint, load_components, reads_videos
from .format import INDEX_NAME, SAMPLE_SUFFIX, CachedSample, ReferenceLatents, verify_sample, write_index, write_sample
from .manifest import ManifestEntry, Reference, read_clip_folder, read_manifest
from .media import (
    FPS,
    Clip,
    ClipTooShort,
    MediaError,
    aligned_frame_count,
    fit_audio,
    load_clip,
    load_still,
    load_video,
    shortest_kept,
)

# Bump when the encoding recipe changes, so that resuming re-encodes what an older recipe wrote.
ENCODER_VERSION = 1
ERRORS_NAME = "errors.jsonl"
INPUTS_SUFFIX = ".inputs.json"
# One line per clip: what its file held and what became of it (`ClipRow`).
TABLE_NAME = "clips.tsv"
# The held-out split (`--heldout`): a dataset of its own inside the output folder.
HELDOUT_NAME = "heldout"
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

    short_edge: int = 768
    max_pixels: int = 768 * 1344
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


def _fl2va(
    pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, frames: np.ndarray
) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...], _Prompts]:
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
    return tuple(resized.get("keyframe_anchors")), tuple(latent[0] for latent in latents), prompts


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


def _ref2va(
    pipe: MiniMaxH3ModularPipeline, entry: ManifestEntry, settings: EncodeSettings, frames: np.ndarray
) -> tuple[tuple[ReferenceLatents, ...], _Prompts]:
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
    return latents, _prompts(pipe, entry, step, normalized_references=normalized)


def encode_entry(pipe: EncodingPipeline, entry: ManifestEntry, settings: EncodeSettings) -> tuple[CachedSample, Clip]:
    """Encode one manifest clip into a `CachedSample`; also returns the decoded clip (its canvas, its source).

    Raises `MediaError` (or the blocks' errors) for a bad clip.
    """
    if any(r.kind == "video" for r in entry.references) and not reads_videos(pipe.processor):
        raise MediaError("video references need Qwen3-VL's video processor, which transformers builds on torchvision")
    clip = load_clip(
        entry.video.path,
        settings.short_edge,
        settings.max_pixels,
        pipe.canvas_multiple,
        settings.min_frames,
        settings.max_frames,
        pipe.audio_sampling_rate,
    )
    num_audio = audio_latent_num_frames(clip.num_frames, pipe.fps)
    if clip.audio is None:
        audio = torch.zeros(pipe.audio_channels, pipe.audio_latent_channels, num_audio)
    else:
        audio = encode_audio_latents(pipe, fit_audio(clip.audio, num_audio * pipe.audio_vae.hop_length))

    anchors, keyframes, references = (), (), ()
    if entry.task == "fl2va":
        anchors, keyframes, prompts = _fl2va(pipe, entry, clip.frames)
    elif entry.task == "ref2va":
        references, prompts = _ref2va(pipe, entry, settings, clip.frames)
    else:
        prompts = _prompts(pipe, entry)
    sample = CachedSample(
        sample_id=entry.sample_id,
        task=entry.task,
        num_frames=clip.num_frames,
        video_latents=encode_video_latents(pipe, clip.frames),
        audio_latents=audio,
        prompt_embeds=prompts.embeds,
        text_token_tags=prompts.tags,
        negative_prompt_embeds=prompts.negative_embeds,
        negative_text_token_tags=prompts.negative_tags,
        has_audio=clip.audio is not None,
        keyframe_anchors=anchors,
        keyframes=keyframes,
        references=references,
        negative_visual_prompt_embeds=prompts.negative_visual_embeds,
        negative_visual_text_token_tags=prompts.negative_visual_tags,
        source=entry.video.relative,
    )
    return sample, clip


# --------------------------------------------------------------------------------------------------
# A whole manifest.


@dataclass(frozen=True)
class ClipRow:
    """One line of the encode table (`clips.tsv`): what a clip's file held and what became of it.

    `source` as `Source.describe` gives it; `canvas` width x height; `frames` / `seconds` of the sample at
    24 fps; `audio` `yes` or `none`; `outcome` `encoded`, `up to date`, or `failed: <kind>` (the reason
    is in `errors.jsonl`). Fields of a clip that failed before it was read are empty.
    """

    sample_id: str
    source: str = ""
    canvas: str = ""
    frames: int | None = None
    seconds: float | None = None
    audio: str = ""
    outcome: str = ""

    COLUMNS = ("id", "source", "canvas", "frames", "seconds", "audio", "outcome")

    def cells(self) -> tuple[str, ...]:
        seconds = "" if self.seconds is None else f"{self.seconds:.2f}"
        frames = "" if self.frames is None else str(self.frames)
        return (self.sample_id, self.source, self.canvas, frames, seconds, self.audio, self.outcome)

    def describe(self) -> str:
        """The console line of `--verbose`.

        `id: 640x360 25 fps 5.00 s -> 512x288, 107 frames (4.46 s), audio yes: encoded`.
        """
        if not self.canvas:
            return f"{self.sample_id}: {self.source + ' -> ' if self.source else ''}{self.outcome}"
        return (
            f"{self.sample_id}: {self.source} -> {self.canvas}, {self.frames} frames ({self.seconds:.2f} s), "
            f"audio {self.audio}: {self.outcome}"
        )


def write_table(folder: Path, rows: list[ClipRow]) -> Path:
    """`folder/clips.tsv`: a header and one tab-separated line per clip, in id order."""
    lines = ["\t".join(ClipRow.COLUMNS)] + ["\t".join(r.cells()) for r in sorted(rows, key=lambda r: r.sample_id)]
    path = folder / TABLE_NAME
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


@dataclass
class EncodeSummary:
    """Counts over all ranks: samples written now, already up to date, and clips that failed (by kind).

    `heldout`: clips of the held-out split (`--heldout`, in `out/heldout`), counted in the others too.
    """

    encoded: int
    skipped: int
    failed: int
    out: Path
    failures: dict[str, int] = field(default_factory=dict)
    heldout: int = 0

    @property
    def ok(self) -> bool:
        """At least one sample of the manifest is in the dataset."""
        return self.encoded + self.skipped > 0

    def describe(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        line = f"encoded {self.encoded}, up to date {self.skipped}, failed {self.failed}"
        line += f" ({kinds}; reasons in {ERRORS_NAME})" if self.failed else ""
        line += f" -> {self.out}"
        if self.heldout:
            line += f", {self.heldout} of them held out in {self.out / HELDOUT_NAME}"
        return line + f"; one line per clip in {self.out / TABLE_NAME}"


def input_digest(entry: ManifestEntry, settings: EncodeSettings, components_id: str, text_dtype: torch.dtype) -> str:
    """Digest of everything a sample's content depends on, but the clip's length: the entry and its media
    files, the canvas and reference settings, components, recipe.

    `min_seconds` / `max_seconds` only choose the frame count, which `inputs.json` records with the
    clip's length, so changing them re-encodes only the clips whose frame count they change (`_up_to_date`).
    """
    geometry = {k: v for k, v in asdict(settings).items() if k not in ("min_seconds", "max_seconds")}
    payload = {
        "encoder_version": ENCODER_VERSION,
        "entry": entry.fingerprint(),
        "settings": geometry,
        "components": components_id,
        "text_encoder_dtype": str(text_dtype),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def split_heldout(
    entries: list[ManifestEntry], count: int, seed: int = 0
) -> tuple[list[ManifestEntry], list[ManifestEntry]]:
    """`(training, heldout)`: `count` clips held out by a seeded rule that depends on each clip's id alone.

    The clips with the smallest `sha256(f"{seed}:{id}")` are held out, so the split is the same on
    every rank and every rerun of the same clips.
    """
    if count <= 0:
        return entries, []
    if count >= len(entries):
        raise ConfigError(f"--heldout {count} leaves no clip to train on ({len(entries)} clips); hold out fewer")
    rank = sorted(entries, key=lambda e: hashlib.sha256(f"{seed}:{e.sample_id}".encode()).hexdigest())
    held = {e.sample_id for e in rank[:count]}
    return [e for e in entries if e.sample_id not in held], [e for e in entries if e.sample_id in held]


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` where there is a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def encode_manifest(
    manifest: str | os.PathLike,
    components: str | os.PathLike,
    out: str | os.PathLike,
    settings: EncodeSettings | None = None,
    device: str | torch.device | None = None,
    text_encoder_dtype: torch.dtype | None = None,
    progress: bool = True,
    heldout: int = 0,
    caption_prefix: str = "",
    verbose: bool = False,
) -> EncodeSummary:
    """Encode every clip of `manifest` into the dataset folder `out`, alone or as one rank of torchrun.

    `manifest`: a manifest file, or a folder of clips with same-named `.txt` captions
    (`read_clip_folder`). `heldout`: clips held out into the dataset `out/heldout` (`split_heldout`);
    `caption_prefix`: text put before every prompt (a trigger word); `verbose`: each clip's table line
    on the console too. Raises `ConfigError` for a bad manifest, settings or components folder (before
    any process group); a failing clip is recorded in `errors.jsonl` and does not stop the run.
    `text_encoder_dtype` defaults to bfloat16 on a GPU and float32 on the CPU.
    """
    settings = settings or EncodeSettings()
    settings.validate()
    entries = read_clip_folder(manifest) if Path(manifest).is_dir() else read_manifest(manifest)
    if caption_prefix.strip():
        entries = [replace(e, prompt=f"{caption_prefix.strip()} {e.prompt}".strip()) for e in entries]
    training, held = split_heldout(entries, heldout)
    check_components_folder(components)
    device = torch.device(device) if device is not None else default_device()
    text_dtype = text_encoder_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output '{out}' exists and is not a folder")

    # The first rank locks the folder before the process group exists: a second encode into it stops.
    lock = RunLock([(out, f"--out '{out}'")]) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        for note in lock.acquire() if lock is not None else []:
            print(note, file=sys.stderr, flush=True)
        # A held-out split from an earlier run stays a group (empty now) so its samples move back.
        keep_split = held or (out / HELDOUT_NAME / INDEX_NAME).is_file()
        groups = [(out, training)] + ([(out / HELDOUT_NAME, held)] if keep_split else [])
        return _encode(groups, components, out, settings, device, text_dtype, progress, verbose)
    finally:
        if lock is not None:
            lock.release()


def _encode(
    groups: list[tuple[Path, list[ManifestEntry]]],
    components: str | os.PathLike,
    out: Path,
    settings: EncodeSettings,
    device: torch.device,
    text_dtype: torch.dtype,
    progress: bool,
    verbose: bool,
) -> EncodeSummary:
    # Alone: a single-process state. Under torchrun: one process group (gloo for a CPU encode, NCCL on
    # the GPUs), each rank a contiguous share of the clips.
    state = PartialState(cpu=device.type == "cpu")
    if state.is_main_process:
        for folder, _ in groups:
            _prepare_output(folder)
        _move_between_splits(groups)
    state.wait_for_everyone()
    pipe = build_pipeline(load_components(components, device, text_dtype), settings)
    components_id = components_fingerprint(components)
    jobs = [(folder, entry) for folder, group in groups for entry in group]
    rows: list[tuple[str, ClipRow]] = []
    with state.split_between_processes(jobs) as mine:
        bar = tqdm(
            mine,
            desc=f"encode (rank {state.process_index})",
            unit="clip",
            disable=not progress or not state.is_main_process,
        )
        for folder, entry in bar:
            digest = input_digest(entry, settings, components_id, text_dtype)
            row = _encode_to_folder(pipe, entry, settings, folder, digest, bar)
            rows.append((str(folder), row))
            if verbose:
                bar.write(f"h3train encode: {row.describe()}", file=sys.stderr)
    every = [row for part in gather_object([rows]) for row in part]
    if state.is_main_process:
        # The held-out dataset first: `write_index` leaves out a subfolder that has an index of its own.
        for folder, _ in reversed(groups):
            write_index(folder)
            write_table(folder, [row for where, row in every if where == str(folder)])
    state.wait_for_everyone()
    if state.use_distributed:
        state.destroy_process_group()
    outcomes = [row.outcome for _, row in every]
    failures = Counter(o.removeprefix("failed: ") for o in outcomes if o.startswith("failed: "))
    return EncodeSummary(
        encoded=outcomes.count("encoded"),
        skipped=outcomes.count("up to date"),
        failed=sum(failures.values()),
        out=out,
        failures=dict(failures),
        heldout=sum(len(group) for folder, group in groups if folder != out),
    )


def _encode_to_folder(
    pipe: EncodingPipeline, entry: ManifestEntry, settings: EncodeSettings, out: Path, digest: str, bar: tqdm
) -> ClipRow:
    """Encode and write one entry unless it is up to date; its table row says which it was."""
    sample_path = out / f"{entry.sample_id}{SAMPLE_SUFFIX}"
    inputs_path = out / f"{entry.sample_id}{INPUTS_SUFFIX}"
    recorded = _up_to_date(sample_path, inputs_path, digest, settings)
    if recorded is not None:
        return replace(recorded, outcome="up to date")
    try:
        sample, clip = encode_entry(pipe, entry, settings)
        write_sample(sample_path, sample)
    except Exception as exc:  # noqa: BLE001 - one bad clip must not stop the run; the reason is recorded
        if no_space(exc) is not None:
            # A full disk is no clip's fault: every later clip would fail alike. Stop, naming the file.
            raise
        # A sample left from older inputs no longer matches the manifest.
        sample_path.unlink(missing_ok=True)
        inputs_path.unlink(missing_ok=True)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0] + _way_out(exc, settings)
        kind = exc.kind if isinstance(exc, MediaError) else type(exc).__name__
        _append_error(out, entry, reason, kind)
        bar.write(f"h3train encode: {entry.sample_id} (manifest line {entry.line}): {reason}", file=sys.stderr)
        return ClipRow(entry.sample_id, outcome=f"failed: {kind}")
    source = clip.source
    assert source is not None, "load_clip describes the source of every clip"
    height, width = clip.frames.shape[1:3]
    row = ClipRow(
        entry.sample_id,
        source=source.describe(),
        canvas=f"{width}x{height}",
        frames=sample.num_frames,
        seconds=sample.num_frames / FPS,
        audio="yes" if sample.has_audio else "none",
        outcome="encoded",
    )
    # Written after the sample: a run killed in between re-encodes the clip rather than trusting it.
    record = {
        "digest": digest,
        "inputs": entry.fingerprint(),
        "length": {"slots": source.slots, "complete": source.complete, "frames": sample.num_frames},
        "row": asdict(row),
    }
    atomic_write_text(inputs_path, json.dumps(record, indent=1) + "\n")
    return row


def _way_out(exc: Exception, settings: EncodeSettings) -> str:
    """The flag that would keep a clip a setting rejected, as the end of its reason ('' if none)."""
    if isinstance(exc, ClipTooShort):
        if exc.shortest > shortest_kept(0):
            return f"; lower --min-seconds (now {settings.min_seconds:g}) to keep it"
        return f"; no setting keeps a clip under {shortest_kept(0)} frames at {FPS} fps"
    return ""


def _up_to_date(sample_path: Path, inputs_path: Path, digest: str, settings: EncodeSettings) -> ClipRow | None:
    """The recorded row of a sample encoded from these inputs, whose length the current `min_seconds` /
    `max_seconds` would choose again, and whose bytes are still those written; else None.

    The recorded length is the clip's 24 fps frame count (`slots`; all of it when `complete`, else
    decoding stopped at the then `max_seconds`): the current frame count follows from it without
    decoding, except for a clip cut short before whose cap is now raised.
    """
    try:
        recorded = json.loads(inputs_path.read_text())
        if recorded.get("digest") != digest:
            return None
        length = recorded["length"]
        slots, frames = int(length["slots"]), int(length["frames"])
        if not length["complete"] and settings.max_frames > slots:
            return None
        # The rule that chose the length, on the recorded slots (too short now raises, a ValueError).
        if aligned_frame_count(slots, settings.min_frames, settings.max_frames) != frames:
            return None
        verify_sample(sample_path)
        return ClipRow(**recorded["row"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _prepare_output(out: Path) -> None:
    """Create the folder, drop the temporary files of an interrupted encode, start a fresh `errors.jsonl`.

    Only files named as h3train's atomic writes name their temporaries go (this encode holds the
    folder's lock, so their writer has stopped); the earlier `errors.jsonl` is kept as
    `errors.jsonl.previous` (numbered after the first).
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp"):
        if stale.is_file() and is_temporary(stale):
            stale.unlink(missing_ok=True)
    errors = out / ERRORS_NAME
    if errors.is_file() and errors.stat().st_size > 0:
        set_aside(errors, "previous")
    errors.write_text("")


def _move_between_splits(groups: list[tuple[Path, list[ManifestEntry]]]) -> None:
    """Move a sample this encoder wrote into the split its clip now belongs to (a changed `--heldout`),
    with its `inputs.json`, so that no clip sits in both datasets and none is encoded twice."""
    for folder, group in groups:
        for entry in group:
            target = folder / f"{entry.sample_id}{SAMPLE_SUFFIX}"
            for other, _ in groups:
                found = other / f"{entry.sample_id}{SAMPLE_SUFFIX}"
                inputs = other / f"{entry.sample_id}{INPUTS_SUFFIX}"
                if other == folder or not (found.is_file() and inputs.is_file()) or target.exists():
                    continue
                # The sample first: one stopped between the two is re-encoded, never trusted without its record.
                os.replace(found, target)
                os.replace(inputs, folder / inputs.name)


def _append_error(out: Path, entry: ManifestEntry, reason: str, kind: str) -> None:
    record = {"id": entry.sample_id, "line": entry.line, "video": entry.video.relative, "kind": kind, "error": reason}
    # One write per line in append mode: ranks appending at once do not interleave within a line.
    with open(out / ERRORS_NAME, "a") as handle:
        handle.write(json.dumps(record) + "\n")
