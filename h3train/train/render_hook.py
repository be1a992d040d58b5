"""`validation.samples`: render each request with the live model every `sample_every` steps (and at start).

Before the first step, global rank 0 encodes the requests that are not cached yet with the encoder's
components on the CPU (`render/request_encoding.py`), writes them under `<logging.dir>/samples/requests/` and
drops the text encoder; every rank then reads them. The VAEs stay loaded on the CPU on every rank and
visit the accelerator only while a clip is decoded.

A render: request `i` is rendered by DP group `i % dp`, every rank of the group running diffusers'
core denoise blocks with the live sharded model (`pipeline.py`), all SP ranks on the same request.
FSDP2's collectives need every rank of a sharding group to run the same number of forwards, so a
group with fewer requests repeats one without writing it (as `HeldOutLoss` pads its samples). The
group's SP rank 0 decodes and writes `<logging.dir>/samples/step_N/<id>.mp4` (never over an existing
file: a second render of the same step gets `<id>.2.mp4`), and rank 0 logs the clips to wandb.

The request's generator is seeded by its seed alone, so a request renders the same noise at every
step; the default RNG is forked around a render and nothing is drawn from a training generator, no
gradient is kept and the model returns to train mode, so training is the same with or without it.
`validation.use_ema` renders with the EMA weights.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config import Config
from ..data.sampler import assigned_indices
from ..errors import ConfigError, H3TrainError
from ..render.pipeline import LiveTransformer, decode, denoise, fresh_path, render_line, render_pipeline, write_clip
from ..render.request_encoding import (
    Conditioning,
    encode_request,
    encode_settings,
    load_conditioning,
    request_digest,
    save_conditioning,
)
from ..render.requests import KEY, parse_requests, text_encoder_dtype
from .hooks import TrainerHook, TrainerView

SAMPLES_DIR = "samples"
REQUESTS_DIR = "requests"


def load_vaes(root: str | Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The video and audio VAEs of a components folder, on the CPU in eval mode."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    from ..data.components import ComponentsError
    from ..infra.quiet import known_notices

    try:
        vae = AutoencoderKLMiniMaxH3.from_pretrained(root, subfolder="vae", local_files_only=True)
        with known_notices():
            audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(root, subfolder="audio_vae", local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ComponentsError(f"components folder '{root}': {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    return vae.eval().requires_grad_(False), audio_vae.eval().requires_grad_(False)


class SampleRenderer(TrainerHook):
    """Renders `validation.samples` at start (`at_start`) and every `sample_every` steps."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.v = cfg.validation
        self.requests = parse_requests(cfg)
        self.root = Path(cfg.logging.dir) / SAMPLES_DIR
        self.text_dtype = text_encoder_dtype(cfg)
        self.conditioning: list[Conditioning] = []
        self.transformer: LiveTransformer | None = None
        self.pipe = None
        # The files the last render wrote, by request id, in request order (every rank knows them).
        self.files: dict[str, Path] = {}

    # -- start-up --------------------------------------------------------------------------------

    def on_fit_start(self, trainer: TrainerView) -> None:
        self.prepare(trainer)
        if self.v.at_start and trainer.step == 0:
            self.render(trainer, 0)

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        if self.v.sample_every and step % self.v.sample_every == 0:
            self.render(trainer, step)

    def prepare(self, trainer: TrainerView) -> None:
        """Encode the requests (rank 0, those not cached yet), load them on every rank, build the pipeline."""
        from ..data.components import components_fingerprint

        trainer.phase = f"encoding {KEY}"
        components_id = components_fingerprint(self.v.components)
        settings = [encode_settings(r, self.v.reference_short_edge) for r in self.requests]
        digests = [request_digest(r, components_id, self.text_dtype, s) for r, s in zip(self.requests, settings)]
        paths = [self.root / REQUESTS_DIR / f"{r.sample_id}.safetensors" for r in self.requests]
        vaes, failure = None, None
        # Rank 0 says whether the requests are ready (None) or the exit code the others leave with.
        outcome: list[Any] = [None]
        if trainer.ctx.is_main:
            try:
                vaes = self._encode_missing(paths, digests, settings)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or they wait on rank 0
                failure = exc
                outcome[0] = exc.exit_code if isinstance(exc, H3TrainError) else 1
        dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise SystemExit(outcome[0])
        for request, path, digest in zip(self.requests, paths, digests):
            cond = load_conditioning(path, request, digest)
            if cond is None:
                raise ConfigError(
                    f"{KEY}: rank {trainer.ctx.rank} cannot read '{path}', which rank 0 wrote; "
                    "logging.dir must be one folder that every rank sees"
                )
            self.conditioning.append(cond)
        vae, audio_vae = vaes or load_vaes(self.v.components)
        self.transformer = LiveTransformer(trainer.model, trainer.model.transformer.config, trainer.device)
        self.pipe = render_pipeline(self.transformer, trainer.device, vae, audio_vae)

    def _encode_missing(self, paths: list[Path], digests: list[str], settings: list) -> tuple | None:
        """Rank 0: encode the requests whose cache is missing or stale; return the VAEs if it loaded them."""
        missing = [
            i for i, (r, p, d) in enumerate(zip(self.requests, paths, digests)) if load_conditioning(p, r, d) is None
        ]
        if not missing:
            return None
        from ..data.components import load_components
        from ..encode import build_pipeline
        from ..encode.media import MediaError

        components = load_components(self.v.components, "cpu", self.text_dtype)
        for i in tqdm(
            missing, desc=f"encode {KEY}", unit="request", disable=None if self.cfg.logging.progress else True
        ):
            request = self.requests[i]
            try:
                cond = encode_request(build_pipeline(components, settings[i]), request, settings[i])
            except (MediaError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                raise ConfigError(f"config key '{KEY}[{request.index}]' ({request.sample_id}): {reason}") from None
            save_conditioning(paths[i], cond, digests[i])
        vaes = components.vae, components.audio_vae
        # The text encoder serves only the encoding: it is let go here.
        del components
        gc.collect()
        return vaes

    # -- rendering -------------------------------------------------------------------------------

    def render(self, trainer: TrainerView, step: int) -> dict[str, Path]:
        """Render every request after step `step` (0: before training); returns the files, by id, on every rank."""
        ctx, model = trainer.ctx, trainer.model
        folder = self.root / f"step_{step}"
        slots = assigned_indices(len(self.conditioning), ctx.dp_rank, ctx.dims.dp)
        steps = self.v.num_inference_steps
        if ctx.is_main:
            tqdm.write(render_line(len(self.requests), step, steps, folder), file=sys.stderr)
        written: dict[str, str] = {}
        assert self.transformer is not None and self.pipe is not None
        self.transformer.forwards = 0
        was_training = model.training
        model.eval()
        weights = trainer.evaluation_weights(self.v.use_ema)
        devices = [torch.cuda.current_device()] if trainer.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), weights:
                for index in slots:
                    counted = index is not None
                    cond = self.conditioning[index if counted else 0]
                    trainer.phase = f"rendering validation sample {cond.request.sample_id} after step {step}"
                    shown = ctx.is_main and counted and self.cfg.logging.progress
                    bar = {
                        "desc": f"sample {cond.request.sample_id}",
                        "leave": False,
                        "disable": None if shown else True,
                    }
                    state = denoise(self.pipe, cond, steps, bar)
                    if counted and ctx.sp_rank == 0:
                        written[cond.request.sample_id] = str(self._write(trainer, folder, cond, state))
        finally:
            model.train(was_training)
        trainer.phase = f"gathering the validation samples of step {step}"
        gathered: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, written)
        found = {name: Path(path) for part in gathered for name, path in (part or {}).items()}
        self.files = {r.sample_id: found[r.sample_id] for r in self.requests}
        captions = {r.sample_id: r.prompt for r in self.requests}
        trainer.log_videos(step, {name: (path, captions[name]) for name, path in self.files.items()})
        if ctx.is_main:
            listed = ", ".join(str(path) for path in self.files.values())
            tqdm.write(f"validation samples after step {step}: {listed}", file=sys.stderr)
        return self.files

    def _write(self, trainer: TrainerView, folder: Path, cond: Conditioning, state: Any) -> Path:
        """Decode on the accelerator (the VAEs visit it only for this) and write the mp4 (and latents)."""
        pipe = self.pipe
        pipe.vae.to(trainer.device)
        pipe.audio_vae.to(trainer.device)
        try:
            frames, audio, rate = decode(pipe, state)
        finally:
            pipe.vae.to("cpu")
            pipe.audio_vae.to("cpu")
            if trainer.device.type == "cuda":
                torch.cuda.empty_cache()
        path = write_clip(folder, cond.request.sample_id, frames, audio, rate)
        if self.v.save_latents:
            from ..infra.atomic import atomic_save_file

            latents = {"video": state.get("latents").float().cpu(), "audio": state.get("audio_latents").float().cpu()}
            target = fresh_path(folder, f"{path.stem}.latents", ".safetensors")
            atomic_save_file(
                {k: t.contiguous() for k, t in latents.items()}, target, metadata={"id": cond.request.sample_id}
            )
        return path
