"""`h3train generate`: render prompts with a trained result, alone or beside its base (`--compare`).

The SOURCE (`render/weights.py`) is loaded onto the base of a pipeline folder (`--components`): a LoRA file
through diffusers' own loader (`MiniMaxH3LoraLoaderMixin.load_lora_weights`, which converts the ComfyUI
format on load), a transformer folder with `from_pretrained`; a run or checkpoint is first exported
into a temporary folder (`export_checkpoint`) and loaded as that export. Without SOURCE the base alone
renders. Requests render through the training renderer's path (`pipeline.py`: diffusers' core denoise
blocks, then `MiniMaxH3DecodeStep`), conditioning encoded by its recipes (`conditioning.py`).

`--compare`: the base renders each request with the same generator, hence the same initial noise,
and one mp4 holds both (`side_by_side.py`: base left, fine-tune right, each under a labelled bar) with
two audio streams, stream 0 the base's (title `base`), stream 1 the fine-tune's (title `fine-tune`).
A LoRA's base is the same model with its adapters disabled; a transformer folder's is the partition
of `--components`.

Retention, as validation measures it (`train/validation.py`), on each request at the first denoising
step (the initial noise, the first sigma): `g = p(c) - p(neg)`, the conditional prediction minus the
encoder's negative prompt's (its vision blocks kept), over every row each model returns, per modality;
`ratio = ||g|| / ||g_base||`, `cos = <g, g_base> / (||g|| ||g_base||)`. Each costs one more forward per
model (the negative's, stopped after that forward).

Under torchrun each rank renders requests `i % WORLD_SIZE == RANK` on `cuda:LOCAL_RANK`, with no
process group. Files: one request writes `--out` itself; several write `<out stem>.<id>.mp4` beside it.
An existing file is never replaced: the next free name (`<name>.2.mp4`, ...) is taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import SAMPLE_FIELDS, SampleRequestConfig
from ..errors import ConfigError, UsageError
from ..infra.quiet import diffusers_log_level
from ..render.requests import SampleRequest, parse_request
from ..render.weights import WeightsSource
from ..tasks.table import partition_tasks
from ..train.validation import MODALITIES, guidance_retention, guidance_sums

# `--compare`'s audio streams, in order.
TRACK_TITLES = ("base", "fine-tune")
# Where a request's shape comes from when neither the flags nor the SOURCE say: `SampleRequestConfig`'s defaults.
RELEASED_SHAPE = "the released model's default"
# The type of each request field, for a line of a requests file (JSON has no schema of its own).
_FIELD_TYPES = {f.name: type(f.default) for f in dataclasses.fields(SampleRequestConfig) if f.name in SAMPLE_FIELDS}


# -- requests ----------------------------------------------------------------------------------------


def read_requests(prompts: Sequence[str], requests_file: Path | None, defaults: dict[str, Any]) -> list[SampleRequest]:
    """`--prompt`s (t2va, with `defaults`), or the lines of a JSONL requests file (fields of
    `validation.samples`, `defaults` for those a line omits; relative media paths are relative to the
    file's folder). Each problem is one `ConfigError` naming the flag, or the file, line and field."""
    from ..config.load import anchor_sample_paths

    requests = []
    if requests_file is None:
        for i, prompt in enumerate(prompts):
            item = SampleRequestConfig(**{**defaults, "id": f"prompt_{i}", "prompt": prompt})
            requests.append(parse_request(i, item, lambda _i, name: f"--{name}"))
        return _unique(requests, lambda r: f"--prompt {r.index + 1}")
    try:
        lines = requests_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--requests '{requests_file}' cannot be read: {exc}") from None
    rows = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise UsageError(f"--requests '{requests_file}' holds no request; write one JSON object per line")
    for n, line in rows:

        def where(_i: int, name: str | None = None, n: int = n) -> str:
            return f"'{requests_file}' line {n}" + (f" field '{name}'" if name else "")

        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where(0)} is not JSON ({exc.msg}); write one object per line") from None
        anchor_sample_paths({"validation": {"samples": [row]}}, requests_file.parent, "requests file", key=where)
        for name, value in row.items():
            want = _FIELD_TYPES[name]
            if want in (str, int) and not (isinstance(value, want) and not isinstance(value, bool)):
                raise ConfigError(
                    f"{where(0, name)} is {value!r}; expected {'a string' if want is str else 'an integer'}"
                )
        item = SampleRequestConfig(**{**defaults, "id": f"line_{n}", **row})
        requests.append(parse_request(n - 1, item, where))
    return _unique(requests, lambda r: f"'{requests_file}' line {r.index + 1}")


