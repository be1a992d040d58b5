"""The conditioning kinds: one object per way a clip is conditioned besides its prompt.

A sample task names its conditioning (`SampleTask.conditioning` in `tasks/table.py`): `keyframes`
(fl2va: first / last frames) or `references` (ref2va: image, video and audio references); t2va has
none. Each kind here says, for its own field, how a manifest line and a render request write it,
what a cached sample's header and tensors hold of it, how it packs into conditioning rows and which
layout builder lays them out, how the encoder makes its latents from media (`encoder`), and what
diffusers' core denoise blocks take from it. The manifest, the render requests, the encoder, the
cached-sample format, the packed layout and the renderer loop over `CONDITIONING_KINDS` instead of
testing the task, so a new kind is one entry, added with `register_conditioning_kind`, and the sample
task that takes it (`tasks/table.py`).

The table sits beneath its readers (the packed sample, the data, the renderer). The encoder's recipe
runs media through diffusers' pipeline blocks with the data package's decoders, so an entry names it
(`module:function`) and the encoder imports it, rather than this module importing upwards.

`field` is both the manifest / request field and the name of the sample attribute holding the
parsed items (`ManifestEntry.keyframes`, `CachedSample.references`, ...). Errors are made by the
caller's `fail(field, problem)`, so each reader keeps its own one-line message form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config.schema import register_entry
from ..errors import did_you_mean_each, one_of
from .layout import (
    AUDIO_CHANNELS,
    AUDIO_LATENT_CHANNELS,
    VIDEO_LATENT_CHANNELS,
    Geometry,
    Layout,
    ReferenceSpec,
    packed_layout,
    ref2va_layout,
)
from .table import FRAME_RULE, SAMPLE_TASKS, VAE_LATENTS_PER_CHUNK, sample_task_of

ANCHORS = ("first", "last")
REFERENCE_KINDS = ("image", "video", "audio")


class CheckedMedia(Protocol):
    """A checked media file as the reader's `media` gives it (`encode.manifest.MediaPath`)."""

    relative: str
    path: Path

    def fingerprint(self) -> dict[str, Any]: ...


# `fail(field, problem)`: the reader's one-line error for a field. `media(field, value)`: a checked file.
Fail = Callable[[str, str], Exception]
Media = Callable[[str, Any], CheckedMedia]


class Shapes(Protocol):
    """Checks a tensor's shape against a pattern such as `(24, 1, "H", "W")`, symbols bound across calls."""

    def check(self, name: str, shape: tuple[int, ...], pattern: tuple[int | str, ...]) -> None: ...


@dataclass(frozen=True)
class Keyframe:
    """One fl2va anchor (`first` / `last`); `image` None means the clip's own first or last frame."""

    anchor: str
    image: CheckedMedia | None = None


@dataclass(frozen=True)
class Reference:
    """One ref2va reference: `kind` is `image | video | audio`."""

    kind: str
    media: CheckedMedia


@dataclass
class ReferenceLatents:
    """One ref2va reference in request order.

    `video` `[24, f, h, w]` for an image (`f = 1`) or a video; `audio` `[2, 32, n]` for an audio
    reference or a video's soundtrack (None for a silent video).
    """

    kind: str
    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None

    @property
    def has_audio(self) -> bool:
        return self.kind == "audio" or (self.kind == "video" and self.audio is not None)


