"""The cached-sample file: one safetensors file per sample, its tensors and its JSON header.

A sample file holds plain tensors (no pickle) and a JSON header under the metadata key `h3train`:

    video_latents              [24, F, H, W]  float32  target, normalized VAE latents
    audio_latents              [2, 32, F_a]   float32  target, stereo channel-first (zeros allowed
                                                       when `has_audio` is false)
    prompt_embeds              [L, D]         float    Qwen3-VL hidden state of the presentation
    text_token_tags            [L]            int64    0 for vision tokens, 1 for text
    negative_prompt_embeds     [L', D]        float    the negative prompt " ", text only
    negative_text_token_tags   [L']           int64
    negative_visual_prompt_embeds   [L'', D]  float    optional: " " with the vision blocks kept
    negative_visual_text_token_tags [L'']     int64    (present together or not at all)
    keyframe.{i}               [24, 1, H, W]  float32  fl2va: one per anchor, in anchor order
    ref.{i}.video              [24, f, h, w]  float32  ref2va: image (f = 1) and video reference i
    ref.{i}.audio              [2, 32, n]     float32  ref2va: audio reference i, or video i's soundtrack

Reference numbers `i` are positions in the request order, which is the packed order. The header
records the task, anchors, references `[{kind, has_audio}]`, `has_audio`, `num_frames` (pixel frames,
`17 n + 5` at 24 fps) and the latent geometry, all checked against the tensors on read and on write.

The header also records a digest of every tensor's stored bytes (`DIGESTS_KEY`, `h3train/infra/digest.py`),
checked whenever the tensors are read: bytes changed after writing are a `SampleError` naming the
tensor, not values trained on. A file is read whole into this process's memory (no memory map), so
one truncated or rewritten under a running job fails its read instead of raising SIGBUS in a later step.

Any problem raises `SampleError` with a one-line message naming the file and the field.

A dataset folder lists its samples in `index.jsonl` (`dataset_index.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    audio_latent_num_frames,
    video_latent_num_frames,
)

from ..errors import SampleError
from ..infra.atomic import atomic_save_file
from ..infra.digest import ALGORITHM, digest_bytes, digest_file, digest_tensor
from ..tasks.conditioning import CONDITIONING_KINDS, ReferenceLatents, merged
from ..tasks.layout import (
    AUDIO_CHANNELS,
    AUDIO_LATENT_CHANNELS,
    VIDEO_LATENT_CHANNELS,
    Geometry,
    audio_latents_to_rows,
    video_latents_to_rows,
)
from ..tasks.sample import TrainingSample, build_layout
from ..tasks.table import (
    FRAME_RULE,
    SAMPLE_TASKS,
    VAE_FRAMES_PER_CHUNK,
    VAE_LATENTS_PER_CHUNK,
    is_frame_count,
)
from .location import SampleLocation

FORMAT_VERSION = 1
METADATA_KEY = "h3train"
# In the metadata JSON: `{"algorithm": ..., "tensors": {name: digest}}` of every tensor's stored bytes
# (inside the one metadata entry: safetensors writes several entries in no fixed order).
DIGESTS_KEY = "digests"
# safetensors' own limit on a header's size.
_MAX_HEADER = 100 * 1024 * 1024

_LATENT_DTYPES = (torch.float32,)
_EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TAG_DTYPES = (torch.int64,)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NEGATIVE_VISUAL = ("negative_visual_prompt_embeds", "negative_visual_text_token_tags")


def _fail(where: str, field_name: str, problem: str) -> SampleError:
    return SampleError(f"sample '{where}': field '{field_name}' {problem}")


@dataclass
class CachedSample:
    """The tensors and header of one sample file, before packing (see the module docstring for shapes)."""

    sample_id: str
    task: str
    num_frames: int
    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    prompt_embeds: torch.Tensor
    text_token_tags: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    negative_text_token_tags: torch.Tensor
    has_audio: bool = True
    keyframe_anchors: tuple[str, ...] = ()
    keyframes: tuple[torch.Tensor, ...] = ()
    references: tuple[ReferenceLatents, ...] = ()
    negative_visual_prompt_embeds: torch.Tensor | None = None
    negative_visual_text_token_tags: torch.Tensor | None = None
    source: str | None = None

    @property
    def geometry(self) -> Geometry:
        return _geometry(tuple(self.video_latents.shape), tuple(self.audio_latents.shape))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's tensors by field name."""
        out = {
            "video_latents": self.video_latents,
            "audio_latents": self.audio_latents,
            "prompt_embeds": self.prompt_embeds,
            "text_token_tags": self.text_token_tags,
            "negative_prompt_embeds": self.negative_prompt_embeds,
            "negative_text_token_tags": self.negative_text_token_tags,
        }
        if self.negative_visual_prompt_embeds is not None:
            out["negative_visual_prompt_embeds"] = self.negative_visual_prompt_embeds
        if self.negative_visual_text_token_tags is not None:
            out["negative_visual_text_token_tags"] = self.negative_visual_text_token_tags
        return out | merged(lambda kind: kind.tensors(self))

    def metadata(self) -> dict[str, Any]:
        """The JSON header."""
        geo = self.geometry
        return {
            "version": FORMAT_VERSION,
            "sample_id": self.sample_id,
            "task": self.task,
            "num_frames": int(self.num_frames),
            "has_audio": bool(self.has_audio),
            **merged(lambda kind: kind.header(self)),
            "geometry": _geometry_json(geo),
            "source": self.source,
        }

    def to_packed(self) -> TrainingSample:
        """Pack into model rows in the pipeline's order (`MiniMaxH3Ref2VAPrepareLatentsStep` and kin).

        video rows: keyframes in anchor order, or visual references in request order, then the target.
        audio rows: audio-bearing references (audio clips and video soundtracks) in request order, then
        the target.
        """
        kinds = CONDITIONING_KINDS.values()
        visual = [latents for kind in kinds for latents in kind.visual_latents(self)]
        sounds = [latents for kind in kinds for latents in kind.sound_latents(self)]
        return TrainingSample(
            sample_id=self.sample_id,
            task=self.task,
            geometry=self.geometry,
            video_rows=torch.cat([video_latents_to_rows(v) for v in (*visual, self.video_latents)]),
            audio_rows=torch.cat([audio_latents_to_rows(a) for a in (*sounds, self.audio_latents)]),
            prompt_embeds=self.prompt_embeds,
            text_token_tags=self.text_token_tags,
            has_audio=self.has_audio,
            **merged(lambda kind: kind.layout_fields(self)),
            negative_prompt_embeds=self.negative_prompt_embeds,
            negative_text_token_tags=self.negative_text_token_tags,
            negative_visual_prompt_embeds=self.negative_visual_prompt_embeds,
            negative_visual_text_token_tags=self.negative_visual_text_token_tags,
        )


