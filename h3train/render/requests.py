"""`validation.samples`: render requests in the encoder manifest's schema, checked before any heavy work.

A request is a manifest entry without a target clip (`h3train/encode/manifest.py`): a prompt, a task,
fl2va keyframe images or ref2va references, plus what a clip would have given: `frames` (`17 n + 5`
at 24 fps, n >= 1, since the video VAE decoder needs at least 7 latent frames), `resolution`
(`WIDTHxHEIGHT`, multiples of 32) and the `seed` of the request's generator.

Media paths are made absolute when the config is loaded (`config.anchor_sample_paths`): a relative path is
relative to the folder of the config file that names it, or to the working directory for a
command-line override. Every problem is a one-line `ConfigError` naming `validation.samples[i].field`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import SAMPLES_KEY as KEY
from ..config import sample_key as _where
from ..encode.manifest import ManifestEntry, MediaPath
from ..errors import ConfigError, one_of
from ..tasks.conditioning import CONDITIONING_KINDS, Keyframe, Reference
from ..tasks.table import (
    FRAME_RULE,
    PARTITIONS,
    SAMPLE_TASKS,
    TRAINING_TASKS,
    VAE_FRAMES_PER_CHUNK,
    VAE_LATENTS_PER_CHUNK,
    frame_counts_around,
    is_frame_count,
    partition_tasks,
)

if TYPE_CHECKING:
    import torch

    from ..config import Config, SampleRequestConfig

# `(index, field)` -> the message prefix naming a request's field: `validation.samples[i].field` for the
# config's, a line of a requests file for `h3train generate`'s.
Where = Callable[[int, str], str]

_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_RESOLUTION = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")
CANVAS_MULTIPLE = 32
# 17 n + 5 frames with n >= 1: 7 latent frames, the fewest the video VAE decoder takes.
MIN_CHUNKS = 1
# Pixels per latent along each spatial axis: the video VAE's downsampling.
VAE_SPATIAL_FACTOR = 16


@dataclass(frozen=True)
class SampleRequest:
    """One checked request; `keyframes` / `references` as the manifest parser builds them (absolute paths)."""

    index: int
    sample_id: str
    prompt: str
    task: str
    num_frames: int
    height: int
    width: int
    seed: int
    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()

    def manifest_entry(self) -> ManifestEntry:
        """The request as a manifest entry, for the encoder's recipes; it has no target clip."""
        return ManifestEntry(
            line=self.index + 1,
            sample_id=self.sample_id,
            video=MediaPath(relative="", path=Path()),
            prompt=self.prompt,
            task=self.task,
            keyframes=self.keyframes,
            references=self.references,
        )

    def fingerprint(self) -> dict[str, Any]:
        """Everything its encoding depends on from the request: media files by name, size and mtime."""
        entry = self.manifest_entry().fingerprint()
        del entry["video"]
        return {**entry, "num_frames": self.num_frames, "height": self.height, "width": self.width}


def parse_resolution(i: int, text: str, where: Where = _where) -> tuple[int, int]:
    """`WIDTHxHEIGHT` -> `(height, width)`, both positive multiples of 32."""
    match = _RESOLUTION.fullmatch(text or "")
    if match is None:
        raise ConfigError(f"{where(i, 'resolution')} is {text!r}; write WIDTHxHEIGHT in pixels, e.g. 1344x768")
    width, height = int(match[1]), int(match[2])
    if not width or not height or width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
        raise ConfigError(
            f"{where(i, 'resolution')} is {text!r}; width and height must be positive multiples of "
            f"{CANVAS_MULTIPLE} (one packed row covers 32x32 pixels)"
        )
    return height, width