class ConditioningKind:
    """One conditioning field: its parsing, its cached header and tensors, its rows and pipeline inputs.

    Sample objects (`CachedSample`, the renderer's `Conditioning`) hold the kind's items as attributes
    (`header_field` for what the header lists, `field` for the latents); the methods read those.
    `encoder`: the encoder's recipe, `module:function`, called as `(pipe, entry, settings, frames
    [N, H, W, 3] uint8) -> (the sample's attributes of the kind, the prompts)` (`encode/clip.py`).
    """

    field: str
    header_field: str
    encoder: str

    @property
    def name(self) -> str:
        """The kind's key in `CONDITIONING_KINDS`: its field."""
        return self.field

    @property
    def sample_task(self) -> str:
        return sample_task_of(self.field)

    def parse_manifest(self, value: Any, media: Media, fail: Fail) -> tuple:
        """A manifest line's field (None when absent) -> the entry's items."""
        raise NotImplementedError

    def parse_request(self, value: Any, media: Media, fail: Fail) -> tuple:
        """A render request's field (as the config holds it) -> the request's items."""
        raise NotImplementedError

    def check_header(self, items: list, takes: bool, fail: Fail) -> None:
        """Check the header's list of this kind; `takes` is whether the sample's task takes the kind."""
        raise NotImplementedError

    def tensor_names(self, items: list) -> set[str]:
        """The tensors a sample file holds for the header's `items`."""
        raise NotImplementedError

    def check_shapes(
        self, items: list, specs: Mapping[str, Any], target: Shapes, fresh: Callable[[], Shapes], fail: Fail
    ) -> None:
        """Check the shapes of this kind's tensors: `target` has the target's symbols bound, `fresh()` none."""
        raise NotImplementedError

    def header(self, sample: Any) -> dict[str, Any]:
        """`{header_field: [...]}` for a sample file's header."""
        raise NotImplementedError

    def tensors(self, sample: Any) -> dict[str, torch.Tensor]:
        """The sample's tensors of this kind by file field name."""
        raise NotImplementedError

    def from_file(self, items: list, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The sample's attributes of this kind from the header's `items` and the file's tensors."""
        raise NotImplementedError

    def visual_latents(self, sample: Any) -> list[torch.Tensor]:
        """Visual conditioning latents `[24, f, h, w]` in packed order."""
        return []

    def sound_latents(self, sample: Any) -> list[torch.Tensor]:
        """Audio conditioning latents `[2, 32, n]` in packed order."""
        return []

    def layout_fields(self, sample: Any) -> dict[str, Any]:
        """`TrainingSample` / `build_layout` keyword arguments of this kind."""
        raise NotImplementedError

    def build_layout(
        self,
        text_token_tags: torch.Tensor,
        geometry: Geometry,
        fields: Mapping[str, Any],
        patch_size: tuple[int, int, int],
    ) -> Layout:
        """The packed layout of a sample of this kind; `fields` holds its `layout_fields`."""
        raise NotImplementedError

    def pipeline_inputs(self, sample: Any, device: torch.device) -> dict[str, Any]:
        """What diffusers' encoder blocks hand the task's core denoise blocks, on `device`."""
        raise NotImplementedError


class KeyframesKind(ConditioningKind):
    """fl2va: the clip's own first and / or last frame, or an image in its place, in packed order."""

    field = "keyframes"
    header_field = "keyframe_anchors"
    encoder = "h3train.encode.clip:encode_keyframes"

    def parse_manifest(self, value: Any, media: Media, fail: Fail) -> tuple[Keyframe, ...]:
        expected = "expected 'first', 'last', 'both', a list of anchors or {anchor: image path or null}"
        if value is None:
            raise fail(self.field, f"is missing; an {self.sample_task} clip needs at least one ({expected})")
        if value == "both":
            value = list(ANCHORS)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            value = {anchor: None for anchor in value} if all(isinstance(a, str) for a in value) else value
        if not isinstance(value, dict) or not value or any(a not in ANCHORS for a in value):
            odd = [str(a) for a in value if a not in ANCHORS] if isinstance(value, (dict, list)) else []
            raise fail(self.field, f"is {value!r}, {expected}{did_you_mean_each(odd, (*ANCHORS, 'both'))}")
        # Packed order is first, then last, whatever order the line wrote them in.
        return tuple(
            Keyframe(anchor, None if value[anchor] is None else media(f"{self.field}.{anchor}", value[anchor]))
            for anchor in ANCHORS
            if anchor in value
        )

    def parse_request(self, value: Any, media: Media, fail: Fail) -> tuple[Keyframe, ...]:
        # A request has no clip of its own, so every anchor names an image.
        odd = [anchor for anchor in value or {} if anchor not in ANCHORS]
        if not value or odd:
            raise fail(
                self.field,
                f"is {dict(value or {})!r}; an {self.sample_task} request maps 'first' and/or 'last' to a "
                f"keyframe image{did_you_mean_each(odd, ANCHORS)}",
            )
        return tuple(
            Keyframe(anchor, media(f"{self.field}.{anchor}", value[anchor])) for anchor in ANCHORS if anchor in value
        )

    def check_header(self, items: list, takes: bool, fail: Fail) -> None:
        name = f"metadata.{self.header_field}"
        if any(a not in ANCHORS for a in items):
            raise fail(name, f"is {items}, expected entries 'first' or 'last'")
        if takes != bool(items):
            raise fail(name, f"is {items}: {self.sample_task} samples need at least one anchor, other tasks none")

    def tensor_names(self, items: list) -> set[str]:
        return {f"keyframe.{i}" for i in range(len(items))}

    def check_shapes(
        self, items: list, specs: Mapping[str, Any], target: Shapes, fresh: Callable[[], Shapes], fail: Fail
    ) -> None:
        for i in range(len(items)):
            target.check(f"keyframe.{i}", specs[f"keyframe.{i}"].shape, (VIDEO_LATENT_CHANNELS, 1, "H", "W"))

    def header(self, sample: Any) -> dict[str, Any]:
        return {self.header_field: list(sample.keyframe_anchors)}

    def tensors(self, sample: Any) -> dict[str, torch.Tensor]:
        return {f"keyframe.{i}": k for i, k in enumerate(sample.keyframes)}

    def from_file(self, items: list, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "keyframe_anchors": tuple(items),
            "keyframes": tuple(tensors[f"keyframe.{i}"] for i in range(len(items))),
        }

    def visual_latents(self, sample: Any) -> list[torch.Tensor]:
        return list(sample.keyframes)

    def layout_fields(self, sample: Any) -> dict[str, Any]:
        return {"keyframe_anchors": tuple(sample.keyframe_anchors)}

    def build_layout(
        self,
        text_token_tags: torch.Tensor,
        geometry: Geometry,
        fields: Mapping[str, Any],
        patch_size: tuple[int, int, int],
    ) -> Layout:
        return packed_layout(text_token_tags, geometry, fields["keyframe_anchors"], patch_size)

    def pipeline_inputs(self, sample: Any, device: torch.device) -> dict[str, Any]:
        return {
            "keyframe_anchors": tuple(sample.keyframe_anchors),
            "condition_latents": [k[None].to(device) for k in sample.keyframes],
        }


class ReferencesKind(ConditioningKind):
    """ref2va: image, video and audio references in request order, which is the packed order."""

    field = "references"
    header_field = "references"
    encoder = "h3train.encode.clip:encode_references"

    def _checked(self, value: Any, media: Media, fail: Fail, expected: str) -> tuple[Reference, ...]:
        refs = []
        for i, ref in enumerate(value):
            name = f"{self.field}[{i}]"
            if not isinstance(ref, Mapping) or set(ref) != {"kind", "path"}:
                odd = sorted(str(k) for k in set(ref) - {"kind", "path"}) if isinstance(ref, Mapping) else []
                raise fail(name, f"is {ref!r}, {expected}{did_you_mean_each(odd, ('kind', 'path'))}")
            if ref["kind"] not in REFERENCE_KINDS:
                raise fail(f"{name}.kind", f"is {ref['kind']!r}; {one_of(str(ref['kind']), REFERENCE_KINDS)}")
            refs.append(Reference(ref["kind"], media(f"{name}.path", ref["path"])))
        return tuple(refs)

    def parse_manifest(self, value: Any, media: Media, fail: Fail) -> tuple[Reference, ...]:
        if not isinstance(value, list) or not value:
            raise fail(self.field, f"is {value!r}, expected a non-empty list of {{kind, path}} objects")
        return self._checked(value, media, fail, "expected {'kind': image|video|audio, 'path': ...}")

    def parse_request(self, value: Any, media: Media, fail: Fail) -> tuple[Reference, ...]:
        if not value:
            raise fail(self.field, f"is empty; a {self.sample_task} request needs at least one reference")
        refs = self._checked(value, media, fail, "expected {'kind': image|video|audio, 'path': ...}")
        # As in diffusers' Ref2VA setup step: an audio reference must come with a visual one.
        if all(ref.kind == "audio" for ref in refs):
            raise fail(self.field, "are all audio; diffusers' H3 needs an image or video one too")
        return refs

    def check_header(self, items: list, takes: bool, fail: Fail) -> None:
        for i, ref in enumerate(items):
            name = f"metadata.{self.header_field}[{i}]"
            if (
                not isinstance(ref, dict)
                or ref.get("kind") not in REFERENCE_KINDS
                or not isinstance(ref.get("has_audio"), bool)
            ):
                raise fail(name, f"is {ref!r}, expected {{'kind': image|video|audio, 'has_audio': bool}}")
            fixed = {"image": False, "audio": True}.get(ref["kind"])
            if fixed is not None and ref["has_audio"] != fixed:
                raise fail(name, f"is {ref!r}: an {ref['kind']} reference has has_audio={fixed}")
        name = f"metadata.{self.header_field}"
        if takes != bool(items):
            raise fail(name, f"must list the references of a {self.sample_task} sample, and be empty for other tasks")
        if items and all(r["kind"] == "audio" for r in items):
            raise fail(name, "holds only audio references; pair them with an image or video reference")

    def tensor_names(self, items: list) -> set[str]:
        names = set()
        for i, ref in enumerate(items):
            if ref["kind"] in ("image", "video"):
                names.add(f"ref.{i}.video")
            if ref["has_audio"]:
                names.add(f"ref.{i}.audio")
        return names

    def check_shapes(
        self, items: list, specs: Mapping[str, Any], target: Shapes, fresh: Callable[[], Shapes], fail: Fail
    ) -> None:
        # Each reference has a canvas of its own, so each gets a checker of its own.
        for i, ref in enumerate(items):
            _check_reference_shapes(i, ref["kind"], specs, fresh, fail)

    def header(self, sample: Any) -> dict[str, Any]:
        return {self.header_field: [{"kind": r.kind, "has_audio": r.has_audio} for r in sample.references]}

    def tensors(self, sample: Any) -> dict[str, torch.Tensor]:
        out = {}
        for i, ref in enumerate(sample.references):
            if ref.video is not None:
                out[f"ref.{i}.video"] = ref.video
            if ref.audio is not None:
                out[f"ref.{i}.audio"] = ref.audio
        return out

    def from_file(self, items: list, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "references": tuple(
                ReferenceLatents(r["kind"], tensors.get(f"ref.{i}.video"), tensors.get(f"ref.{i}.audio"))
                for i, r in enumerate(items)
            )
        }

    def visual_latents(self, sample: Any) -> list[torch.Tensor]:
        return [r.video for r in sample.references if r.video is not None]

    def sound_latents(self, sample: Any) -> list[torch.Tensor]:
        return [r.audio for r in sample.references if r.audio is not None]

    def layout_fields(self, sample: Any) -> dict[str, Any]:
        return {
            "references": tuple(reference_spec(r.kind, _shape(r.video), _shape(r.audio)) for r in sample.references)
        }

    def build_layout(
        self,
        text_token_tags: torch.Tensor,
        geometry: Geometry,
        fields: Mapping[str, Any],
        patch_size: tuple[int, int, int],
    ) -> Layout:
        return ref2va_layout(text_token_tags, geometry, fields["references"], patch_size)

    def pipeline_inputs(self, sample: Any, device: torch.device) -> dict[str, Any]:
        refs = sample.references
        return {
            # The layout reads only `kind` and `has_audio` of each normalized reference.
            "normalized_references": list(refs),
            "condition_latents": [ref.video[None].to(device) for ref in refs if ref.video is not None],
            # `MiniMaxH3Ref2VAReferenceEncoderStep` packs a `[2, 32, n]` soundtrack channel-major into `[2 n, 32]`.
            "audio_condition_latents": [
                ref.audio.transpose(1, 2).reshape(-1, ref.audio.shape[1]).to(device)
                for ref in refs
                if ref.audio is not None
            ],
        }


def _check_reference_shapes(
    i: int, kind: str, specs: Mapping[str, Any], fresh: Callable[[], Shapes], fail: Fail
) -> None:
    video, audio = f"ref.{i}.video", f"ref.{i}.audio"
    if video in specs:
        frames = 1 if kind == "image" else "f"
        fresh().check(video, specs[video].shape, (VIDEO_LATENT_CHANNELS, frames, "h", "w"))
        _, f, h, w = specs[video].shape
        if kind == "video" and f % VAE_LATENTS_PER_CHUNK != 2:
            raise fail(video, f"has {f} latent frames, expected 5 n + 2 (a {FRAME_RULE} frame clip)")
        if h < 2 or w < 2 or h % 2 or w % 2:
            raise fail(video, f"has latent size {h}x{w}, expected even sizes (2x2 patches)")
    if audio in specs:
        fresh().check(audio, specs[audio].shape, (AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, "n"))
        if specs[audio].shape[-1] < 1:
            raise fail(audio, "holds no audio latents")


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def reference_spec(
    kind: str, video_shape: tuple[int, ...] | None, audio_shape: tuple[int, ...] | None
) -> ReferenceSpec:
    """The layout's view of one reference from its latents' shapes (None for a latent it lacks)."""
    frames, height, width = video_shape[1:] if video_shape is not None else (0, 0, 0)
    return ReferenceSpec(
        kind=kind,
        has_audio=audio_shape is not None,
        latent_frames=frames,
        latent_height=height,
        latent_width=width,
        num_audio_latents=audio_shape[-1] if audio_shape is not None else 0,
    )


CONDITIONING_KINDS: dict[str, ConditioningKind] = {}


def register_conditioning_kind(kind: ConditioningKind) -> ConditioningKind:
    """Add `kind` to the table under its field; a sample task takes it by naming that field."""
    return register_entry(CONDITIONING_KINDS, kind, "conditioning kind", None)


for _kind in (KeyframesKind(), ReferencesKind()):
    register_conditioning_kind(_kind)


def conditioning_of(task: str) -> ConditioningKind | None:
    """The conditioning kind a sample task takes (None: prompt only)."""
    field = SAMPLE_TASKS[task].conditioning
    return None if field is None else CONDITIONING_KINDS[field]


def merged(each: Callable[[ConditioningKind], dict[str, Any]]) -> dict[str, Any]:
    """`each(kind)` of every kind in one dict (each kind writes fields of its own)."""
    return {name: value for kind in CONDITIONING_KINDS.values() for name, value in each(kind).items()}
