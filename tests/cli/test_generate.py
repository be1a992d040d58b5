"""`h3train generate`: a trained result rendered on the stand-in, alone or beside its base.

One tiny LoRA run trains two steps at 96x64 on the stand-in's `transformer` partition (its base is the
stand-in itself, as `model.pretrained`), and is exported once as a diffusers and a ComfyUI LoRA file and merged
into a transformer folder. Renders are one t2va request, 22 frames on 64x64, 2 sigma points (one
denoising step); the raw arrays of each render are compared before any encoding, and the mp4s the
command writes are decoded with PyAV.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from h3train.cli import main
from h3train.data.components import write_tiny_components
from h3train.render.side_by_side import bar_height, halves
from h3train.render.weights import detect_source
from h3train.run import rendering as generate_module
from h3train.run.rendering import TRACK_TITLES, Generator, Rendered, read_requests, request_partition

from helpers.launch import run_cli, run_forked, train

STEPS = 2
REQUEST = {"frames": 22, "resolution": "64x64", "seed": 3}
FLAGS = ["--steps", str(STEPS), "--frames", "22", "--resolution", "64x64", "--seed", "3"]
PROMPT = "a square hums"


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("components"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, components: Path) -> Path:
    folder = tmp_path_factory.mktemp("generate")
    cfg = {
        "model": {"pretrained": str(components), "dtype": "float32", "attention_backend": "native"},
        "task": {"name": "t2va"},
        # Trained at 96x64 (4 x 6 latents of 16 pixels), without validation.samples: renders default to that canvas.
        "data": {"source": "synthetic", "synthetic": {"num_samples": 4, "text_len": 13, "num_latent_frames": 2,
                                                      "latent_height": 4, "latent_width": 6, "num_audio_latents": 4}},
        "lora": {"rank": 4, "alpha": 8},
        "train": {"steps": 2, "seed": 0},
        "optim": {"lr": 1.0e-2, "warmup_steps": 0},
        "checkpoint": {"every": 2},
        "logging": {"dir": str(folder / "run"), "progress": False},
    }  # fmt: skip
    (folder / "run.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    train(["train", str(folder / "run.yaml")])
    run = folder / "run"
    assert main(["export", str(run), "--out", str(run / "lora")]) == 0
    assert main(["export", str(run), "--out", str(run / "comfy"), "--format", "comfyui"]) == 0
    assert main(["export", str(run), "--out", str(run / "merged"), "--merge"]) == 0
    return run


@pytest.fixture(scope="module")
def lora_file(run: Path) -> Path:
    return run / "lora" / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def untrained_lora(run: Path, lora_file: Path) -> Path:
    """The trained file with every `lora_B` zeroed: a LoRA as it starts training."""
    tensors = load_file(lora_file)
    assert any("lora_B" in k for k in tensors)
    zeroed = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}
    folder = run / "untrained"
    folder.mkdir(exist_ok=True)
    save_file(zeroed, folder / "pytorch_lora_weights.safetensors")
    return folder / "pytorch_lora_weights.safetensors"


def _render(source: Path | None, components: Path, compare: bool = False) -> Rendered:
    """One request rendered through `Generator`, the raw arrays before any encoding."""
    detected = detect_source(source) if source is not None else None
    requests = read_requests([PROMPT], None, REQUEST)
    partition = request_partition(detected, requests)
    generator = Generator(detected, components, partition, torch.device("cpu"), torch.float32, STEPS, compare)
    (cond,) = generator.encode(requests)
    return generator.render(cond)


@pytest.fixture(scope="module")
def renders(run: Path, components: Path, lora_file: Path, untrained_lora: Path) -> dict[str, Rendered]:
    return {
        "base": _render(None, components),
        "lora": _render(lora_file, components),
        "compare": _render(lora_file, components, compare=True),
        "untrained": _render(untrained_lora, components, compare=True),
        "comfyui": _render(run / "comfy" / "lora_comfyui.safetensors", components),
        "merged": _render(run / "merged", components),
    }


def _streams(path: Path) -> tuple[int, tuple[int, int], list[tuple[int, str]]]:
    """Decoded frame count, (height, width) and each audio stream's (channels, title) of an mp4."""
    with av.open(str(path)) as container:
        audio = [(s.codec_context.channels, s.metadata.get("handler_name", "")) for s in container.streams.audio]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return len(frames), frames[0].shape[:2], audio