def _geometry(video_shape: tuple[int, ...], audio_shape: tuple[int, ...]) -> Geometry:
    """Target geometry from `video_latents` `[24, F, H, W]` and `audio_latents` `[2, 32, F_a]` shapes."""
    _, frames, height, width = video_shape
    return Geometry(int(frames), int(height), int(width), int(audio_shape[-1]))


def _geometry_json(geo: Geometry) -> dict[str, int]:
    return {
        "num_latent_frames": geo.num_latent_frames,
        "latent_height": geo.latent_height,
        "latent_width": geo.latent_width,
        "num_audio_latents": geo.num_audio_latents,
    }


# --------------------------------------------------------------------------------------------------
# Validation. It runs on the header (metadata + tensor shapes and dtypes) so that the index can be
# built without loading tensors, and on the values once they are loaded.


@dataclass
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class SampleHeader:
    """A sample's validated metadata and tensor specs: enough to plan without loading tensors.

    As a `CachedSample` does, it holds the conditioning kinds' items as attributes (`keyframe_anchors`,
    `references`), so each kind's `layout_fields` reads it.
    """

    meta: dict[str, Any]
    specs: dict[str, _TensorSpec]

    @property
    def geometry(self) -> Geometry:
        return _geometry(self.specs["video_latents"].shape, self.specs["audio_latents"].shape)

    @property
    def keyframe_anchors(self) -> tuple[str, ...]:
        return tuple(self.meta["keyframe_anchors"])

    @property
    def references(self) -> tuple[ReferenceLatents, ...]:
        """The references with their latents' specs in place of the tensors: the layout reads only shapes."""
        return tuple(
            ReferenceLatents(r["kind"], self.specs.get(f"ref.{i}.video"), self.specs.get(f"ref.{i}.audio"))
            for i, r in enumerate(self.meta["references"])
        )

    def seq_len(self) -> int:
        """Packed sequence length, from diffusers' builders (tag values do not change the length), with each
        conditioning kind's rows as its `layout_fields` give them."""
        text_len = self.specs["text_token_tags"].shape[0]
        tags = torch.ones(text_len, dtype=torch.long)
        layout = build_layout(self.meta["task"], tags, self.geometry, **merged(lambda kind: kind.layout_fields(self)))
        return layout.seq_len


