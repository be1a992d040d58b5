"""Rendered samples: the live sharded model through diffusers' H3 blocks, checked against diffusers' pipeline.

One module-wide run trains a tiny model one step under torchrun (2 gloo ranks, sp = 2), rendering two
requests (an fl2va one with both keyframes, a t2va one) before training and after the step. Its saved
latents are compared with `MiniMaxH3ModularPipeline` run on the same weights (the run's random init for
step 0, the exported checkpoint for step 1) with the same request, seed and steps; the mp4s are decoded
with PyAV.
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import pytest
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from PIL import Image
from safetensors.torch import load_file

from h3train.cli import main
from h3train.config import WandbConfig, load_config
from h3train.data.components import COMPONENT_NAMES, TINY_TEXT_HIDDEN, load_components, write_tiny_components
from h3train.data.stand_in import TINY_TRANSFORMER
from h3train.encode.media import load_still, moving_pattern
from h3train.errors import ConfigError
from h3train.model.build import build_model
from h3train.render.pipeline import denoising_steps, render_line, write_clip
from h3train.run.preflight import load_checked
from h3train.train.metrics import MetricsLogger

from helpers.launch import read_metrics, run_forked
from helpers.pipeline import TinyClipPipeline

STEPS = 4  # sigma grid points: three forwards per render
# fl2va: 22 frames (7 latent frames, the fewest the video VAE decodes) on a 96x64 canvas; t2va on 64x64.
REQUESTS = [
    {"id": "drift", "task": "fl2va", "prompt": "a square drifts", "keyframes": {"first": "stills/a.png",
     "last": "stills/b.png"}, "frames": 22, "resolution": "96x64", "seed": 3},
    {"prompt": "a quiet square", "frames": 22, "resolution": "64x64", "seed": 5},
    {"id": "hum", "prompt": "a square hums", "frames": 22, "resolution": "64x64", "seed": 5},
]  # fmt: skip
NAMES = ["drift", "sample_1", "hum"]
MODEL = {**TINY_TRANSFORMER, "text_dim": TINY_TEXT_HIDDEN}  # prompts as wide as the tiny text encoder's


def _config(folder: Path, components: Path, log_dir: Path, requests: list[dict] = REQUESTS, **validation) -> Path:
    """A run config in `folder`; the requests' media paths are relative to it."""
    cfg = {
        "model": {"config": MODEL},
        "task": {"name": "fl2va"},
        "data": {"source": "synthetic", "synthetic": {"num_samples": 4, "text_len": 13, "num_latent_frames": 2,
                                                      "latent_height": 2, "latent_width": 2, "num_audio_latents": 4}},
        "train": {"steps": 1, "seed": 0},
        "optim": {"lr": 1.0e-2, "warmup_steps": 0},
        "checkpoint": {"every": 1},
        "logging": {"dir": str(log_dir), "progress": False},
        "validation": {"at_start": True, "sample_every": 1, "components": str(components),
                       "num_inference_steps": STEPS, "save_latents": True, "samples": requests, **validation},
    }  # fmt: skip
    path = folder / "run.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("components"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("assets")
    (folder / "stills").mkdir()
    for seed, name in ((1, "a.png"), (2, "b.png")):
        Image.fromarray(moving_pattern(1, 60, 90, seed)[0]).save(folder / "stills" / name)
    return folder


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory, components: Path, assets: Path) -> Path:
    run = tmp_path_factory.mktemp("render") / "run"
    run_forked(["train", str(_config(assets, components, run)), "parallel.sp=2"], nproc=2, timeout=240)
    return run


