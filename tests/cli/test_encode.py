"""`h3train encode`: media files -> cached samples, with tiny random components and generated clips.

One module-wide dataset is encoded once: an fl2va clip with a stereo tone (first keyframe from the
clip, last from an image), a silent t2va clip, a ref2va clip with a mono tone (an image, a stereo and a
mono 32 kHz audio reference), a corrupt file and a clip too short to encode.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
    MiniMaxH3AutoBeforeEncodeStep,
    MiniMaxH3AutoTextEncoderStep,
    MiniMaxH3AutoVaeEncoderStep,
)
from PIL import Image
from transformers.utils import is_torchvision_available

from h3train.cli import main
from h3train.config import load_config
from h3train.data.components import COMPONENT_NAMES, TINY_TEXT_HIDDEN, load_components, write_tiny_components
from h3train.data.dataset_index import read_index, write_index
from h3train.data.sample_file import CachedSample, read_cached_sample, read_sample
from h3train.encode import (
    ERRORS_NAME,
    HELDOUT_NAME,
    INPUTS_SUFFIX,
    TABLE_NAME,
    EncodeSettings,
    EncodeSummary,
    audio_rows_to_latents,
    encode_manifest,
    split_heldout,
    torchaudio_available,
)
from h3train.encode.manifest import ManifestError, read_clip_folder, read_manifest
from h3train.encode.media import fit_audio, load_clip, load_still, moving_pattern, sine_tone, write_audio, write_video
from h3train.infra.runlock import LOCK_NAME, RunLock
from h3train.model.build import build_model
from h3train.objective import compute_loss, micro_batch_inputs

from helpers.launch import h3train_command, on_small_disk, run_env, run_forked, start_in_session
from helpers.paths import ROOT
from helpers.pipeline import TinyClipPipeline, check_against_pipeline

# Small canvases keep the VAEs cheap: 3:2 clips land on 32x64 (2x4 latents), the 4:3 still on 32x32.
SETTINGS = EncodeSettings(short_edge=32, max_pixels=32 * 64, reference_short_edge=32, min_seconds=0, max_seconds=2)
# `load_clip`'s arguments for these settings: canvas, frame limits, the audio VAE's rate.
CLIP_OPTIONS = (SETTINGS.short_edge, SETTINGS.max_pixels, 32, SETTINGS.min_frames, SETTINGS.max_frames, 32000)
# Vision blocks: <|vision_start|>, one token per merged 32x32 patch, <|vision_end|>.
KEYFRAME_BLOCK_ROWS = 2 + 2
IMAGE_BLOCK_ROWS = 1 + 2
ROWS = [
    {"video": "clips/tone.mp4", "prompt": "a square drifts", "task": "fl2va", "id": "fl2va-tone",
     "keyframes": {"first": None, "last": "still.png"}},
    {"video": "clips/silent.mp4", "prompt": "a quiet square", "task": "t2va"},
    {"video": "clips/mono.mp4", "prompt": "a square hums", "task": "ref2va", "id": "ref2va",
     "references": [{"kind": "image", "path": "still.png"}, {"kind": "audio", "path": "voice.wav"},
                    {"kind": "audio", "path": "hum.wav"}],
     "negative_prompt": "blurry"},
    {"video": "broken.mp4", "prompt": "nothing", "task": "t2va"},
    {"video": "clips/short.mp4", "prompt": "too short", "task": "t2va"},
]  # fmt: skip


def _encode(manifest: Path, components: Path, out: Path) -> EncodeSummary:
    # On the CPU in float32 wherever the tests run, so samples compare exactly with the pipeline's blocks.
    return encode_manifest(manifest, components, out, SETTINGS, device="cpu", progress=False)


def _write_manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("components"))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "clips").mkdir()
    write_video(folder / "clips/tone.mp4", moving_pattern(30, 80, 120, 1), 30, sine_tone(1.0, 440, 44100), 44100)
    write_video(folder / "clips/silent.mp4", moving_pattern(40, 96, 144, 2), 24)
    write_video(folder / "clips/mono.mp4", moving_pattern(24, 64, 96, 3), 24, sine_tone(1.0, 220, 48000, 1), 48000)
    write_video(folder / "clips/short.mp4", moving_pattern(3, 64, 96, 4), 24)
    # References at the audio VAE's rate, stereo and mono, and one the pipeline would resample.
    write_audio(folder / "voice.wav", sine_tone(2.0, 330, 32000), 32000)
    write_audio(folder / "hum.wav", sine_tone(1.5, 180, 32000, 1), 32000)
    write_audio(folder / "voice48.wav", sine_tone(2.0, 330, 48000), 48000)
    Image.fromarray(moving_pattern(1, 90, 120, 5)[0]).save(folder / "still.png")
    (folder / "broken.mp4").write_bytes(b"not a video at all" * 64)
    _write_manifest(folder / "manifest.jsonl", ROWS)
    return folder


@pytest.fixture(scope="module")
def encoded(media: Path, components: Path) -> Path:
    summary = _encode(media / "manifest.jsonl", components, media / "out")
    assert (summary.encoded, summary.skipped, summary.failed) == (3, 0, 2)
    return media / "out"


def _sample(out: Path, sample_id: str) -> CachedSample:
    return read_cached_sample(out / f"{sample_id}.safetensors")


def test_latent_shapes_follow_h3_geometry(encoded: Path) -> None:
    # 30 frames at 30 fps -> 24 at 24 fps -> 22 = 17 + 5; 40 frames at 24 fps -> 39 = 2 * 17 + 5.
    for sample_id, frames, n in (("fl2va-tone", 22, 1), ("clips--silent", 39, 2), ("ref2va", 22, 1)):
        sample = _sample(encoded, sample_id)
        assert sample.num_frames == frames == 17 * n + 5
        assert tuple(sample.video_latents.shape) == (24, 5 * n + 2, 2, 4)
        # 40 audio latents per second of video, per stereo channel.
        assert tuple(sample.audio_latents.shape) == (2, 32, round(frames / 24 * 40))
        assert sample.prompt_embeds.shape[1] == TINY_TEXT_HIDDEN
    fl2va = _sample(encoded, "fl2va-tone")
    assert fl2va.keyframe_anchors == ("first", "last")
    assert [tuple(k.shape) for k in fl2va.keyframes] == [(24, 1, 2, 4)] * 2
    refs = _sample(encoded, "ref2va").references
    assert [(r.kind, r.has_audio) for r in refs] == [("image", False), ("audio", True), ("audio", True)]
    # Cut to the clip's 22 / 24 s at 32 kHz: 29333 samples, 37 latents per channel.
    assert tuple(refs[0].video.shape) == (24, 1, 2, 2)
    assert tuple(refs[1].audio.shape) == tuple(refs[2].audio.shape) == (2, 32, 37)


def test_clip_without_audio_track_has_no_audio(encoded: Path) -> None:
    silent = _sample(encoded, "clips--silent")
    assert not silent.has_audio and silent.audio_latents.abs().max() == 0
    assert _sample(encoded, "fl2va-tone").has_audio and _sample(encoded, "ref2va").has_audio
    entries = {e.sample_id: e.has_audio for e in read_index(encoded)}
    assert entries == {"fl2va-tone": True, "clips--silent": False, "ref2va": True}


def test_vision_tokens_are_tagged_video(encoded: Path) -> None:
    fl2va, ref2va, t2va = (_sample(encoded, i) for i in ("fl2va-tone", "ref2va", "clips--silent"))
    assert int((fl2va.text_token_tags == 0).sum()) == 2 * KEYFRAME_BLOCK_ROWS
    assert int((ref2va.text_token_tags == 0).sum()) == IMAGE_BLOCK_ROWS  # the image; audio has no vision block
    assert bool((t2va.text_token_tags == 1).all())
    assert torch.equal(t2va.negative_visual_prompt_embeds, t2va.negative_prompt_embeds)
    for sample in (fl2va, ref2va):
        # The negative " " keeps the same vision blocks in its visual variant, none in its text variant.
        visual = sample.negative_visual_text_token_tags
        assert int((visual == 0).sum()) == int((sample.text_token_tags == 0).sum())
        assert bool((sample.negative_text_token_tags == 1).all())


def test_failures_are_recorded_and_the_rest_encoded(encoded: Path) -> None:
    errors = {e["id"]: e for e in map(json.loads, (encoded / ERRORS_NAME).read_text().splitlines())}
    assert set(errors) == {"broken", "clips--short"}
    assert "cannot open" in errors["broken"]["error"] and errors["broken"]["line"] == 4
    assert "clip too short: 3 frames" in errors["clips--short"]["error"]
    assert sorted(e.sample_id for e in read_index(encoded)) == ["clips--silent", "fl2va-tone", "ref2va"]


def test_rerun_skips_what_is_done_and_redoes_what_changed(encoded: Path, media: Path, components: Path) -> None:
    out = media / "out-rerun"
    shutil.copytree(encoded, out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    summary = _encode(media / "manifest.jsonl", components, out)
    assert (summary.encoded, summary.skipped, summary.failed) == (0, 3, 2)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}

    changed = [dict(row) for row in ROWS]
    changed[1]["prompt"] = "a louder square"
    manifest = _write_manifest(media / "manifest-changed.jsonl", changed)
    summary = _encode(manifest, components, out)
    assert (summary.encoded, summary.skipped, summary.failed) == (1, 2, 2)
    assert out.joinpath("clips--silent.safetensors").stat().st_mtime_ns != stamps["clips--silent.safetensors"]


def test_rerun_deletes_only_its_own_leftovers_and_keeps_the_earlier_errors(
    encoded: Path, media: Path, components: Path
) -> None:
    out = media / "out-kept"
    shutil.copytree(encoded, out)
    (out / ".notes.tmp").write_text("a user's hidden file\n")
    killed = out / f".fl2va-tone.safetensors.{'0f' * 16}.tmp"  # an atomic write cut short
    killed.write_bytes(b"half a sample")
    earlier = (out / ERRORS_NAME).read_text()
    summary = _encode(media / "manifest.jsonl", components, out)
    assert (summary.encoded, summary.skipped, summary.failed) == (0, 3, 2)
    assert (out / ".notes.tmp").read_text() == "a user's hidden file\n"
    assert not killed.exists()
    assert (out / f"{ERRORS_NAME}.previous").read_text() == earlier
    assert len((out / ERRORS_NAME).read_text().splitlines()) == 2
    assert not (out / LOCK_NAME).exists()


# `SETTINGS` as command-line flags.
FLAGS = ["--short-edge", "32", "--max-pixels", str(32 * 64), "--reference-short-edge", "32",
         "--min-seconds", "0", "--max-seconds", "2", "--device", "cpu", "--no-progress"]  # fmt: skip
CAPTIONS = {"tone": "a square drifts", "silent": "a quiet square", "sub/mono": "a humming square"}


@pytest.fixture(scope="module")
def clip_folder(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three clips with same-named captions, one in a subfolder: what a user has before any manifest."""
    folder = tmp_path_factory.mktemp("clip_folder")
    (folder / "sub").mkdir()
    for name, caption in CAPTIONS.items():
        shutil.copy(media / "clips" / f"{Path(name).name}.mp4", folder / f"{name}.mp4")
        (folder / f"{name}.txt").write_text(caption + "\n")
    return folder