class _Shapes:
    """Checks shapes against patterns like `(24, "F", "H", "W")`, binding each symbol on first use."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.bound: dict[str, tuple[int, str]] = {}

    def check(self, name: str, shape: tuple[int, ...], pattern: tuple[int | str, ...]) -> None:
        expected = "[" + ", ".join(str(p) for p in pattern) + "]"
        if len(shape) != len(pattern):
            raise _fail(self.where, name, f"has shape {list(shape)}, expected {expected}")
        for size, want in zip(shape, pattern):
            if isinstance(want, int):
                if size != want:
                    raise _fail(self.where, name, f"has shape {list(shape)}, expected {expected}")
            elif want in self.bound and self.bound[want][0] != size:
                value, origin = self.bound[want]
                raise _fail(
                    self.where,
                    name,
                    f"has shape {list(shape)}, expected {expected} with {want}={value} (from '{origin}')",
                )
            else:
                self.bound.setdefault(want, (size, name))


def _check_dtype(where: str, name: str, spec: _TensorSpec, allowed: tuple[torch.dtype, ...]) -> None:
    if spec.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise _fail(where, name, f"has dtype {str(spec.dtype).removeprefix('torch.')}, expected {names}")


def _meta_value(where: str, meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in meta:
        raise _fail(where, f"metadata.{key}", "is missing")
    value = meta[key]
    # bool is an int subclass; a count written as `true` is a bug, not a 1.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise _fail(where, f"metadata.{key}", f"is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


def _check_task_metadata(where: str, meta: Mapping[str, Any]) -> None:
    version = _meta_value(where, meta, "version", int)
    if version != FORMAT_VERSION:
        raise _fail(where, "metadata.version", f"is {version}, this reader understands {FORMAT_VERSION}")
    if not _meta_value(where, meta, "sample_id", str):
        raise _fail(where, "metadata.sample_id", "is empty")
    task = _meta_value(where, meta, "task", str)
    if task not in SAMPLE_TASKS:
        raise _fail(where, "metadata.task", f"is {task!r}, expected one of {', '.join(SAMPLE_TASKS)}")
    num_frames = _meta_value(where, meta, "num_frames", int)
    if not is_frame_count(num_frames):
        raise _fail(where, "metadata.num_frames", f"is {num_frames}, expected {FRAME_RULE} pixel frames")
    _meta_value(where, meta, "has_audio", bool)
    if meta.get("source") is not None:
        _meta_value(where, meta, "source", str)

    # A sample carries a kind's items exactly when its task takes that conditioning.
    taken = SAMPLE_TASKS[task].conditioning
    for kind in CONDITIONING_KINDS.values():
        items = _meta_value(where, meta, kind.header_field, list)
        kind.check_header(items, kind.field == taken, partial(_fail, where))


def _expected_fields(meta: Mapping[str, Any], present: set[str]) -> set[str]:
    fields = {
        "video_latents",
        "audio_latents",
        "prompt_embeds",
        "text_token_tags",
        "negative_prompt_embeds",
        "negative_text_token_tags",
    }
    # The visual negative pair is optional, but only as a pair.
    if present & set(_NEGATIVE_VISUAL):
        fields |= set(_NEGATIVE_VISUAL)
    return fields | _conditioning_fields(meta)


def _conditioning_fields(meta: Mapping[str, Any]) -> set[str]:
    return {name for kind in CONDITIONING_KINDS.values() for name in kind.tensor_names(meta[kind.header_field])}


def check_header(where: str, meta: Any, specs: dict[str, _TensorSpec]) -> SampleHeader:
    """Validate metadata, field names, shapes and dtypes, and their agreement. Raises `SampleError`."""
    if not isinstance(meta, dict):
        raise _fail(where, "metadata", f"is {type(meta).__name__}, expected a JSON object")
    _check_task_metadata(where, meta)

    expected = _expected_fields(meta, set(specs))
    missing, unexpected = sorted(expected - set(specs)), sorted(set(specs) - expected)
    if missing:
        raise _fail(where, missing[0], "is missing")
    if unexpected:
        raise _fail(where, unexpected[0], f"is not part of a {meta['task']} sample with this metadata")

    shapes = _Shapes(where)
    shapes.check("video_latents", specs["video_latents"].shape, (VIDEO_LATENT_CHANNELS, "F", "H", "W"))
    shapes.check("audio_latents", specs["audio_latents"].shape, (AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, "F_a"))
    for embeds, tags, length in (
        ("prompt_embeds", "text_token_tags", "L"),
        ("negative_prompt_embeds", "negative_text_token_tags", "L'"),
        (*_NEGATIVE_VISUAL, "L''"),
    ):
        if embeds in specs:
            shapes.check(embeds, specs[embeds].shape, (length, "D"))
            shapes.check(tags, specs[tags].shape, (length,))
            _check_dtype(where, embeds, specs[embeds], _EMBED_DTYPES)
            _check_dtype(where, tags, specs[tags], _TAG_DTYPES)
            if specs[tags].shape[0] < 1:
                raise _fail(where, tags, "is empty; a prompt has at least one token")
    for kind in CONDITIONING_KINDS.values():
        kind.check_shapes(meta[kind.header_field], specs, shapes, lambda: _Shapes(where), partial(_fail, where))
    for name in ("video_latents", "audio_latents", *sorted(_conditioning_fields(meta))):
        _check_dtype(where, name, specs[name], _LATENT_DTYPES)

    header = SampleHeader(meta=meta, specs=specs)
    _check_geometry(where, meta, header.geometry)
    return header


def _check_geometry(where: str, meta: Mapping[str, Any], geo: Geometry) -> None:
    num_frames = meta["num_frames"]
    want_frames = video_latent_num_frames(num_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    want_audio = audio_latent_num_frames(num_frames)
    if geo.num_latent_frames != want_frames:
        raise _fail(
            where,
            "video_latents",
            f"has {geo.num_latent_frames} latent frames, expected {want_frames} for num_frames={num_frames}",
        )
    if geo.num_audio_latents != want_audio:
        raise _fail(
            where,
            "audio_latents",
            f"has {geo.num_audio_latents} latents per channel, expected {want_audio} for num_frames={num_frames}",
        )
    if geo.latent_height < 2 or geo.latent_width < 2 or geo.latent_height % 2 or geo.latent_width % 2:
        raise _fail(
            where,
            "video_latents",
            f"has latent size {geo.latent_height}x{geo.latent_width}, expected even sizes (2x2 patches)",
        )
    recorded = _meta_value(where, meta, "geometry", dict)
    if recorded != _geometry_json(geo):
        raise _fail(where, "metadata.geometry", f"is {recorded}, the tensors have {_geometry_json(geo)}")


def check_values(where: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Finite floats and 0/1 token tags. Raises `SampleError`.

    Each tensor is first checked by one reduction that allocates nothing: the sum of a float tensor
    is non-finite whenever one value is (NaN and inf propagate through it), and integer tags lie in
    {0, 1} exactly when their min and max do. Only a float tensor whose sum is not finite is scanned
    element by element, so the error still counts what is wrong; a sum that overflows on finite
    values passes that scan.
    """
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        if t.is_floating_point():
            if bool(torch.isfinite(t.sum())):
                continue
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise _fail(where, name, f"holds {bad} non-finite values (NaN or inf)")
        elif name.endswith("token_tags"):
            # Integer tags (int64, checked with the header) are all 0 or 1 exactly when min and max are.
            low, high = torch.aminmax(t)
            if int(low) < 0 or int(high) > 1:
                raise _fail(where, name, "holds tags other than 0 (vision) and 1 (text)")


