"""`validation.samples`: render requests in the encoder manifest's schema, checked before any heavy work.

A request is a manifest entry without a target clip (`h3train/data/manifest.py`): a prompt, a task,
fl2va keyframe images or ref2va references, plus what a clip would have given: `frames` (`17 n + 5`
at 24 fps, n >= 1, since the video VAE decoder needs at least 7 latent frames), `resolution`
(`WIDTHxHEIGHT`, multiples of 32) and the `seed` of the request's generator.

Media paths are made absolute when the config is loaded (`anchor_sample_paths`): a relative path is
relative to the folder of the config file that names it, or to the working directory for a
command-line override. Every problem is a one-line `ConfigError` naming `validation.samples[i].field`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.format import ANCHORS, REFERENCE_KINDS, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK
from ..data.manifest import MANIFEST_TASKS, Keyframe, ManifestEntry, MediaPath, Reference
from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ..config import Config, SampleRequestConfig

KEY = "validation.samples"
_FIELDS = ("id", "prompt", "task", "keyframes", "references", "frames", "resolution", "seed")
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_RESOLUTION = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")
CANVAS_MULTIPLE = 32
# 17 n + 5 frames with n >= 1: 7 latent frames, the fewest the video VAE decoder takes.
MIN_FRAMES = VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


@dataclass(frozen=True)
class SampleRequest:
    """One checked request; `keyframes` / `references` as the manifest parser builds them (absolute paths)."""

    index: int
    sample_id: str
    prompt: str
    task: str
    keyframes: tuple[Keyframe, ...]
    references: tuple[Reference, ...]
    num_frames: int
    height: int
    width: int
    seed: int

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


def _where(i: int, name: str | None = None) -> str:
    return f"config key '{KEY}[{i}]" + (f".{name}'" if name else "'")


def _absolute(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or value.startswith("${"):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def anchor_sample_paths(layer: dict[str, Any], base: Path, origin: str) -> None:
    """Shape-check one config layer's `validation.samples` and make its relative media paths absolute.

    Runs on the plain containers of one layer (the YAML file, or the overrides) before they merge, so a
    wrong shape names its item and field, and each path is taken relative to the layer it came from.
    """
    section = layer.get("validation")
    if not isinstance(section, dict) or section.get("samples") is None:
        return
    samples = section["samples"]
    if isinstance(samples, dict):
        raise ConfigError(f"config key '{KEY}' ({origin}) takes a list of requests, not a section")
    if not isinstance(samples, list):
        samples = section["samples"] = [samples]
    for i, item in enumerate(samples):
        if not isinstance(item, dict):
            raise ConfigError(
                f"{_where(i)} ({origin}) is {item!r}; each request is a mapping such as "
                "{prompt: ..., task: fl2va, keyframes: {first: a.png}, frames: 124, resolution: 1344x768}"
            )
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"{_where(i, unknown[0])} ({origin}) is not a request field (fields: {', '.join(_FIELDS)})"
            )
        keyframes = item.get("keyframes")
        if keyframes is not None:
            if not isinstance(keyframes, dict):
                raise ConfigError(
                    f"{_where(i, 'keyframes')} ({origin}) is {keyframes!r}; it maps an anchor to an image, "
                    "e.g. {first: stills/a.png, last: stills/b.png}"
                )
            item["keyframes"] = {anchor: _absolute(image, base) for anchor, image in keyframes.items()}
        references = item.get("references")
        if references is not None:
            if not isinstance(references, list):
                references = item["references"] = [references]
            for j, ref in enumerate(references):
                if not isinstance(ref, dict) or set(ref) != {"kind", "path"}:
                    raise ConfigError(
                        f"{_where(i, f'references[{j}]')} ({origin}) is {ref!r}; expected "
                        "{kind: image | video | audio, path: ...}"
                    )
                ref["path"] = _absolute(ref["path"], base)


def parse_resolution(i: int, text: str) -> tuple[int, int]:
    """`WIDTHxHEIGHT` -> `(height, width)`, both positive multiples of 32."""
    match = _RESOLUTION.fullmatch(text or "")
    if match is None:
        raise ConfigError(f"{_where(i, 'resolution')} is {text!r}; write WIDTHxHEIGHT in pixels, e.g. 1344x768")
    width, height = int(match[1]), int(match[2])
    if not width or not height or width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
        raise ConfigError(
            f"{_where(i, 'resolution')} is {text!r}; width and height must be positive multiples of "
            f"{CANVAS_MULTIPLE} (one packed row covers 32x32 pixels)"
        )
    return height, width


def _frames(i: int, frames: int) -> int:
    n, rest = divmod(frames - VAE_LATENTS_PER_CHUNK, VAE_FRAMES_PER_CHUNK)
    if frames < MIN_FRAMES or rest:
        below = max(MIN_FRAMES, VAE_FRAMES_PER_CHUNK * n + VAE_LATENTS_PER_CHUNK)
        above = below + VAE_FRAMES_PER_CHUNK if below < frames else below
        hint = f"e.g. {below} or {above}" if below != above else f"at least {MIN_FRAMES}"
        raise ConfigError(
            f"{_where(i, 'frames')} is {frames}; it takes 17 n + 5 frames with n >= 1 ({hint}; 124 is 5 s at 24 fps)"
        )
    return frames


def _media(i: int, name: str, value: Any) -> MediaPath:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{_where(i, name)} is {value!r}; give the path of a file")
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{_where(i, name)}: file '{value}' does not exist")
    return MediaPath(relative=value, path=path)


def parse_request(i: int, item: SampleRequestConfig) -> SampleRequest:
    """Check one request's values (its paths are absolute by now) and return it."""
    sample_id = item.id or f"sample_{i}"
    if not _ID_PATTERN.fullmatch(sample_id):
        raise ConfigError(f"{_where(i, 'id')} is {item.id!r}; use letters, digits, '.', '_' or '-' (it names the file)")
    if item.task not in MANIFEST_TASKS:
        raise ConfigError(f"{_where(i, 'task')} is {item.task!r}; choose one of {', '.join(MANIFEST_TASKS)}")
    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()
    if item.task == "fl2va":
        if not item.keyframes or any(anchor not in ANCHORS for anchor in item.keyframes):
            raise ConfigError(
                f"{_where(i, 'keyframes')} is {dict(item.keyframes)!r}; an fl2va request maps 'first' and/or "
                "'last' to a keyframe image"
            )
        keyframes = tuple(
            Keyframe(anchor, _media(i, f"keyframes.{anchor}", item.keyframes[anchor]))
            for anchor in ANCHORS
            if anchor in item.keyframes
        )
    elif item.keyframes:
        raise ConfigError(f"{_where(i, 'keyframes')} are for fl2va requests, this one is {item.task}")
    if item.task == "ref2va":
        if not item.references:
            raise ConfigError(f"{_where(i, 'references')} is empty; a ref2va request needs at least one reference")
        for j, ref in enumerate(item.references):
            if ref["kind"] not in REFERENCE_KINDS:
                raise ConfigError(
                    f"{_where(i, f'references[{j}].kind')} is {ref['kind']!r}; choose one of "
                    f"{', '.join(REFERENCE_KINDS)}"
                )
        references = tuple(
            Reference(ref["kind"], _media(i, f"references[{j}].path", ref["path"]))
            for j, ref in enumerate(item.references)
        )
        if all(ref.kind == "audio" for ref in references):
            raise ConfigError(f"{_where(i, 'references')} are all audio; diffusers' H3 needs an image or video one too")
    elif item.references:
        raise ConfigError(f"{_where(i, 'references')} are for ref2va requests, this one is {item.task}")
    height, width = parse_resolution(i, item.resolution)
    if item.seed < 0:
        raise ConfigError(f"{_where(i, 'seed')} must be >= 0, got {item.seed}")
    return SampleRequest(
        index=i,
        sample_id=sample_id,
        prompt=item.prompt,
        task=item.task,
        keyframes=keyframes,
        references=references,
        num_frames=_frames(i, item.frames),
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
    from ..tasks.partition import PARTITION_TASKS

    if cfg.task.name == "fl2va":
        return PARTITION_TASKS["transformer"]
    if cfg.task.name == "ref2va":
        return PARTITION_TASKS["transformer_ref"]
    if cfg.model.config or not cfg.model.pretrained or not cfg.model.subfolder:
        # A random init serves every task; a pretrained mixed run without a subfolder is refused elsewhere.
        return MANIFEST_TASKS
    return PARTITION_TASKS.get(Path(cfg.model.subfolder).name, MANIFEST_TASKS)


def validate_samples(cfg: Config) -> None:
    """`validation.samples`, `sample_every`, `components`, `num_inference_steps`, `reference_short_edge`."""
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