def latent_shape(num_latent_frames: int, latent_height: int, latent_width: int) -> dict[str, Any]:
    """The request fields (`frames`, `resolution`) of a clip of this latent shape, as the pipeline counts it.

    `5 n + 2` latent frames are `17 n + 5` pixel frames; a count between two of them takes the next
    (so the clip holds at least what was trained), and at least `MIN_CHUNKS` chunks (22 frames), the
    fewest the decoder takes. Each latent is 16x16 pixels, rounded up to the 32-pixel canvas multiple.
    """
    chunks = max(MIN_CHUNKS, -(-(num_latent_frames - 2) // VAE_LATENTS_PER_CHUNK))
    frames = VAE_FRAMES_PER_CHUNK * chunks + VAE_LATENTS_PER_CHUNK

    def pixels(latents: int) -> int:
        return max(1, -(-latents * VAE_SPATIAL_FACTOR // CANVAS_MULTIPLE)) * CANVAS_MULTIPLE

    return {"frames": frames, "resolution": f"{pixels(latent_width)}x{pixels(latent_height)}"}


def _frames(i: int, frames: int, where: Where = _where) -> int:
    if not is_frame_count(frames, MIN_CHUNKS):
        below, above = frame_counts_around(frames, MIN_CHUNKS)
        hint = f"e.g. {below} or {above}" if below != above else f"at least {below}"
        raise ConfigError(
            f"{where(i, 'frames')} is {frames}; it takes {FRAME_RULE} frames with n >= {MIN_CHUNKS} "
            f"({hint}; 124 is 5 s at 24 fps)"
        )
    return frames


def _media(i: int, name: str, value: Any, where: Where = _where) -> MediaPath:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where(i, name)} is {value!r}; give the path of a file")
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{where(i, name)}: file '{value}' does not exist")
    return MediaPath(relative=value, path=path)


def _field_error(i: int, name: str, problem: str, where: Where = _where) -> ConfigError:
    return ConfigError(f"{where(i, name)} {problem}")


def parse_request(i: int, item: SampleRequestConfig, where: Where = _where) -> SampleRequest:
    """Check one request's values (its paths are absolute by now) and return it; `where` names its fields."""
    sample_id = item.id or f"sample_{i}"
    if not _ID_PATTERN.fullmatch(sample_id):
        raise ConfigError(f"{where(i, 'id')} is {item.id!r}; use letters, digits, '.', '_' or '-' (it names the file)")
    if item.task not in SAMPLE_TASKS:
        raise ConfigError(f"{where(i, 'task')} is {item.task!r}; {one_of(item.task, SAMPLE_TASKS)}")
    # The one conditioning field the task takes (`SampleTask.conditioning`); the others are refused.
    taken = SAMPLE_TASKS[item.task].conditioning
    conditioning: dict[str, tuple] = {}
    for name, kind in CONDITIONING_KINDS.items():
        value = getattr(item, name)
        if name == taken:
            media, fail = partial(_media, i, where=where), partial(_field_error, i, where=where)
            conditioning[name] = kind.parse_request(value, media, fail)
        elif value:
            raise _field_error(i, name, f"are for {kind.sample_task} requests, this one is {item.task}", where)
    height, width = parse_resolution(i, item.resolution, where)
    if item.seed < 0:
        raise ConfigError(f"{where(i, 'seed')} must be >= 0, got {item.seed}")
    return SampleRequest(
        index=i,
        sample_id=sample_id,
        prompt=item.prompt,
        task=item.task,
        **conditioning,
        num_frames=_frames(i, item.frames, where),
        height=height,
        width=width,
        seed=item.seed,
    )


def parse_requests(cfg: Config) -> list[SampleRequest]:
    """Every request of `validation.samples`, checked; ids are unique."""
    requests = [parse_request(i, item) for i, item in enumerate(cfg.validation.samples)]
    seen: dict[str, int] = {}
    for request in requests:
        if request.sample_id in seen:
            first = seen[request.sample_id]
            raise ConfigError(
                f"{_where(request.index, 'id')} '{request.sample_id}' is already used by {KEY}[{first}]; "
                "give one of them another id (it names the file)"
            )
        seen[request.sample_id] = request.index
    return requests


def text_encoder_dtype(cfg: Config) -> torch.dtype:
    """The text encoder's dtype for the requests: float32 for a float32 run, else bfloat16."""
    import torch

    return torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16


def served_tasks(cfg: Config) -> tuple[str, ...]:
    """The request tasks diffusers runs on the partition this run trains (all three for a mixed random init)."""
    task = TRAINING_TASKS.get(cfg.task.name)
    partition = task.partition if task is not None else None
    if partition is not None:
        return partition_tasks(partition)
    if cfg.model.config or not cfg.model.pretrained or not cfg.model.subfolder:
        # A random init serves every task; a pretrained mixed run without a subfolder is refused elsewhere.
        return tuple(SAMPLE_TASKS)
    subfolder = Path(cfg.model.subfolder).name
    return partition_tasks(subfolder) if subfolder in PARTITIONS else tuple(SAMPLE_TASKS)


def validate_samples(cfg: Config, planning: bool = False) -> None:
    """`validation.samples`, `sample_every`, `components`, `num_inference_steps`, `reference_short_edge`.

    `planning` (`h3train check` away from the run's files): a components folder not here is planned
    for (the plan says it is not readable), not required.
    """
    v = cfg.validation
    if v.sample_every < 0:
        raise ConfigError(f"config key 'validation.sample_every' must be >= 0 (0: off), got {v.sample_every}")
    if not v.samples:
        if v.sample_every:
            raise ConfigError(
                "config key 'validation.sample_every' renders validation.samples, which is empty; "
                "add requests or set validation.sample_every=0"
            )
        return
    if not (v.sample_every or v.at_start):
        raise ConfigError(
            "config key 'validation.samples' is set but never rendered: set validation.sample_every "
            "(steps) and/or validation.at_start=true"
        )
    if v.num_inference_steps < 2:
        raise ConfigError(
            f"config key 'validation.num_inference_steps' must be >= 2 (sigma grid points, the terminal 0 "
            f"included), got {v.num_inference_steps}"
        )
    if v.reference_short_edge < CANVAS_MULTIPLE or v.reference_short_edge % CANVAS_MULTIPLE:
        raise ConfigError(
            f"config key 'validation.reference_short_edge' must be a positive multiple of 32, got "
            f"{v.reference_short_edge}"
        )
    if not v.components:
        raise ConfigError(
            "config key 'validation.components' must name the encoder's components folder to render "
            "validation.samples (the folder 'h3train encode --components' takes)"
        )
    from ..data.components import ComponentsError, check_components_folder

    if not (planning and not Path(v.components).exists()):
        try:
            check_components_folder(v.components)
        except ComponentsError as exc:
            raise ConfigError(f"config key 'validation.components': {exc}") from None
    served = served_tasks(cfg)
    for request in parse_requests(cfg):
        if request.task not in served:
            raise ConfigError(
                f"{_where(request.index, 'task')} is {request.task}, which diffusers runs on the other partition "
                f"than this run trains ({', '.join(served)} requests); drop it or render it in a run of that partition"
            )