def test_a_lora_file_renders_a_playable_mp4_with_stereo_sound(tmp_path, capsys, components, lora_file) -> None:
    out = tmp_path / "clip.mp4"
    rc, stdout, _ = run_cli(
        capsys,
        ["generate", str(lora_file), "--components", str(components), "--prompt", PROMPT, "--out", str(out), *FLAGS],
    )
    assert rc == 0
    count, size, audio = _streams(out)
    assert (count, size) == (22, (64, 64))
    assert [channels for channels, _ in audio] == [2]
    assert f"[1/1] prompt_0: {out}" in stdout and "eta 0:00:00" in stdout


def test_every_kind_of_source_renders_what_the_diffusers_lora_file_renders(renders) -> None:
    lora = renders["lora"]
    # The ComfyUI file goes through diffusers' converter, the merged folder holds the adapters folded in.
    for name in ("comfyui", "merged"):
        assert np.abs(renders[name].frames.astype(int) - lora.frames.astype(int)).max() <= 2, name
        torch.testing.assert_close(renders[name].audio, lora.audio, atol=1e-3, rtol=1e-3)
    # The trained adapters change the render: the base's differs.
    assert not np.array_equal(renders["base"].frames, lora.frames)


def test_compare_puts_the_base_render_and_the_fine_tune_render_side_by_side(renders) -> None:
    compare, base, lora = renders["compare"], renders["base"], renders["lora"]
    # Each half is the render made alone: the base from --components only, the fine-tune without --compare.
    np.testing.assert_array_equal(compare.base_frames, base.frames)
    np.testing.assert_array_equal(compare.frames, lora.frames)
    torch.testing.assert_close(compare.base_audio, base.audio, rtol=0, atol=0)
    torch.testing.assert_close(compare.audio, lora.audio, rtol=0, atol=0)
    frames, tracks, titles = compare.clip()
    assert frames.shape == (22, bar_height(64) + 64, 128, 3)
    left, right = halves(frames)
    np.testing.assert_array_equal(left, base.frames)
    np.testing.assert_array_equal(right, lora.frames)
    # The two labels differ: the bars are not blank.
    assert not np.array_equal(frames[:, : bar_height(64), :64], frames[:, : bar_height(64), 64:])
    assert titles == TRACK_TITLES and tracks[0] is compare.base_audio and tracks[1] is compare.audio


def test_an_untrained_lora_keeps_the_base_guidance_whole_and_a_trained_one_moves_it(renders) -> None:
    for modality, (ratio, cos) in renders["untrained"].guidance.items():
        assert ratio == pytest.approx(1.0, abs=1e-12) and cos == pytest.approx(1.0, abs=1e-12), modality
    np.testing.assert_array_equal(renders["untrained"].frames, renders["base"].frames)
    ratio, cos = renders["compare"].guidance["video"]
    assert math.isfinite(ratio) and math.isfinite(cos) and 0 < cos <= 1
    assert abs(ratio - 1) > 1e-6 or abs(cos - 1) > 1e-6


def test_compare_of_a_run_folder_writes_one_mp4_with_two_titled_stereo_streams_and_the_guidance(
    tmp_path, capsys, run
) -> None:
    out = tmp_path / "side.mp4"
    # The run's newest checkpoint, on the components its config names (model.pretrained).
    rc, stdout, _ = run_cli(capsys, ["generate", str(run), "--prompt", PROMPT, "--out", str(out), "--compare", *FLAGS])
    assert rc == 0
    assert "step_00000002: the newest complete checkpoint" in stdout
    count, size, audio = _streams(out)
    assert (count, size) == (22, (bar_height(64) + 64, 128))
    assert audio == [(2, "base"), (2, "fine-tune")]
    line = next(line for line in stdout.splitlines() if "guidance ratio" in line)
    numbers = [float(x) for x in re.findall(r"(?:video|audio) ([-\d.]+)", line)]
    assert len(numbers) == 4 and all(math.isfinite(x) for x in numbers), line
    assert "first denoising step" in line


