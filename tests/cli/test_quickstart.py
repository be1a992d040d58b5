"""The README's "Your first LoRA on your own clips", run as written on a folder of clips a user might have.

The section's bash block runs in a fresh folder (with the repository's `configs/` beside it, as in a
checkout) with `.venv/bin` on the PATH, then its Python block; the clips differ in size, frame rate,
length and sound, as a user's do. The folder also holds a checkout named `h3train` (with the `data/`
the quickstart writes in it), as the folder a user cloned into does: the Python block must import the
installed package, not that folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import av
import pytest
import yaml

from h3train.checkpoint import read_trainer_state
from h3train.data.dataset_index import read_index
from h3train.encode.media import moving_pattern, sine_tone, write_video
from h3train.render.side_by_side import bar_height

from helpers.launch import read_metrics, run_env
from helpers.paths import ROOT

SECTION = "## Your first LoRA on your own clips"
# (name, width, height, fps, seconds, sound) of the user's clips.
CLIPS = [
    ("beach", 96, 64, 25, 2.0, True),
    ("door", 64, 64, 30, 1.5, True),
    ("street", 64, 96, 24, 2.5, False),
    ("kite", 112, 64, 30, 1.2, True),
]


def _blocks(kind: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    section = text[start : text.index("\n## ", start + len(SECTION))]
    return re.findall(rf"```{kind}\n(.*?)```", section, re.DOTALL)


def _user_clips(folder: Path) -> None:
    folder.mkdir()
    for i, (name, width, height, fps, seconds, sound) in enumerate(CLIPS):
        frames = moving_pattern(round(fps * seconds), height, width, seed=i)
        audio = sine_tone(seconds, 220.0 * (i + 1), 44100) if sound else None
        write_video(folder / f"{name}.mp4", frames, fps, audio, 44100)
        (folder / f"{name}.txt").write_text(f"a {name} scene, clip {i}\n")


def _clone(folder: Path, package: bool) -> Path:
    """A checkout as cloning leaves it, `folder/h3train`, with the `data/` the quickstart writes in it.

    Seen from `folder`, Python's first path entry (the working directory) holds a folder `h3train`
    without an `__init__.py`, and in it a `data` folder, which shadow `h3train.data` unless the install
    wins. `package` copies what an install builds from (the Dockerfile's copies).
    """
    clone = folder / "h3train"
    (clone / "data" / "mine").mkdir(parents=True)
    if package:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, clone / name)
        shutil.copytree(ROOT / "h3train", clone / "h3train", ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def test_the_editable_install_wins_over_a_folder_named_like_the_package(tmp_path: Path) -> None:
    # pip builds it in an isolated env with today's setuptools; from 70.1 setuptools builds wheels alone.
    pytest.importorskip("setuptools", minversion="70.1", reason="the editable install is built by setuptools")
    clone = _clone(tmp_path, package=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # What `pip install -e .` (make install) builds: PEP 660's editable wheel.
    build = f"from setuptools import build_meta; print(build_meta.build_editable({str(wheels)!r}))"
    built = subprocess.run([sys.executable, "-c", build], cwd=clone, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    with zipfile.ZipFile(wheels / built.stdout.strip().splitlines()[-1]) as wheel:
        pth = [name for name in wheel.namelist() if name.endswith(".pth")]
        lines = [wheel.read(name).decode().strip() for name in pth]
    assert lines == [str(clone.resolve())], (
        f"the editable install does not put the checkout on sys.path (its .pth files: {pth} {lines}), so a "
        "folder named h3train in the working directory shadows the package: keep pyproject.toml's package-dir"
    )
    # A .pth line joins sys.path at start-up, after the working directory, which always comes first. It
    # goes in right after the working directory here, before the checkout this suite runs from (whose own
    # editable install is on the path too), so that the package found is the copy's.
    code = (
        f"import sys; sys.path.insert(1, {lines[0]!r}); "
        "from h3train.data.components import load_processor; import h3train; print(h3train.__file__)"
    )
    env = {k: v for k, v in run_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip().splitlines()[-1]) == clone.resolve() / "h3train" / "__init__.py"


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    (bash,), (python,) = _blocks("bash"), _blocks("python")
    _user_clips(tmp_path / "clips")
    _clone(tmp_path, package=False)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = run_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", bash], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]

    # encode: every clip kept, one held out, a table line each.
    data = tmp_path / "data" / "mine"
    held = read_index(data / "heldout")
    assert len(read_index(data)) == 3 and len(held) == 1
    assert len((data / "clips.tsv").read_text().splitlines()) == 1 + 3
    # train: 10 steps on 2 ranks, held-out loss at 0, 5 and 10, the sample rendered, a summary.
    run = tmp_path / "runs" / "mine"
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "kind" not in r] == list(range(1, 11))
    assert [r["step"] for r in rows if r.get("kind") == "validation"] == [0, 5, 10]
    assert (run / "samples" / "step_10" / "drift.mp4").stat().st_size > 0
    assert "last checkpoint: " in proc.stdout and "step_00000010" in proc.stdout
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["parallel"]["sp"] == 2 and config["task"]["name"] == "t2va"
    # task.name=t2va trains the `transformer` partition of the stand-in.
    base = read_trainer_state(run / "checkpoints" / "step_00000010")["lora_base"]
    assert Path(base["folder"]) == (tmp_path / "stand_in" / "transformer").resolve()
    # export: the diffusers LoRA file of the run's newest checkpoint.
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # generate --compare: base and fine-tune side by side at the run's sample shape, a sound stream each.
    with av.open(str(run / "compare.mp4")) as container:
        video, audio = container.streams.video, container.streams.audio
        assert (video[0].codec_context.width, video[0].codec_context.height) == (2 * 96, 64 + bar_height(96))
        assert len(audio) == 2 and all(s.codec_context.channels == 2 for s in audio)
    assert re.search(r"prompt_0: guidance ratio video \d", proc.stdout), proc.stdout[-2000:]

    generated = subprocess.run(
        [sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert generated.returncode == 0, generated.stderr[-4000:]
    assert generated.stdout.strip().splitlines()[-1].startswith("torch.Size([1, 124, 3, 64, 96]) torch.Size([1, 2, ")