def _spec_of(t: torch.Tensor) -> _TensorSpec:
    return _TensorSpec(tuple(t.shape), t.dtype)


# --------------------------------------------------------------------------------------------------
# Files.


def write_sample(path: str | os.PathLike, sample: CachedSample) -> None:
    """Validate and write one sample file atomically.

    The file is written under a hidden temporary name in the same folder, flushed to disk, then
    renamed over `path`, so a reader never sees a partial file under the final name.
    """
    path = Path(path)
    where = str(path)
    tensors = sample.tensors()
    meta = sample.metadata()
    check_header(where, meta, {name: _spec_of(t) for name, t in tensors.items()})
    check_values(where, tensors)
    # safetensors refuses views that share storage (a keyframe sliced from the target, say).
    payload = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    digests = {"algorithm": ALGORITHM, "tensors": {name: digest_tensor(t) for name, t in payload.items()}}
    atomic_save_file(payload, path, metadata={METADATA_KEY: json.dumps({**meta, DIGESTS_KEY: digests})})


def as_location(source: str | os.PathLike | SampleLocation) -> SampleLocation:
    """`source` as a `SampleLocation`: a path is a sample's own file."""
    return source if isinstance(source, SampleLocation) else SampleLocation(Path(source))


def _read(where: str, at: SampleLocation, whole: bool) -> tuple[dict[str, Any], bytearray, int]:
    """The safetensors header of the sample `at` as JSON, the bytes read and where the tensor data starts.

    Plain reads into this process's memory, the whole sample when `whole`, else the header alone:
    nothing stays backed by the file, so a file changed or truncated under a running job is a
    `SampleError` when read, never a signal when a step touches its tensors. A sample in a shard is
    read within its bytes alone: a header that claims more is a truncated sample.
    """
    if at.store is not None:
        data = _read_remote(where, at, whole)
        return _parsed(where, data)
    if not at.path.is_file():
        raise SampleError(f"sample '{where}': file does not exist")
    try:
        with open(at.path, "rb") as handle:
            end = os.fstat(handle.fileno()).st_size if at.length < 0 else at.offset + at.length
            handle.seek(at.offset)
            size = max(end - at.offset, 0) if whole else min(8, max(end - at.offset, 0))
            data = bytearray(size)
            got = handle.readinto(data)
            del data[got:]
            if not whole and got == 8:
                left = end - at.offset - 8
                data += handle.read(max(min(int.from_bytes(data, "little"), _MAX_HEADER, left), 0))
    except OSError as exc:
        raise SampleError(f"sample '{where}': cannot be read ({exc.strerror or exc})") from None
    return _parsed(where, data)