def _pipeline_latents(
    components: Path, transformer: MiniMaxH3Transformer3DModel, request: dict, assets: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own pipeline, end to end (encoders, loop, decoders), on one request."""
    pipe = TinyClipPipeline()
    loaded = load_components(components)
    pipe.update_components(
        **{name: getattr(loaded, name) for name in COMPONENT_NAMES},
        transformer=transformer.eval(),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    width, height = map(int, request["resolution"].split("x"))
    keyframes = request.get("keyframes", {})
    images = {anchor: load_still(assets / path) for anchor, path in keyframes.items()}
    out = pipe(
        prompt=request["prompt"],
        image=images.get("first"),
        last_image=images.get("last"),
        height=height,
        width=width,
        num_frames=request["frames"],
        generator=torch.Generator().manual_seed(request["seed"]),
        num_inference_steps=STEPS,
        output=["latents", "audio_latents"],
    )
    return out["latents"], out["audio_latents"]


@pytest.mark.slow
def test_live_sp2_renders_match_diffusers_pipeline_on_the_same_weights(rendered: Path, components: Path, assets: Path):
    cfg = load_config(rendered / "config.yaml")
    exported = rendered / "export"
    assert main(["export", str(rendered / "checkpoints" / "step_00000001"), "--out", str(exported)]) == 0
    weights = {0: build_model(cfg, cfg.train.seed), 1: MiniMaxH3Transformer3DModel.from_pretrained(exported)}
    names = NAMES
    moved = []
    for step, transformer in weights.items():
        for name, request in zip(names, REQUESTS):
            got = load_file(rendered / "samples" / f"step_{step}" / f"{name}.latents.safetensors")
            video, audio = _pipeline_latents(components, transformer, request, assets)
            assert got["video"].shape == video.shape and got["audio"].shape == audio.shape
            torch.testing.assert_close(got["video"], video, atol=1e-5, rtol=1e-5, msg=f"{name} step {step} video")
            torch.testing.assert_close(got["audio"], audio, atol=1e-5, rtol=1e-5, msg=f"{name} step {step} audio")
            moved.append(got["video"])
    # The step-1 render used the updated weights, not a copy taken at start.
    assert not torch.allclose(moved[0], moved[len(names)], atol=1e-4)
    # Each request was encoded once, into the run folder's cache.
    assert sorted(p.name for p in (rendered / "samples" / "requests").iterdir()) == sorted(
        f"{n}.safetensors" for n in names
    )


@pytest.mark.slow
def test_mp4_has_the_requested_frames_resolution_and_a_stereo_32khz_soundtrack(rendered: Path) -> None:
    for step in (0, 1):
        for name, request in zip(NAMES, REQUESTS):
            width, height = map(int, request["resolution"].split("x"))
            with av.open(str(rendered / "samples" / f"step_{step}" / f"{name}.mp4")) as container:
                # A stream is read only while its container is open: PyAV 18 refuses it after.
                rate = float(container.streams.video[0].average_rate)
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            assert len(frames) == request["frames"] and frames[0].shape == (height, width, 3)
            assert rate == 24
            with av.open(str(rendered / "samples" / f"step_{step}" / f"{name}.mp4")) as container:
                sound = container.streams.audio[0]
                assert (sound.rate, sound.channels) == (32000, 2)
                samples = sum(f.samples for f in container.decode(audio=0))
            # AAC codes whole 1024-sample frames: the decoded track covers the clip to within one.
            assert abs(samples - request["frames"] / 24 * 32000) <= 1024
    # Training was logged, with the validation files beside it.
    assert [m["step"] for m in read_metrics(rendered)] == [1]


def test_relative_media_paths_are_relative_to_the_config_folder(tmp_path: Path, components: Path, assets: Path):
    cfg = load_config(_config(assets, components, tmp_path / "run"))
    keyframes = cfg.validation.samples[0].keyframes
    assert keyframes == {"first": str(assets / "stills/a.png"), "last": str(assets / "stills/b.png")}
    # The resolved config holds absolute paths, so the run folder's copy reads the same files from anywhere.
    again = tmp_path / "elsewhere"
    again.mkdir()
    (again / "config.yaml").write_text(json.dumps({"validation": {"samples": [{"keyframes": keyframes}]}}))
    raw = json.loads((again / "config.yaml").read_text())
    from h3train.config import anchor_sample_paths

    anchor_sample_paths(raw, again, "test")
    assert raw["validation"]["samples"][0]["keyframes"] == keyframes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"frames": 23}, "samples[0].frames' is 23; it takes 17 n + 5 frames"),
        ({"frames": 5}, "samples[0].frames' is 5"),
        ({"resolution": "100x64"}, "multiples of 32"),
        ({"resolution": "wide"}, "write WIDTHxHEIGHT"),
        ({"keyframes": {"first": "stills/missing.png"}}, "file '"),
        ({"keyframes": ["first"]}, "maps an anchor to an image"),
        ({"colour": "red"}, "samples[0].colour' (in '"),
        ({"task": "ref2va", "keyframes": {}, "references": [{"kind": "image", "path": "stills/a.png"}]},
         "other partition"),
        ({"task": "t2va"}, "keyframes' are for fl2va requests"),
        ({"id": "a b"}, "samples[0].id' is 'a b'"),
    ],
)  # fmt: skip
def test_bad_requests_are_one_line_config_errors(tmp_path, components, assets, change, message) -> None:
    request = {**REQUESTS[0], **change}
    with pytest.raises(ConfigError, match=None) as err:
        load_checked(_config(assets, components, tmp_path / "run", [request]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_render_keys_exit_2_with_one_line(tmp_path, components, assets, capsys) -> None:
    same = {**REQUESTS[1], "id": "same"}
    cases = [
        # `--strict`: a plain check plans for a components folder that is not on this machine.
        (["--strict", "validation.components=/nonexistent"], "validation.components"),
        (["validation.num_inference_steps=1"], "num_inference_steps' must be >= 2"),
        (["validation.sample_every=0", "validation.at_start=false"], "never rendered"),
        ([f"validation.samples=[{json.dumps(same)}, {json.dumps(same)}]"], "already used"),
    ]
    for overrides, message in cases:
        assert main(["check", str(_config(assets, components, tmp_path / "run")), *overrides]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("h3train: error: ") and message in err and "\n" not in err, (overrides, err)


def test_check_plans_the_render_components(tmp_path, components, assets, capsys) -> None:
    assert main(["check", str(_config(assets, components, tmp_path / "run"))]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if "validation.samples" in li)
    assert "vae" in line and "text_encoder" in line


@pytest.mark.parametrize(("points", "said"), [(2, "(1 denoising step each"), (STEPS, "(3 denoising steps each")])
def test_the_render_line_counts_the_steps_the_pipeline_runs(points: int, said: str) -> None:
    # diffusers' loop runs one forward per video timestep; the terminal sigma 0 has none.
    scheduler = MiniMaxH3Scheduler(shift=12.0)
    scheduler.set_timesteps(points)
    assert denoising_steps(points) == len(scheduler.timesteps) == points - 1
    line = render_line(1, 0, points, Path("samples/step_0"))
    assert line.startswith("rendering 1 validation sample after step 0 ") and said in line
    assert f"validation.num_inference_steps={points}" in line
    assert render_line(2, 4, points, Path("samples/step_4")).startswith("rendering 2 validation samples after step 4 ")


def test_clips_are_never_written_over(tmp_path: Path) -> None:
    frames = moving_pattern(22, 64, 64, 0)
    audio = torch.zeros(2, 32000)
    first = write_clip(tmp_path, "x", frames, audio, 32000)
    before = first.read_bytes()
    second = write_clip(tmp_path, "x", frames[::-1].copy(), audio, 32000)
    assert (first.name, second.name) == ("x.mp4", "x.2.mp4") and first.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.2.mp4", "x.mp4"]


def test_clips_reach_wandb_as_videos(tmp_path: Path) -> None:
    import wandb

    class Run:
        logged: list = []

        def log(self, data, step):
            self.logged.append((data, step))

        def finish(self, exit_code=0):
            pass

    clip = write_clip(tmp_path, "x", moving_pattern(22, 64, 64, 0), torch.zeros(2, 32000), 32000)
    logger = MetricsLogger(tmp_path, True, WandbConfig(enabled=False), {}, total_steps=1, progress=False)
    logger._wandb_run = run = Run()
    logger.log_videos(3, {"x": (clip, "a prompt")})
    logger.close()
    ((data, step),) = run.logged
    assert step == 3 and isinstance(data["samples/x"], wandb.Video)


@pytest.mark.slow
def test_dp_groups_split_the_requests_and_render_what_sp_renders(tmp_path, rendered, components, assets) -> None:
    # Three requests over two DP groups: group 1 renders one and repeats one unwritten, so FSDP's
    # collectives line up; every request is written once, as the sp = 2 run rendered it.
    run = tmp_path / "dp2"
    config = _config(assets, components, run)
    run_forked(["train", str(config), "parallel.dp_shard=2", "validation.sample_every=0"], nproc=2, timeout=240)
    written = sorted(p.name for p in (run / "samples" / "step_0").iterdir())
    assert written == sorted([f"{n}.mp4" for n in NAMES] + [f"{n}.latents.safetensors" for n in NAMES])
    for name in NAMES:
        got = load_file(run / "samples" / "step_0" / f"{name}.latents.safetensors")
        want = load_file(rendered / "samples" / "step_0" / f"{name}.latents.safetensors")
        for key in ("video", "audio"):
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=f"{name} {key}")


def test_rendering_leaves_training_bitwise_unchanged(tmp_path, components, assets) -> None:
    config = _config(assets, components, tmp_path / "unused", REQUESTS[1:2])
    common = ["train.steps=3", "checkpoint.every=0"]
    plain, rendering = tmp_path / "plain", tmp_path / "rendering"
    assert main(["train", str(config), *common, f"logging.dir={plain}", "validation.samples=[]",
                 "validation.at_start=false", "validation.sample_every=0"]) == 0  # fmt: skip
    assert main(["train", str(config), *common, f"logging.dir={rendering}", "validation.sample_every=2"]) == 0
    keys = ("loss", "loss_video", "loss_audio", "grad_norm", "lr")
    rows = [[[m[k] for k in keys] for m in read_metrics(d)] for d in (plain, rendering)]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    assert sorted(p.name for p in (rendering / "samples").iterdir()) == ["requests", "step_0", "step_2"]


def test_ref2va_render_matches_diffusers_pipeline(tmp_path, components, assets) -> None:
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    from h3train.encode.media import sine_tone, write_audio

    write_audio(assets / "voice.wav", sine_tone(1.0, 330, 32000), 32000)
    request = {"id": "duet", "task": "ref2va", "prompt": "the pictured square sings",
               "references": [{"kind": "image", "path": "stills/a.png"}, {"kind": "audio", "path": "voice.wav"}],
               "frames": 22, "resolution": "64x64", "seed": 1}  # fmt: skip
    config = _config(assets, components, tmp_path / "run", [request], reference_short_edge=32, sample_every=0)
    # A mixed run on a random init trains one model for every task, so it serves ref2va requests too.
    assert main(["train", str(config), "task.name=mixed", "checkpoint.every=0"]) == 0
    got = load_file(tmp_path / "run" / "samples" / "step_0" / "duet.latents.safetensors")

    cfg = load_config(tmp_path / "run" / "config.yaml")
    pipe = TinyClipPipeline()
    loaded = load_components(components)
    pipe.update_components(
        **{name: getattr(loaded, name) for name in COMPONENT_NAMES},
        transformer_ref=build_model(cfg, cfg.train.seed).eval(),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        reference_image_short_edge=32,
    )
    references = [
        MiniMaxH3ImageReference(image=load_still(assets / "stills/a.png")),
        MiniMaxH3AudioReference.from_file(str(assets / "voice.wav")),
    ]
    out = pipe(
        prompt=request["prompt"],
        references=references,
        height=64,
        width=64,
        num_frames=22,
        generator=torch.Generator().manual_seed(1),
        num_inference_steps=STEPS,
        output=["latents", "audio_latents"],
    )
    torch.testing.assert_close(got["video"], out["latents"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["audio"], out["audio_latents"], atol=1e-5, rtol=1e-5)


def test_requests_are_cached_and_re_encoded_only_when_their_inputs_change(tmp_path, components, assets) -> None:
    import os

    from h3train.encode import build_pipeline
    from h3train.render.request_encoding import (
        encode_request,
        encode_settings,
        load_conditioning,
        request_digest,
        save_conditioning,
    )
    from h3train.render.requests import parse_requests

    cfg = load_config(_config(assets, components, tmp_path / "run", REQUESTS[:1]))
    (request,) = parse_requests(cfg)
    settings = encode_settings(request, cfg.validation.reference_short_edge)
    digest = request_digest(request, "components", torch.float32, settings)
    cond = encode_request(build_pipeline(load_components(components), settings), request, settings)
    path = tmp_path / "drift.safetensors"
    save_conditioning(path, cond, digest)
    cached = load_conditioning(path, request, digest)
    assert cached is not None and cached.keyframe_anchors == ("first", "last")
    for got, want in zip((cached.prompt_embeds, cached.text_token_tags, *cached.keyframes),
                         (cond.prompt_embeds, cond.text_token_tags, *cond.keyframes)):  # fmt: skip
        assert torch.equal(got, want)
    # A touched keyframe, other components or another text encoder dtype make the cache stale.
    assert request_digest(request, "components", torch.bfloat16, settings) != digest
    assert request_digest(request, "other", torch.float32, settings) != digest
    image = assets / "stills/a.png"
    stat = image.stat()
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert request_digest(request, "components", torch.float32, settings) != digest
    finally:
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_conditioning(path, request, "stale") is None


def test_a_keyframe_that_is_no_image_is_one_line_and_exit_2(tmp_path, components, assets, capsys) -> None:
    (assets / "stills" / "broken.png").write_bytes(b"not an image" * 8)
    request = {**REQUESTS[0], "keyframes": {"first": "stills/broken.png"}}
    config = _config(assets, components, tmp_path / "run", [request])
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("h3train: error: config key 'validation.samples[0]' (drift): MediaError: cannot read image")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")