@pytest.fixture(scope="module")
def from_folder(clip_folder: Path, components: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("from_folder") / "data"
    args = ["encode", str(clip_folder), "--components", str(components), "--out", str(out), *FLAGS]
    assert main([*args, "--heldout", "1", "--caption-prefix", "sks"]) == 0
    return out


def _table(folder: Path) -> dict[str, dict[str, str]]:
    header, *lines = (folder / TABLE_NAME).read_text().splitlines()
    return {row["id"]: row for row in (dict(zip(header.split("\t"), line.split("\t"))) for line in lines)}


def test_a_folder_of_clips_and_captions_is_a_t2va_dataset_with_a_heldout_split(
    from_folder: Path, clip_folder: Path
) -> None:
    training, heldout = read_index(from_folder), read_index(from_folder / HELDOUT_NAME)
    ids = {"tone", "silent", "sub--mono"}
    assert {e.sample_id for e in training} | {e.sample_id for e in heldout} == ids
    assert len(heldout) == 1 and all(e.task == "t2va" for e in (*training, *heldout))
    # The held-out clip is the seeded rule's, and it is nowhere in the training dataset.
    expected = split_heldout(read_clip_folder(clip_folder), 1)[1]
    assert [e.sample_id for e in heldout] == [e.sample_id for e in expected]
    assert not (from_folder / f"{heldout[0].sample_id}.safetensors").exists()
    # The trigger word went before every caption.
    for entry in (*training, *heldout):
        folder = from_folder if entry in training else from_folder / HELDOUT_NAME
        recorded = json.loads((folder / f"{entry.sample_id}{INPUTS_SUFFIX}").read_text())["inputs"]
        assert recorded["prompt"] == "sks " + CAPTIONS[recorded["video"]["path"].removesuffix(".mp4")]
    # One table line per clip: the source in its own size and rate -> canvas, frames, seconds, audio.
    table = {**_table(from_folder), **_table(from_folder / HELDOUT_NAME)}
    assert set(table) == ids
    tone = table["tone"]
    assert tone["source"] == "120x80 30 fps 1.00 s" and tone["canvas"] == "64x32" and tone["frames"] == "22"
    assert tone["seconds"] == f"{22 / 24:.2f}" and tone["audio"] == "yes" and tone["outcome"] == "encoded"
    assert table["silent"]["audio"] == "none"


def test_a_folder_clip_without_a_caption_is_one_line_naming_it(clip_folder: Path, tmp_path: Path, capsys) -> None:
    folder = Path(shutil.copytree(clip_folder, tmp_path / "clips"))
    (folder / "silent.txt").unlink()
    (folder / "tone.txt").write_text("  \n")
    assert main(["encode", str(folder), "--components", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 of 3 clips lack a caption" in err, err
    assert "'silent.mp4' has no caption 'silent.txt'" in err and "caption 'tone.txt' is empty" in err


def test_rerun_re_encodes_only_the_clips_a_changed_flag_changes(
    from_folder: Path, clip_folder: Path, components: Path, tmp_path: Path, capsys
) -> None:
    out = Path(shutil.copytree(from_folder, tmp_path / "data"))
    base = ["encode", str(clip_folder), "--components", str(components), "--out", str(out), "--caption-prefix", "sks"]
    flags = dict(zip(FLAGS[::2], FLAGS[1::2]))

    def encode(**changed: str) -> str:
        options = [x for k, v in {**flags, **changed}.items() for x in (k, v)]
        capsys.readouterr()
        assert main([*base, "--heldout", "1", *options, "--no-progress"]) == 0
        return capsys.readouterr().out

    # A lower --min-seconds keeps every clip as it was: nothing is encoded again.
    assert "encoded 0, up to date 3, failed 0" in encode(**{"--min-seconds": "0.5"})
    # --max-seconds 1.5 (36 frames) cuts only `silent` (40 frames at 24 fps: 39 -> 22 frames).
    stamps = {p.name: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")}
    assert "encoded 1, up to date 2, failed 0" in encode(**{"--max-seconds": "1.5"})
    after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")}
    assert [name for name in stamps if stamps[name] != after[name]] == ["silent.safetensors"]
    assert read_cached_sample(out / "silent.safetensors").num_frames == 22
    # --min-seconds 2 (48 frames: 39 kept) rejects the two 1 s clips, naming the flag that would keep them;
    # `silent` is back to 39 frames under --max-seconds 2.
    printed = encode(**{"--min-seconds": "2"})
    assert "encoded 1, up to date 0, failed 2 (too short 2; reasons in errors.jsonl)" in printed, printed
    errors = [
        json.loads(line) for f in (out, out / HELDOUT_NAME) for line in (f / ERRORS_NAME).read_text().splitlines()
    ]
    assert sorted(e["id"] for e in errors) == ["sub--mono", "tone"]
    assert all("lower --min-seconds (now 2) to keep it" in e["error"] and e["kind"] == "too short" for e in errors)


def test_a_changed_heldout_split_moves_samples_instead_of_encoding_them(
    from_folder: Path, clip_folder: Path, components: Path, tmp_path: Path, capsys
) -> None:
    out = Path(shutil.copytree(from_folder, tmp_path / "data"))
    args = ["encode", str(clip_folder), "--components", str(components), "--out", str(out), *FLAGS]
    capsys.readouterr()
    assert main([*args, "--caption-prefix", "sks"]) == 0
    assert "encoded 0, up to date 3, failed 0" in capsys.readouterr().out
    assert len(read_index(out)) == 3 and read_index(out / HELDOUT_NAME) == []


def test_second_encode_into_a_held_folder_is_one_line(media: Path, components: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    holder = RunLock([(out, f"--out '{out}'")])
    holder.acquire()
    try:
        args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
        assert main([*args, "--device", "cpu", "--no-progress"]) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out '{out}' is in use by another run" in err[0]
    assert sorted(p.name for p in out.iterdir()) == []


def test_killed_writer_leaves_no_readable_half_sample(media: Path, components: Path) -> None:
    manifest = _write_manifest(media / "manifest-kill.jsonl", [ROWS[1] | {"video": "clips/mono.mp4", "id": "k"}])
    out = media / "out-kill"
    # Dies by SIGKILL right after the sample's bytes are on disk under their temporary name.
    script = textwrap.dedent(f"""
        import os, signal
        import h3train.infra.atomic as atomic
        from h3train.encode import EncodeSettings, encode_manifest
        synced = atomic.fsync_path
        def die(path):
            synced(path)
            os.kill(os.getpid(), signal.SIGKILL)
        atomic.fsync_path = die
        encode_manifest({str(manifest)!r}, {str(components)!r}, {str(out)!r}, EncodeSettings(**{asdict(SETTINGS)!r}),
                        device="cpu", progress=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert list(out.glob(".k.safetensors.*.tmp")), "the kill should have hit mid-write"
    assert not list(out.glob("*.safetensors")) and write_index(out) == []

    summary = _encode(manifest, components, out)
    assert (summary.encoded, summary.failed) == (1, 0)
    assert not list(out.glob(".*.tmp")) and [e.sample_id for e in read_index(out)] == ["k"]


def _pipeline_request(media: Path, sample: CachedSample) -> dict:
    """The pipeline's own inputs for the same clip: its first frame as decoded, the same still and references."""
    geo = sample.geometry
    request = {"height": geo.latent_height * 16, "width": geo.latent_width * 16, "num_frames": sample.num_frames}
    if sample.task == "fl2va":
        frames = load_clip(media / ROWS[0]["video"], *CLIP_OPTIONS).frames
        return request | {"prompt": ROWS[0]["prompt"], "image": Image.fromarray(frames[0]),
                          "last_image": load_still(media / "still.png")}  # fmt: skip
    # Decoded as an inference user decodes them, at the rates the files carry.
    references = [
        MiniMaxH3ImageReference.from_file(media / "still.png"),
        MiniMaxH3AudioReference.from_file(media / "voice.wav"),
        MiniMaxH3AudioReference.from_file(media / "hum.wav"),
    ]
    return request | {"prompt": ROWS[2]["prompt"], "references": references}


def _tiny_pipeline(components: Path) -> TinyClipPipeline:
    pipe = TinyClipPipeline()
    loaded = load_components(components)
    pipe.update_components(
        **{name: getattr(loaded, name) for name in COMPONENT_NAMES},
        canvas_short_edge=SETTINGS.short_edge,
        canvas_max_pixels=SETTINGS.max_pixels,
        reference_image_short_edge=SETTINGS.reference_short_edge,
    )
    return pipe


def _pipeline_encoding(pipe: TinyClipPipeline, request: dict, text: bool = True) -> PipelineState:
    state = PipelineState()
    for key, value in request.items():
        state.set(key, value)
    blocks = (MiniMaxH3AutoBeforeEncodeStep, MiniMaxH3AutoTextEncoderStep, MiniMaxH3AutoVaeEncoderStep)
    for block in blocks if text else blocks[::2]:
        block()(pipe, state)
    return state


@pytest.mark.parametrize("sample_id", ["fl2va-tone", "ref2va"])
def test_encoded_samples_pack_as_the_pipeline_builds_them(
    sample_id: str, encoded: Path, media: Path, components: Path, tmp_path: Path
) -> None:
    sample = _sample(encoded, sample_id)
    state = _pipeline_encoding(_tiny_pipeline(components), _pipeline_request(media, sample))

    # The conditioning the pipeline encodes from the same media is what the sample holds ...
    assert torch.equal(state.get("text_token_tags"), sample.text_token_tags)
    assert torch.equal(state.get("prompt_embeds")[0], sample.prompt_embeds)
    visual = [*sample.keyframes, *(r.video for r in sample.references if r.video is not None)]
    assert all(torch.equal(a[0], b) for a, b in zip(state.get("condition_latents"), visual, strict=True))
    sounds = [audio_rows_to_latents(rows) for rows in state.get("audio_condition_latents") or []]
    assert all(torch.equal(a, r.audio) for a, r in zip(sounds, [r for r in sample.references if r.has_audio]))
    # ... and it packs, positive and both negatives, to the layouts and rows the pipeline's blocks build.
    check_against_pipeline(sample, tmp_path)


def test_audio_rows_are_the_pipelines(encoded: Path, media: Path, components: Path) -> None:
    """The dataset's audio rows are the rows the pipeline's own encoder and packing give the same sound."""
    pipe = _tiny_pipeline(components)
    sample = _sample(encoded, "ref2va")
    packed = read_sample(encoded / "ref2va.safetensors")
    state = _pipeline_encoding(pipe, _pipeline_request(media, sample), text=False)
    references = torch.cat(state.get("audio_condition_latents"))
    nca = packed.layout.num_condition_audio_rows
    assert nca == references.shape[0] and torch.equal(packed.audio_rows[:nca], references)
    # Mono and stereo references alike are upmixed and encoded by the pipeline, not before it.
    assert not torch.equal(references[: nca // 2], references[nca // 2 :])

    # The target soundtrack: the clip's own, cut to the latent count, through the pipeline's encoder.
    clip = load_clip(media / ROWS[2]["video"], *CLIP_OPTIONS)
    waveform = fit_audio(clip.audio, sample.geometry.num_audio_latents * pipe.audio_vae.hop_length)
    encoder = PipelineState()
    encoder.set("normalized_references", [MiniMaxH3AudioReference(audio=waveform, sample_rate=clip.sample_rate)])
    MiniMaxH3Ref2VAReferenceEncoderStep()(pipe, encoder)
    assert torch.equal(packed.audio_rows[nca:], encoder.get("audio_condition_latents")[0])


def test_target_video_latents_are_what_the_pipeline_decodes(encoded: Path, media: Path, components: Path) -> None:
    """Denormalized by the pipeline's own decode step, the target latents are the VAE's posterior mean."""
    pipe = _tiny_pipeline(components)
    sample = _sample(encoded, "clips--silent")
    frames = load_clip(media / ROWS[1]["video"], *CLIP_OPTIONS).frames
    mean, std = torch.tensor(pipe.pixel_mean).view(1, 3, 1, 1, 1), torch.tensor(pipe.pixel_std).view(1, 3, 1, 1, 1)
    pixels = (torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 255.0 - mean) / std
    with torch.no_grad():
        posterior_mean = pipe.vae.encode(pixels).latent_dist.mode()

    class Decoded(Exception):
        pass

    def capture(latents: torch.Tensor, return_dict: bool = False):
        raise Decoded(latents)

    state = PipelineState()
    state.set("latents", sample.video_latents[None])
    state.set("output_type", "pt")
    pipe.vae.decode = capture
    with pytest.raises(Decoded) as decoded:
        MiniMaxH3VideoDecodeStep()(pipe, state)
    assert torch.allclose(decoded.value.args[0], posterior_mean, atol=1e-5, rtol=1e-5)


def test_reference_off_the_vae_rate_encodes_as_the_pipeline_or_is_an_error(
    media: Path, components: Path, tmp_path: Path
) -> None:
    """A 48 kHz reference is resampled by the pipeline's own torchaudio pass, or recorded with that reason."""
    row = ROWS[2] | {"id": "ref-48k", "references": [{"kind": "image", "path": "still.png"},
                                                     {"kind": "audio", "path": "voice48.wav"}]}  # fmt: skip
    summary = _encode(_write_manifest(media / "manifest-48k.jsonl", [row]), components, tmp_path / "o")
    if not torchaudio_available():
        assert (summary.encoded, summary.failed) == (0, 1)
        error = json.loads((tmp_path / "o" / ERRORS_NAME).read_text())
        assert error["id"] == "ref-48k" and "48000 Hz" in error["error"] and "torchaudio" in error["error"]
        return
    assert (summary.encoded, summary.failed) == (1, 0)
    packed = read_sample(tmp_path / "o" / "ref-48k.safetensors")
    request = _pipeline_request(media, _sample(tmp_path / "o", "ref-48k"))
    request["references"] = [
        MiniMaxH3ImageReference.from_file(media / "still.png"),
        MiniMaxH3AudioReference.from_file(media / "voice48.wav"),
    ]
    state = _pipeline_encoding(_tiny_pipeline(components), request, text=False)
    nca = packed.layout.num_condition_audio_rows
    assert torch.equal(packed.audio_rows[:nca], torch.cat(state.get("audio_condition_latents")))


def test_encoded_sample_trains(encoded: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny_demo.yaml", ["cfg.scale=2.0", "cfg.negative_visual=keep"])
    model = build_model(cfg, seed=0)
    for sample_id in ("fl2va-tone", "ref2va", "clips--silent"):
        inputs = micro_batch_inputs(cfg, read_sample(encoded / f"{sample_id}.safetensors"), step=0, slot=0)
        assert inputs.uncond_inputs is not None
        loss = compute_loss(lambda **kw: model(**kw, return_dict=False), inputs).loss
        loss.backward()
        assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_tiny_components_match_the_demo_model(components: Path) -> None:
    assert all((components / name).is_dir() for name in COMPONENT_NAMES)
    cfg = load_config(ROOT / "configs" / "tiny_demo.yaml", [])
    assert cfg.model.config["text_dim"] == TINY_TEXT_HIDDEN


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"video": "../outside.mp4", "prompt": "x", "task": "t2va"}, "must stay inside the manifest folder"),
        ({"video": "/abs.mp4", "prompt": "x", "task": "t2va"}, "must stay inside the manifest folder"),
        ({"video": "a.mp4", "prompt": "x", "task": "i2v"}, "field 'task' is 'i2v'"),
        ({"video": "a.mp4", "prompt": "x", "task": "fl2va"}, "field 'keyframes' is missing"),
        ({"video": "a.mp4", "prompt": "x", "task": "fl2va", "keyframes": "middle"}, "field 'keyframes'"),
        ({"video": "a.mp4", "prompt": "x", "task": "ref2va", "references": [{"kind": "smell", "path": "a"}]},
         "references[0].kind"),
        ({"video": "a.mp4", "prompt": "x", "task": "t2va", "fps": 30}, "field 'fps' is not a manifest field"),
        ({"video": "a.mp4", "task": "t2va"}, "field 'prompt' is missing"),
        ({"video": "a.mp4", "prompt": "x", "task": "t2va", "id": "a/b"}, "field 'id'"),
        ({"video": "a\x00.mp4", "prompt": "x", "task": "t2va"}, "field 'video'"),
        ({"video": "a\ud800.mp4", "prompt": "x", "task": "t2va"}, "not valid unicode"),
        ({"video": "a.mp4", "prompt": "", "task": "t2va"}, "field 'prompt' is ''"),
        ({"video": "a.mp4", "prompt": "  ", "task": "t2va"}, "conditioned on its prompt alone"),
    ],
)  # fmt: skip
def test_bad_manifest_exits_2_with_one_line(
    row: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    manifest = _write_manifest(tmp_path / "m.jsonl", [{"video": "ok.mp4", "prompt": "fine", "task": "t2va"}, row])
    with pytest.raises(ManifestError, match="line 2"):
        read_manifest(manifest)
    assert main(["encode", str(manifest), "--components", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("h3train: error: ")


def _load_as_torch_does_under_ctrl_c(interrupt: bool):
    """A safetensors load that fails the way torch 2.8 fails when Ctrl-C lands while it builds a tensor
    from a buffer: the interrupt is swallowed and a ValueError comes out in its place."""

    def load_file(*_args, **_kwargs):
        try:
            if interrupt:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt:
            pass
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    return load_file


@pytest.mark.parametrize("interrupt", [True, False])
def test_an_error_that_follows_ctrl_c_is_the_interrupt(
    interrupt: bool, media: Path, components: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture
) -> None:
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", _load_as_torch_does_under_ctrl_c(interrupt))
    out = tmp_path / "o"
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
    code = main([*args, "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    if interrupt:
        assert code == 130 and err[-1].startswith("h3train encode: interrupted"), err
    else:  # the same error without a Ctrl-C is the folder's, named in one line
        assert code == 2 and err[-1].startswith(f"h3train: error: components folder '{components}'"), err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
    assert not (out / LOCK_NAME).exists()


def test_ctrl_c_is_one_line_and_exit_130(media: Path, components: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
    proc = start_in_session(h3train_command([*args, "--device", "cpu", "--no-progress"]), run_env())
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK_NAME).exists():  # the encode has begun: its lock is taken
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("h3train encode: interrupted"), err[-2000:]
    assert not (out / LOCK_NAME).exists()


def test_a_full_disk_stops_the_encode_with_one_line(media: Path, components: Path, tmp_path: Path) -> None:
    # Room for about one sample: a full disk is no clip's fault, so the encode stops instead of
    # recording every later clip as failed.
    out = tmp_path / "o"
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
    flags = ["--short-edge", "32", "--max-pixels", str(32 * 64), "--reference-short-edge", "32",
             "--min-seconds", "0", "--max-seconds", "2", "--device", "cpu", "--no-progress"]  # fmt: skip
    proc, kept = on_small_disk(out, 48 * 1024, [*args, *flags])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("h3train: error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on the device writing '{out}/" in errors[0] and ".safetensors'" in errors[0], errors[0]
    recorded = (kept / ERRORS_NAME).read_text() if (kept / ERRORS_NAME).exists() else ""
    assert "No space left" not in recorded and "os error" not in recorded, recorded
    assert not (kept / LOCK_NAME).exists()


def test_a_manifest_line_without_task_takes_it_from_its_fields(tmp_path: Path) -> None:
    rows = [
        {"video": "a.mp4", "prompt": "plain"},
        {"video": "b.mp4", "prompt": "framed", "keyframes": "both"},
        {"video": "c.mp4", "prompt": "cast", "references": [{"kind": "audio", "path": "v.wav"}]},
    ]
    entries = read_manifest(_write_manifest(tmp_path / "m.jsonl", rows))
    assert [e.task for e in entries] == ["t2va", "fl2va", "ref2va"]


def test_manifest_ids_and_keyframes(tmp_path: Path) -> None:
    rows = [
        {"video": "clips/a b.mp4", "prompt": "x", "task": "fl2va", "keyframes": ["last", "first"]},
        {"video": "clips/a b.mp4", "prompt": "y", "task": "t2va"},
    ]
    with pytest.raises(ManifestError, match="id 'clips--a_b' is already used on line 1"):
        read_manifest(_write_manifest(tmp_path / "m.jsonl", rows))
    rows[1]["id"] = "second"
    first, second = read_manifest(_write_manifest(tmp_path / "m.jsonl", rows))
    assert first.sample_id == "clips--a_b" and second.sample_id == "second"
    assert [k.anchor for k in first.keyframes] == ["first", "last"] and second.negative_prompt == " "


def test_bad_components_folder_exits_2(media: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "vae").mkdir()
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(tmp_path), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert "has no audio_vae, text_encoder, tokenizer, processor subfolder" in capsys.readouterr().err


def test_nothing_encoded_exits_nonzero(media: Path, components: Path, tmp_path: Path) -> None:
    manifest = _write_manifest(media / "manifest-bad.jsonl", ROWS[3:])
    args = ["encode", str(manifest), "--components", str(components), "--out", str(tmp_path / "o"), "--no-progress",
            "--device", "cpu"]  # fmt: skip
    assert main(args) == 1
    assert len((tmp_path / "o" / ERRORS_NAME).read_text().splitlines()) == 2
    assert read_index(tmp_path / "o") == []


@pytest.mark.skipif(is_torchvision_available(), reason="with torchvision, video references encode")
def test_video_reference_without_torchvision_is_a_clip_error(media: Path, components: Path, tmp_path: Path) -> None:
    row = ROWS[2] | {"id": "video-ref", "references": [{"kind": "video", "path": "clips/tone.mp4"}]}
    manifest = _write_manifest(media / "manifest-video-ref.jsonl", [row, ROWS[1]])
    summary = _encode(manifest, components, tmp_path / "o")
    assert (summary.encoded, summary.failed) == (1, 1)
    assert "torchvision" in json.loads((tmp_path / "o" / ERRORS_NAME).read_text())["error"]


@pytest.mark.slow
def test_ranks_split_the_manifest_and_agree_with_one_process(
    encoded: Path, media: Path, components: Path, tmp_path: Path
) -> None:
    """Two ranks (`accelerate.PartialState` split and gather) write what one process writes."""
    out = tmp_path / "two-ranks"
    flags = ["--short-edge", "32", "--max-pixels", str(32 * 64), "--reference-short-edge", "32",
             "--min-seconds", "0", "--max-seconds", "2", "--device", "cpu", "--no-progress"]  # fmt: skip
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out), *flags]
    proc = run_forked(args, nproc=2, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("encoded 3, up to date 0, failed 2") == 1
    assert len((out / ERRORS_NAME).read_text().splitlines()) == 2
    assert [e.sample_id for e in read_index(out)] == [e.sample_id for e in read_index(encoded)]
    for entry in read_index(encoded):
        ours, theirs = _sample(out, entry.sample_id), _sample(encoded, entry.sample_id)
        assert ours.metadata() == theirs.metadata()
        # The same arithmetic; only the thread count (one per rank) orders sums differently.
        for a, b in zip(ours.tensors().values(), theirs.tensors().values(), strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)


# `SETTINGS` as the command's flags: a rerun with them finds the encoded samples up to date.
SETTING_FLAGS = [
    *("--short-edge", str(SETTINGS.short_edge), "--max-pixels", str(SETTINGS.max_pixels)),
    *("--reference-short-edge", str(SETTINGS.reference_short_edge)),
    *("--min-seconds", str(SETTINGS.min_seconds), "--max-seconds", str(SETTINGS.max_seconds)),
]


def test_encode_with_shards_writes_the_dataset_into_shards_too(
    encoded: Path, media: Path, components: Path, tmp_path: Path
) -> None:
    from h3train.data.dataset import CachedDataset

    out, target = tmp_path / "out", tmp_path / "sharded"
    shutil.copytree(encoded, out)
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
    # Shards of 10 kB at most: one sample a shard.
    shards = ["--shards", str(target), "--shard-gb", "0.00001"]
    assert main([*args, *SETTING_FLAGS, "--device", "cpu", "--no-progress", *shards]) == 0
    folder, sharded = CachedDataset(out), CachedDataset(target)
    lines = read_index(target)
    assert [e.sample_id for e in lines] == [e.sample_id for e in read_index(out)] and len(lines) == 3
    assert all(e.in_shard for e in lines) and len({e.file for e in lines}) == 3
    assert len(list((target / "shards").iterdir())) == 3
    for i in range(len(folder)):
        a, b = folder[i], sharded[i]
        assert (a.sample_id, a.task, a.has_audio) == (b.sample_id, b.task, b.has_audio)
        for name in ("video_rows", "audio_rows", "prompt_embeds", "text_token_tags"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=0, atol=0)


def test_encode_refuses_a_shard_target_that_holds_a_dataset_before_encoding(
    encoded: Path, media: Path, components: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "index.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    args = ["encode", str(media / "manifest.jsonl"), "--components", str(components), "--out", str(out)]
    for target, said in ((taken, f"'{taken / 'index.jsonl'}' exists already"), (out / "s", "lies inside --out")):
        assert main([*args, *SETTING_FLAGS, "--device", "cpu", "--no-progress", "--shards", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        # Refused before any clip was encoded, and the dataset already there is as it was.
        assert not list(out.glob("*.safetensors")) and (taken / "index.jsonl").read_text() == "{}\n"