# A remote sample's header is read with the first bytes after it: one ranged GET for most samples.
_REMOTE_HEAD = 1 << 16


def _read_remote(where: str, at: SampleLocation, whole: bool) -> bytearray:
    """The bytes of a sample on object storage: all of them when `whole`, else its header (and what follows
    it in the first read)."""
    assert at.store is not None
    key = at.path.as_posix()
    try:
        if whole:
            # A sample file of its own is read to its end: one GET, no HEAD for its size first.
            return bytearray(at.store.read(key, at.offset, at.length if at.length >= 0 else None))
        size = at.length if at.length >= 0 else int(at.store.info(key)["size"])
        head = bytearray(at.store.read(key, at.offset, min(size, _REMOTE_HEAD)))
        need = 8 + (int.from_bytes(head[:8], "little") if len(head) >= 8 else 0)
        if len(head) < min(need, size, 8 + _MAX_HEADER):
            head += at.store.read(key, at.offset + len(head), min(need, size) - len(head))
        return head
    except FileNotFoundError:
        raise SampleError(f"sample '{where}': file does not exist") from None
    except SampleError as exc:
        raise SampleError(f"sample '{where}': {str(exc).split(': ', 1)[-1]}") from None


def _parsed(where: str, data: bytearray) -> tuple[dict[str, Any], bytearray, int]:
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if length < 0 or length > _MAX_HEADER or len(data) < 8 + length:
        raise SampleError(f"sample '{where}': not a readable safetensors file (truncated or not safetensors)")
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SampleError(f"sample '{where}': not a readable safetensors file (header: {exc})") from None
    if not isinstance(header, dict):
        raise SampleError(f"sample '{where}': not a readable safetensors file (header is not a JSON object)")
    return header, data, 8 + length