def _unique(requests: list[SampleRequest], where) -> list[SampleRequest]:
    seen: dict[str, SampleRequest] = {}
    for request in requests:
        if request.sample_id in seen:
            raise ConfigError(
                f"{where(request)}: id '{request.sample_id}' is already used by {where(seen[request.sample_id])}; "
                "give one of them another id (it names the file)"
            )
        seen[request.sample_id] = request
    return requests


def request_partition(source: WeightsSource | None, requests: list[SampleRequest]) -> str:
    """The partition every request renders with: the source's, else the one the requests' tasks share."""
    from ..tasks.table import PARTITIONS

    served = {p: partition_tasks(p) for p in PARTITIONS}
    partition = source.partition if source is not None else None
    if partition is None:
        partition = next((p for p in PARTITIONS if all(r.task in served[p] for r in requests)), None)
        if partition is None:
            raise UsageError(
                "the requests mix tasks of both partitions (t2va / fl2va: transformer, ref2va: transformer_ref); "
                "generate those of each partition in a run of their own"
            )
    for r in requests:
        if r.task not in served[partition]:
            raise UsageError(
                f"request '{r.sample_id}' is {r.task}, which the {partition} partition does not render "
                f"(it renders {', '.join(served[partition])}), and SOURCE adapts {partition}; drop the request"
            )
    return partition


def out_stems(out: Path, requests: list[SampleRequest]) -> dict[str, str]:
    """File stem of each request by id: `--out`'s for a single request, `<stem>.<id>` for several."""
    if len(requests) == 1:
        return {requests[0].sample_id: out.stem}
    return {r.sample_id: f"{out.stem}.{r.sample_id}" for r in requests}


# -- the models ---------------------------------------------------------------------------------------


@dataclass
class Rendered:
    """One request's render: frames `[T, H, W, 3]` uint8 and soundtrack `[2, N]` of the fine-tune (of the
    base without SOURCE); with `--compare` the base's too and the retention (`guidance`: modality ->
    `(ratio, cos)`)."""

    request: SampleRequest
    frames: np.ndarray
    audio: torch.Tensor
    rate: int
    base_frames: np.ndarray | None = None
    base_audio: torch.Tensor | None = None
    guidance: dict[str, tuple[float | None, float | None]] | None = None

    def clip(self) -> tuple[np.ndarray, list[torch.Tensor], tuple[str, ...]]:
        """What the mp4 holds: its frames, its audio streams, their titles."""
        if self.base_frames is None or self.base_audio is None:
            return self.frames, [self.audio], ()
        from ..render.side_by_side import side_by_side

        return side_by_side(self.base_frames, self.frames), [self.base_audio, self.audio], TRACK_TITLES