def test_compare_of_a_run_renders_at_its_training_canvas_and_says_so_first(tmp_path, capsys, run) -> None:
    out = tmp_path / "canvas.mp4"
    # No --frames nor --resolution, and the run has no validation.samples: its data's 96x64 and 2 latent
    # frames, which render as the fewest pixel frames the decoder takes (22).
    rc, stdout, _ = run_cli(
        capsys, ["generate", str(run), "--prompt", PROMPT, "--out", str(out), "--compare", "--steps", str(STEPS)]
    )
    assert rc == 0
    first = stdout.splitlines()[0]
    assert first.startswith("rendering 96x64, 22 frames (0.9 s at 24 fps), the run's training canvas"), first
    assert "data.synthetic" in first and "--resolution and --frames set another" in first, first
    count, size, _ = _streams(out)
    assert (count, size) == (22, (bar_height(64) + 64, 2 * 96))


def test_flags_win_over_the_training_canvas_and_the_first_line_names_them(tmp_path, capsys, run, monkeypatch):
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: [])
    rc, stdout, _ = run_cli(
        capsys, ["generate", str(run), "--prompt", PROMPT, "--out", str(tmp_path / "x.mp4"), *FLAGS]
    )
    assert rc == 0
    first = stdout.splitlines()[0]
    assert first.startswith("rendering 64x64, 22 frames (0.9 s at 24 fps): 1 request with run "), first


def test_ranks_render_their_share_into_files_of_their_own(tmp_path, components, lora_file) -> None:
    lines = [{"id": "one", "prompt": "a square hums"}, {"id": "two", "prompt": "a square drifts", "seed": 4}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "clips" / "x.mp4"
    args = ["generate", str(lora_file), "--components", str(components), "--requests", str(requests),
            "--out", str(out), *FLAGS]  # fmt: skip
    proc = run_forked(args, nproc=2)
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.one.mp4", "x.two.mp4"]
    assert "rank 0: [1/1] one" in proc.stdout and "rank 1: [1/1] two" in proc.stdout
    for name in ("x.one.mp4", "x.two.mp4"):
        assert _streams(out.parent / name)[:2] == (22, (64, 64))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp, comp: tmp / "missing", "does not exist; pass a run folder (logging.dir)"),
        (lambda tmp, comp: _write(tmp / "notes.txt", "hello"), "is a file but no LoRA file"),
        (lambda tmp, comp: _mkdir(tmp / "empty"), "is a folder of none of the kinds generate takes"),
        (lambda tmp, comp: comp, "is a pipeline folder: pass it as --components"),
    ],
)
def test_a_bad_source_is_one_line_before_any_model_loads(tmp_path, capsys, components, monkeypatch, make, says):
    def no_models(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(generate_module.Generator, "__init__", no_models)
    source = make(tmp_path, components)
    rc, _, err = run_cli(capsys, ["generate", str(source), "--components", str(components), "--prompt", PROMPT,
                               "--out", str(tmp_path / "x.mp4")])  # fmt: skip
    (line,) = err.strip().splitlines()
    assert rc == 2 and line.startswith("h3train: error: SOURCE ") and says in line, line
    assert not (tmp_path / "x.mp4").exists()


def test_a_bad_request_line_names_the_file_line_and_field(tmp_path, capsys, components, lora_file, monkeypatch):
    monkeypatch.setattr(generate_module.Generator, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "fine"}\n\n{"prompt": "x", "frame": 22}\n')
    rc, _, err = run_cli(capsys, ["generate", str(lora_file), "--components", str(components), "--requests",
                               str(requests), "--out", str(tmp_path / "x.mp4")])  # fmt: skip
    (line,) = err.strip().splitlines()
    assert rc == 2 and f"'{requests}' line 3 field 'frame'" in line and "(did you mean 'frames'?)" in line, line
    requests.write_text('{"prompt": "x", "frames": 23}\n')
    rc, _, err = run_cli(capsys, ["generate", str(lora_file), "--components", str(components), "--requests",
                               str(requests), "--out", str(tmp_path / "x.mp4")])  # fmt: skip
    (line,) = err.strip().splitlines()
    assert rc == 2 and f"'{requests}' line 1 field 'frames' is 23" in line, line


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path
