"""`h3train encode --windows`: long clips cut into several samples, each its own span of frames and sound.

A 12 s clip at 8 fps whose frame `i` is grey `20 + 2 i` on its left half and whose mono tone gets louder every
second, a 4 s clip and a 1 s clip (shorter than one window) are encoded with the stand-in components'
preset (windows of 39 frames, 1.62 s) into one dataset three times: `first`, then `uniform`, then
`slide`, one clip held out each time.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from h3train.cli import main
from h3train.data.components import load_components, write_tiny_components
from h3train.data.dataset_index import read_index
from h3train.data.sample_file import read_cached_sample
from h3train.encode import (
    HELDOUT_NAME,
    TABLE_NAME,
    EncodeSettings,
    Windowing,
    build_pipeline,
    encode_audio_latents,
    encode_video_latents,
    split_heldout,
)
from h3train.encode.manifest import read_clip_folder
from h3train.encode.media import fit_audio, load_clip, sine_tone, write_video

RATE = 32000
FPS = 8
# 8 fps on the 24 fps clock: source frame i fills slots 3 i .. 3 i + 2.
SLOTS_PER_FRAME = 24 // FPS
# The stand-in preset keeps clips within 2 s: 48 frames, 39 by the 17 n + 5 rule.
WINDOW = 39
# Small canvases keep the VAEs cheap; the lengths come from the components folder's preset.
FLAGS = ["--short-edge", "32", "--max-pixels", str(32 * 64), "--reference-short-edge", "32", "--heldout", "1",
         "--device", "cpu", "--no-progress"]  # fmt: skip
RUNS = {
    "first": [],
    "uniform": ["--windows", "uniform", "--max-windows", "3"],
    "slide": ["--windows", "slide", "--stride", "3", "--max-windows", "3"],
}
# The windows each run cuts, by first frame at 24 fps: the 12 s clip is 288 slots, the 4 s one 96.
STARTS = {
    "uniform": {"long": [0, 124, 249], "mid": [0, 57], "short": [0]},  # evenly, first at 0, last at the end
    "slide": {"long": [0, 72, 144], "mid": [0], "short": [0]},  # every 3 s while a window fits
}


def _amplitude(second: int) -> float:
    return 0.05 * (second + 1)


def _long_clip(path: Path) -> Path:
    frames = np.full((12 * FPS, 48, 64, 3), 128, np.uint8)
    # The left half tells the frame; the right half stays, so the contrast (what a VAE sees) changes too.
    frames[:, :, :32] = (20 + 2 * np.arange(12 * FPS, dtype=np.uint8))[:, None, None, None]
    t = np.arange(12 * RATE) / RATE
    tone = (_amplitude(np.floor(t)) * np.sin(2 * np.pi * 500 * t)).astype(np.float32)[None]
    return write_video(path, frames, FPS, tone, RATE)


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("components"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clips")
    _long_clip(folder / "long.mp4")
    grey = np.full((4 * FPS, 48, 64, 3), 128, np.uint8)
    write_video(folder / "mid.mp4", grey, FPS, sine_tone(4.0, 300, 44100), 44100)
    write_video(folder / "short.mp4", grey[:FPS], FPS)
    for name in ("long", "mid", "short"):
        (folder / f"{name}.txt").write_text(f"a {name} grey clip\n")
    return folder


@pytest.fixture(scope="module")
def runs(clips: Path, components: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The three encodes into one folder, in order: a copy of the folder and the console after each."""
    out = tmp_path_factory.mktemp("encoded") / "data"
    seen = {}
    for name, flags in RUNS.items():
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["encode", str(clips), "--components", str(components), "--out", str(out), *FLAGS, *flags])
        assert code == 0, stderr.getvalue()
        copy = Path(shutil.copytree(out, out.parent / f"after-{name}"))
        seen[name] = {"out": copy, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    return seen


def _table(folder: Path) -> dict[str, dict[str, str]]:
    header, *lines = (folder / TABLE_NAME).read_text().splitlines()
    return {row["id"]: row for row in (dict(zip(header.split("\t"), line.split("\t"))) for line in lines)}


def _both(folder: Path) -> dict[str, dict[str, str]]:
    return {**_table(folder), **_table(folder / HELDOUT_NAME)}


def _ids(folder: Path) -> set[str]:
    return {e.sample_id for e in read_index(folder)} | {e.sample_id for e in read_index(folder / HELDOUT_NAME)}


def test_a_window_decodes_from_the_frame_and_sound_at_its_start(clips: Path) -> None:
    options = {"short_edge": 32, "max_pixels": 32 * 64, "canvas_multiple": 32, "min_frames": 0, "sample_rate": RATE}
    whole = load_clip(clips / "long.mp4", max_frames=10_000, **options)
    assert whole.file is not None and whole.file.describe() == "64x48 8 fps 12.00 s"
    for start in (1, 3, 124, 160, 249):
        window = load_clip(clips / "long.mp4", max_frames=WINDOW, start=start, **options)
        assert window.num_frames == WINDOW
        # Frame k shows source frame (start + k) // 3: its grey level says which (H.264 keeps it within 2).
        shown = window.frames[:, 8, 8, 0].astype(int)
        expected = 20 + 2 * ((start + np.arange(WINDOW)) // SLOTS_PER_FRAME)
        assert np.abs(shown - expected).max() <= 2, (start, shown[:6], expected[:6])
        # The same frames a decode of the whole clip puts at those slots, where it reaches them.
        reach = min(WINDOW, whole.num_frames - start)
        assert np.array_equal(window.frames[:reach], whole.frames[start : start + reach])
        # The sound from the same instant: the loudness of each second it spans, mid-second.
        offset = round(start / 24 * RATE)
        heard = min(window.audio.shape[1], whole.audio.shape[1] - offset)
        assert heard > RATE and torch.equal(window.audio[:, :heard], whole.audio[:, offset : offset + heard])
        seconds = start / 24 + np.arange(window.audio.shape[1]) / RATE
        for second in range(int(seconds[0]) + 1, int(seconds[-1])):
            middle = window.audio[0, (seconds > second + 0.25) & (seconds < second + 0.75)]
            assert middle.abs().max().item() == pytest.approx(_amplitude(second), rel=0.1), (start, second)


def test_first_keeps_one_sample_per_clip_and_warns_of_the_unused_footage(runs: dict[str, dict]) -> None:
    run = runs["first"]
    assert _ids(run["out"]) == {"long", "mid", "short"}
    table = _both(run["out"])
    # The clip's whole length from its header, not the 2.04 s decoded.
    assert table["long"]["source"] == "64x48 8 fps 12.00 s"
    assert table["long"]["covers"] == "0.00-1.62 of 12.00 s" and table["long"]["frames"] == str(WINDOW)
    assert table["short"]["covers"] == "0.00-0.92 of 1.00 s" and table["short"]["clip"] == "short"
    # 1.62 + 1.62 + 0.92 s of 17 s.
    assert "uses 4.2 s of 17.0 s of footage (25%)" in run["stdout"], run["stdout"]
    warning = [line for line in run["stderr"].splitlines() if "warning" in line]
    assert warning == [
        "h3train encode: warning: most of the footage of 2 clips goes unused: long (14% used), mid (41% used); "
        "--windows uniform would use more"
    ], run["stderr"]


@pytest.mark.parametrize("mode", ["uniform", "slide"])
def test_each_window_is_a_sample_of_its_span(runs: dict[str, dict], mode: str) -> None:
    out = runs[mode]["out"]
    expected = {f"{clip}.w{start:06d}": (clip, start) for clip, starts in STARTS[mode].items() for start in starts}
    assert _ids(out) == set(expected)
    table = _both(out)
    for sample_id, (clip, start) in expected.items():
        folder = out / HELDOUT_NAME if (out / HELDOUT_NAME / f"{sample_id}.safetensors").exists() else out
        sample = read_cached_sample(folder / f"{sample_id}.safetensors")
        frames = 22 if clip == "short" else WINDOW
        assert sample.sample_id == sample_id and sample.num_frames == frames
        duration = {"long": 12.0, "mid": 4.0, "short": 1.0}[clip]
        row = table[sample_id]
        assert row["clip"] == clip and row["outcome"] in ("encoded", "up to date")
        assert row["covers"] == f"{start / 24:.2f}-{(start + frames) / 24:.2f} of {duration:.2f} s"
    if mode == "uniform":  # the last window ends at the clip's end
        assert table["long.w000249"]["covers"] == "10.38-12.00 of 12.00 s"


def test_a_windowed_sample_holds_the_latents_of_its_own_frames_and_sound(
    runs: dict[str, dict], clips: Path, components: Path
) -> None:
    out = runs["uniform"]["out"]
    settings = EncodeSettings(short_edge=32, max_pixels=32 * 64, reference_short_edge=32, min_seconds=0, max_seconds=2)
    pipe = build_pipeline(load_components(components, "cpu", torch.float32), settings)
    whole = load_clip(clips / "long.mp4", 32, 32 * 64, 32, 0, 10_000, RATE)
    samples = {}
    for start in (0, 124):
        sample_id = f"long.w{start:06d}"
        folder = out / HELDOUT_NAME if (out / HELDOUT_NAME / f"{sample_id}.safetensors").exists() else out
        samples[start] = sample = read_cached_sample(folder / f"{sample_id}.safetensors")
        video = encode_video_latents(pipe, whole.frames[start : start + WINDOW])
        assert torch.allclose(sample.video_latents, video, atol=1e-5)
        offset = round(start / 24 * RATE)
        sound = fit_audio(whole.audio[:, offset:], sample.audio_latents.shape[-1] * pipe.audio_vae.hop_length)
        assert torch.allclose(sample.audio_latents, encode_audio_latents(pipe, sound), atol=1e-5)
    # The windows' frames and sound differ, and so do their latents.
    assert not torch.allclose(samples[0].video_latents, samples[124].video_latents, atol=1e-3)
    assert not torch.allclose(samples[0].audio_latents, samples[124].audio_latents, atol=1e-3)


@pytest.mark.parametrize("mode", ["first", "uniform", "slide"])
def test_every_window_of_the_held_out_clip_is_held_out(runs: dict[str, dict], clips: Path, mode: str) -> None:
    out = runs[mode]["out"]
    held = split_heldout(read_clip_folder(clips), 1)[1][0].sample_id
    training = {e.sample_id for e in read_index(out)}
    heldout = {e.sample_id for e in read_index(out / HELDOUT_NAME)}
    cut = STARTS.get(mode, {}).get(held, [None])
    assert heldout == {held if start is None else f"{held}.w{start:06d}" for start in cut}
    assert not any(i == held or i.startswith(f"{held}.w") for i in training)
    assert training and all(not (out / HELDOUT_NAME / f"{i}.safetensors").exists() for i in training)


def test_the_summary_says_the_footage_used_and_which_flag_uses_more(runs: dict[str, dict]) -> None:
    uniform, slide = runs["uniform"], runs["slide"]
    # uniform: 3 windows of the 12 s clip, 2 of the 4 s one (78 of its 96 slots), all of the 1 s one's 22 frames.
    assert "encoded 6, up to date 0, failed 0" in uniform["stdout"]
    assert "uses 9.0 s of 17.0 s of footage (53%)" in uniform["stdout"], uniform["stdout"]
    assert "removed 3 samples of windows these settings no longer cut" in uniform["stderr"]
    assert "long (41% used); a --max-windows above 3 would use more" in uniform["stderr"], uniform["stderr"]
    # slide: the windows at 0 s are where uniform left them and stay; the rest are new or gone.
    assert "encoded 2, up to date 3, failed 0" in slide["stdout"], slide["stdout"]
    assert "removed 3 samples" in slide["stderr"]
    assert "uses 7.4 s of 17.0 s of footage (44%)" in slide["stdout"], slide["stdout"]
    assert "mid (41% used)" in slide["stderr"] and "a --max-windows above 3 would use more" in slide["stderr"]


def test_windows_plan_from_a_clips_length() -> None:
    settings = EncodeSettings(min_seconds=0, max_seconds=2)
    plan = Windowing("uniform").plan("c", 288, settings)
    # As many non-overlapping windows as fit (7 of 39 in 288), evenly from 0 to the end.
    assert [w.start for w in plan] == [0, 41, 83, 124, 166, 207, 249] and {w.frames for w in plan} == {WINDOW}
    assert [w.start for w in Windowing("slide").plan("c", 288, settings)] == [0, 39, 78, 117, 156, 195, 234]
    assert [w.start for w in Windowing("slide", stride=0.5).plan("c", 60, settings)] == [0, 12]
    # A window's own length, cut to the 17 n + 5 rule; a clip shorter than one window is one sample.
    # (four of 22 frames in 100: gaps of 4).
    plan = Windowing("uniform", seconds=1).plan("c", 100, settings)
    assert [(w.start, w.frames) for w in plan] == [(0, 22), (26, 22), (52, 22), (78, 22)]
    assert [w.sample_id for w in Windowing("slide").plan("c", 30, settings)] == ["c.w000000"]
    assert [w.sample_id for w in Windowing().plan("c", 288, settings)] == ["c"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--windows", "unifrom"], "choose one of first, uniform, slide (did you mean 'uniform'?)"),
        (["--windows", "uniform", "--stride", "2"], "--stride applies to --windows slide, not --windows uniform"),
        (["--window-seconds", "30"], "--window-seconds 30 is longer than --max-seconds 15"),
        (["--window-seconds", "0.1"], "--window-seconds 0.1 gives 0 frames"),
        (["--windows", "slide", "--max-windows", "0"], "--max-windows is 0; it takes a value >= 1"),
        (["--max-windows", "2"], "--max-windows applies to --windows uniform or slide"),
    ],
)
def test_a_bad_window_flag_is_one_line_naming_it(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    args = ["encode", str(tmp_path), "--components", str(tmp_path), "--out", str(tmp_path / "o"), "--min-seconds", "0"]
    assert main([*args, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_only_the_encoders_own_samples_of_earlier_windows_are_removed(tmp_path: Path) -> None:
    from h3train.encode.manifest_run import _drop_earlier_windows

    def write(sample_id: str, clip: str | None) -> None:
        (tmp_path / f"{sample_id}.safetensors").write_bytes(b"sample")
        if clip is not None:
            (tmp_path / f"{sample_id}.inputs.json").write_text(f'{{"window": {{"clip": "{clip}"}}}}')

    write("a.w000000", "a")  # planned now: kept
    write("a.w000124", "a")  # an earlier window of a clip of the manifest: removed
    write("a.w000072", None)  # no record of the encoder's: not ours, kept
    write("b.w000124", "b")  # a clip this manifest does not name: kept
    plan = [(None, Windowing("uniform").plan("a", 40, EncodeSettings(min_seconds=0, max_seconds=2))[0])]
    assert _drop_earlier_windows([(tmp_path, plan)], {"a"}) == 1
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "a.w000000.inputs.json",
        "a.w000000.safetensors",
        "a.w000072.safetensors",
        "b.w000124.inputs.json",
        "b.w000124.safetensors",
    ]