def _entries(where: str, header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in entries.items():
        ok = isinstance(info, dict) and isinstance(info.get("shape"), list) and len(info.get("data_offsets", ())) == 2
        if not ok:
            raise SampleError(f"sample '{where}': not a readable safetensors file (entry '{name}' is malformed)")
    return entries


def _header_of(where: str, header: dict[str, Any]) -> tuple[SampleHeader, dict[str, str] | None]:
    """The validated header, and the per-tensor digests the writer recorded (None for a sample written
    before they were), from one parse of the metadata."""
    metadata = header.get("__metadata__") or {}
    raw = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    if raw is None:
        raise _fail(where, "metadata", f"is missing (no '{METADATA_KEY}' entry in the safetensors header)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _fail(where, "metadata", f"is not valid JSON ({exc})") from None
    record = meta.pop(DIGESTS_KEY, None) if isinstance(meta, dict) else None
    digests = None
    if record is not None:
        try:
            algorithm, digests = record["algorithm"], dict(record["tensors"])
        except (ValueError, KeyError, TypeError):
            raise _fail(where, f"metadata.{DIGESTS_KEY}", "is not a digest record") from None
        if algorithm != ALGORITHM:
            raise _fail(where, f"metadata.{DIGESTS_KEY}", f"uses {algorithm!r}, this reader checks {ALGORITHM!r}")
    specs = {}
    for name, info in _entries(where, header).items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise _fail(where, name, f"has unsupported dtype {info['dtype']}")
        specs[name] = _TensorSpec(tuple(info["shape"]), dtype)
    return check_header(where, meta, specs), digests


def _tensors(
    where: str,
    header: dict[str, Any],
    sample: SampleHeader,
    digests: dict[str, str] | None,
    data: bytearray,
    start: int,
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, checked against its recorded digest, as views of `data` (owned memory).

    `header` is the raw safetensors header (for the offsets), `sample` its validated form (shapes, dtypes).
    """
    offsets = {name: header[name]["data_offsets"] for name in sample.specs}
    end = max((last for _, last in offsets.values()), default=0)
    if len(data) < start + end:
        raise SampleError(
            f"sample '{where}': file is truncated ({len(data)} bytes, its header describes {start + end}); "
            "re-encode it or remove it from the dataset"
        )
    view = memoryview(data)
    tensors = {}
    for name, spec in sample.specs.items():
        first, last = (start + offset for offset in offsets[name])
        if digests is not None and digest_bytes(view[first:last]) != digests.get(name):
            raise _fail(
                where,
                name,
                "does not match the digest recorded when the sample was written (its bytes changed since); "
                "re-encode it or remove it from the dataset",
            )
        if last == first:
            tensors[name] = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            count = (last - first) // spec.dtype.itemsize
            tensors[name] = torch.frombuffer(data, dtype=spec.dtype, count=count, offset=first).reshape(spec.shape)
    return tensors


def read_header(path: str | os.PathLike | SampleLocation) -> SampleHeader:
    """Validate a sample's header (metadata, shapes, dtypes) without loading its tensors."""
    at = as_location(path)
    header, _, _ = _read(str(at), at, whole=False)
    return _header_of(str(at), header)[0]


def verify_sample(path: str | os.PathLike | SampleLocation) -> None:
    """Read the whole sample and check every tensor against its digest; a sample without digests (from
    before they were recorded) fails too. Raises `SampleError`."""
    at = as_location(path)
    header, data, start = _read(str(at), at, whole=True)
    sample, digests = _header_of(str(at), header)
    if digests is None:
        raise _fail(str(at), f"metadata.{DIGESTS_KEY}", "is missing (written before samples recorded digests)")
    _tensors(str(at), header, sample, digests, data, start)


def read_cached_sample(path: str | os.PathLike | SampleLocation) -> CachedSample:
    """Load and fully validate one sample (a file, or its bytes in a shard). Raises `SampleError`."""
    at = as_location(path)
    where = str(at)
    raw, data, start = _read(where, at, whole=True)
    header, digests = _header_of(where, raw)
    tensors = _tensors(where, raw, header, digests, data, start)
    check_values(where, tensors)
    meta = header.meta
    return CachedSample(
        sample_id=meta["sample_id"],
        task=meta["task"],
        num_frames=meta["num_frames"],
        video_latents=tensors["video_latents"],
        audio_latents=tensors["audio_latents"],
        prompt_embeds=tensors["prompt_embeds"],
        text_token_tags=tensors["text_token_tags"],
        negative_prompt_embeds=tensors["negative_prompt_embeds"],
        negative_text_token_tags=tensors["negative_text_token_tags"],
        has_audio=meta["has_audio"],
        **{
            k: v
            for kind in CONDITIONING_KINDS.values()
            for k, v in kind.from_file(meta[kind.header_field], tensors).items()
        },
        negative_visual_prompt_embeds=tensors.get(_NEGATIVE_VISUAL[0]),
        negative_visual_text_token_tags=tensors.get(_NEGATIVE_VISUAL[1]),
        source=meta.get("source"),
    )


def sample_digest(path: str | os.PathLike | SampleLocation) -> str:
    """The digest of a sample's bytes (`infra.digest`): its whole file, or its bytes in a shard (the same
    digest as the file it was cut from)."""
    at = as_location(path)
    if at.store is not None:
        return digest_bytes(_read_remote(str(at), at, whole=True))
    if at.length < 0:
        return digest_file(at.path)
    with open(at.path, "rb") as handle:
        handle.seek(at.offset)
        return digest_bytes(handle.read(at.length))


def read_sample(path: str | os.PathLike | SampleLocation) -> TrainingSample:
    """Load, validate and pack one sample (a file, or its bytes in a shard) into model rows. Raises `SampleError`."""
    return read_cached_sample(path).to_packed()


# --------------------------------------------------------------------------------------------------
# index.jsonl, and the compact index beside it (`index_table.py`)