class _FirstForward(Exception):
    """Carries the first forward's `(video, audio)` out of the denoise loop."""

    def __init__(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.outputs = outputs


@contextlib.contextmanager
def _first_forward(model: torch.nn.Module, stop: bool) -> Iterator[list]:
    """Record the first forward's outputs (float64, CPU) into the yielded list; `stop`: end the loop there."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_module, _args, output):
        if not seen:
            seen.append(tuple(o.detach().double().cpu() for o in output[:2]))
            if stop:
                raise _FirstForward(seen[0])

    handle = model.register_forward_hook(hook)
    # Each modular block logs an exception that passes through it as an error; the one that stops is ours.
    try:
        with diffusers_log_level(logging.CRITICAL) if stop else contextlib.nullcontext():
            yield seen
    finally:
        handle.remove()


class Generator:
    """The loaded models of one `h3train generate`: the fine-tune (or the base alone) and, to compare, its base."""

    def __init__(
        self,
        source: WeightsSource | None,
        components: Path,
        partition: str,
        device: torch.device,
        dtype: torch.dtype,
        steps: int,
        compare: bool,
    ) -> None:
        from ..render.pipeline import render_pipeline
        from ..train.render_hook import load_vaes

        self.components, self.device, self.dtype, self.steps = components, device, dtype, steps
        self.partition = partition
        vae, audio_vae = load_vaes(components)
        self.vae, self.audio_vae = vae.to(device), audio_vae.to(device)
        self.lora = False
        self.lora_file: Path | None = None
        self.base_pipe = None
        with tempfile.TemporaryDirectory(prefix="h3train-generate-") as tmp:
            tuned = self._load(source, Path(tmp)) if source is not None else self._base()
            self.pipe = render_pipeline(tuned, device, self.vae, self.audio_vae)
            if self.lora_file is not None:
                self._load_lora(self.lora_file)
        if compare and not self.lora:
            self.base_pipe = render_pipeline(self._base(), device, self.vae, self.audio_vae)
        self.compare = compare

    def _base(self) -> torch.nn.Module:
        return self._transformer(self.components, subfolder=self.partition)

    def _transformer(self, folder: Path, subfolder: str | None = None) -> torch.nn.Module:
        """A frozen transformer from a diffusers folder, in eval mode on the device and dtype rendered with."""
        from diffusers import MiniMaxH3Transformer3DModel

        model = MiniMaxH3Transformer3DModel.from_pretrained(
            folder, subfolder=subfolder, torch_dtype=self.dtype, local_files_only=True
        )
        return model.to(self.device).eval().requires_grad_(False)

    def _load(self, source: WeightsSource, tmp: Path) -> torch.nn.Module:
        """The model SOURCE makes, on the base; a LoRA file is loaded once the pipeline exists (`lora_file`)."""
        if source.kind in ("run", "checkpoint"):
            source = _exported(source, tmp)
        if source.kind == "lora":
            self.lora, self.lora_file = True, source.path
            return self._base()
        return self._transformer(source.path)

    def _load_lora(self, file: Path) -> None:
        # Both pipeline slots hold the one partition loaded, so the loader's note that it chose one is moot.
        try:
            with diffusers_log_level(logging.ERROR):
                self.pipe.load_lora_weights(
                    str(file.parent),
                    weight_name=file.name,
                    load_into_transformer_ref=self.partition == "transformer_ref",
                )
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UsageError(f"SOURCE '{file}' does not load onto {self.components}/{self.partition}: {exc}") from None
        self.pipe.transformer.eval().requires_grad_(False)

    @contextlib.contextmanager
    def _as_base(self) -> Iterator[Any]:
        """The pipeline that renders the base: the LoRA's own with its adapters off, else the base's."""
        if not self.lora:
            yield self.base_pipe
            return
        from ..train.validation import adapters_disabled

        with adapters_disabled(self.pipe.transformer):
            yield self.pipe

    def encode(self, requests: list[SampleRequest], reference_short_edge: int | None = None) -> list:
        """Each request's conditioning, by the encoder's recipes on `--components`; the text encoder is let go after."""
        from ..data.components import encode_preset, load_components
        from ..encode import build_pipeline
        from ..encode.media import MediaError
        from ..render.request_encoding import encode_request, encode_settings

        short_edge = reference_short_edge or (encode_preset(self.components) or {}).get("reference_short_edge", 2048)
        components = load_components(self.components, self.device, self.dtype)
        out = []
        for r in requests:
            settings = encode_settings(r, int(short_edge))
            try:
                out.append(encode_request(build_pipeline(components, settings), r, settings))
            except (MediaError, ValueError) as exc:
                raise ConfigError(
                    f"request '{r.sample_id}': {f'{type(exc).__name__}: {exc}'.splitlines()[0]}"
                ) from None
        del components
        gc.collect()
        return out

    @torch.no_grad()
    def render(self, cond) -> Rendered:
        """Render one request with the fine-tune and, comparing, with the base (same generator, same noise)."""
        tuned = self._render(self.pipe, cond)
        if not self.compare:
            return Rendered(cond.request, *tuned[:3])
        with self._as_base() as pipe:
            base = self._render(pipe, cond)
        guidance = {}
        for m, name in enumerate(MODALITIES):
            g, g_base = tuned[3][m], base[3][m]
            guidance[name] = guidance_retention(*(float(v) for v in guidance_sums(g, g_base)))
        return Rendered(cond.request, tuned[0], tuned[1], tuned[2], base[0], base[1], guidance)

    def _render(self, pipe, cond) -> tuple:
        """Frames, audio, rate and, comparing, `g` per modality at the first step (float64, CPU)."""
        from ..render.pipeline import decode, denoise

        model = pipe.transformer
        if not self.compare:
            frames, audio, rate = decode(pipe, denoise(pipe, cond, self.steps))
            return frames, audio, rate, None
        with _first_forward(model, stop=False) as first:
            state = denoise(pipe, cond, self.steps)
        frames, audio, rate = decode(pipe, state)
        negative = dataclasses.replace(cond, prompt_embeds=cond.negative[0], text_token_tags=cond.negative[1])
        try:
            with _first_forward(model, stop=True):
                denoise(pipe, negative, self.steps)
        except _FirstForward as stopped:
            guide = tuple(p.flatten() - n.flatten() for p, n in zip(first[0], stopped.outputs))
        else:
            raise RuntimeError("the denoise loop ran no forward")
        return frames, audio, rate, guide


def _exported(source: WeightsSource, tmp: Path) -> WeightsSource:
    """A run's or checkpoint's export, in `tmp`: a diffusers LoRA file, or a transformer folder (a full
    fine-tune; a LoRA on a random base, merged into the base it rebuilds)."""
    from ..checkpoint import read_trainer_state
    from ..export.transformer import export_checkpoint
    from ..lora.base import read_record

    assert source.checkpoint is not None
    state = read_trainer_state(source.checkpoint)
    merge = state.get("lora") is not None and (read_record(state) or {}).get("kind") == "random"
    summary = export_checkpoint(source.checkpoint, tmp / "export", merge=merge)
    kind = "lora" if summary.path.is_file() else "transformer"
    return WeightsSource(kind, summary.path, partition=summary.partition)


# -- the command -------------------------------------------------------------------------------------


def rank_share(n: int) -> tuple[list[int], int, int]:
    """The request indices this process renders under torchrun (`i % WORLD_SIZE == RANK`), rank, world."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return [i for i in range(n) if i % world == rank], rank, world


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def guidance_line(rendered: Rendered) -> str:
    """`<id>: guidance ratio video 0.98 audio 1.01, cos video 0.99 audio 1.00 (fine-tune vs base, first step)`."""
    assert rendered.guidance is not None

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    ratio = " ".join(f"{m} {fmt(rendered.guidance[m][0])}" for m in MODALITIES)
    cos = " ".join(f"{m} {fmt(rendered.guidance[m][1])}" for m in MODALITIES)
    return (
        f"{rendered.request.sample_id}: guidance ratio {ratio}, cos {cos} "
        "(fine-tune against base, first denoising step)"
    )


def generate(
    source: WeightsSource | None,
    components: Path,
    requests: list[SampleRequest],
    out: Path,
    *,
    steps: int,
    compare: bool,
    device: torch.device,
    dtype: torch.dtype,
    reference_short_edge: int | None = None,
) -> list[Path]:
    """Render this rank's share of `requests` into files beside `out`; returns the files written."""
    from ..render.pipeline import write_clip
    from ..train.metrics.console_sink import format_duration

    partition = request_partition(source, requests)
    mine, rank, world = rank_share(len(requests))
    stems = out_stems(out, requests)
    who = f"rank {rank}: " if world > 1 else ""
    if not mine:
        return []
    generator = Generator(source, components, partition, device, dtype, steps, compare)
    conditioning = generator.encode([requests[i] for i in mine], reference_short_edge)
    written, start = [], time.monotonic()
    for k, cond in enumerate(conditioning, start=1):
        rendered = generator.render(cond)
        frames, tracks, titles = rendered.clip()
        path = write_clip(out.parent, stems[cond.request.sample_id], frames, tracks, rendered.rate, titles)
        written.append(path)
        elapsed = time.monotonic() - start
        left = elapsed / k * (len(conditioning) - k)
        print(
            f"{who}[{k}/{len(conditioning)}] {cond.request.sample_id}: {path} "
            f"(elapsed {format_duration(elapsed)}, eta {format_duration(left)})",
            flush=True,
        )
        if rendered.guidance is not None:
            print(f"{who}{guidance_line(rendered)}", flush=True)
    return written


def shape_words(requests: Sequence[SampleRequest]) -> str:
    """`96x64, 22 frames (0.9 s at 24 fps)`: the shape the requests render at, each distinct one once."""
    from ..encode.media import FPS

    shapes = dict.fromkeys((r.width, r.height, r.num_frames) for r in requests)
    return "; ".join(f"{w}x{h}, {n} frames ({n / FPS:.1f} s at {FPS} fps)" for w, h, n in shapes)


def announce(
    source: WeightsSource | None,
    components: Path,
    requests: Sequence[SampleRequest],
    steps: int,
    compare: bool,
    origin: str = "",
) -> str:
    """The line printed before the models load: what renders, at what size and length, with what.

    `origin`: where the shape of a request that sets neither `frames` nor `resolution` came from (empty
    when the flags set both)."""
    what = "the base" if source is None else f"{source.kind} '{source.path}'"
    if source is not None and source.chosen is not None:
        what += f" ({source.checkpoint}: {source.chosen})"
    side = ", beside the base" if compare else ""
    n = len(requests)
    said = f", {origin} (--resolution and --frames set another)" if origin else ""
    return (
        f"rendering {shape_words(requests)}{said}: {n} request{'s' * (n != 1)} with {what} on {components}"
        f"{side}, {steps} steps"
    )
