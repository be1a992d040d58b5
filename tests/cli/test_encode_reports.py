"""`h3train encode` names everything it leaves out or gets wrong: every file of a clip folder that becomes
no sample (stills, other files, captions without a clip), a manifest's still as no clip, samples shorter
than the pipeline renders and clips scaled up past 2x, each with the setting that changes it."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from h3train.cli import main
from h3train.data.components import write_tiny_components
from h3train.data.dataset_index import read_index
from h3train.encode.manifest_run import SHORTEST_RENDERED
from h3train.encode.media import FPS, moving_pattern, write_video

# Small canvases keep the VAEs cheap; every clip is kept however short (--min-seconds 0).
FLAGS = ["--short-edge", "32", "--max-pixels", str(32 * 64), "--reference-short-edge", "32", "--min-seconds", "0",
         "--device", "cpu", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("components"))


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ok` a clip of one second; `tiny` half a second of 16x12 pixels; captioned and bare stills; other files."""
    folder = tmp_path_factory.mktemp("clips")
    write_video(folder / "ok.mp4", moving_pattern(24, 48, 64, 1), 24)
    write_video(folder / "tiny.mp4", moving_pattern(12, 12, 16, 2), 24)
    for name in ("ok", "tiny", "a", "b"):
        (folder / f"{name}.txt").write_text(f"a caption of {name}\n")
    for name in ("a.png", "b.png", "c.jpg"):
        Image.fromarray(moving_pattern(1, 48, 64, 3)[0]).save(folder / name)
    (folder / "notes.md").write_text("shot list\n")
    (folder / "orphan.txt").write_text("a caption of nothing\n")
    (folder / ".DS_Store").write_bytes(b"\0")
    return folder


def _encode(capsys, source: Path, components: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["encode", str(source), "--components", str(components), "--out", str(out), *FLAGS, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def encoded(clip_folder: Path, components: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """The clip folder encoded once: the dataset folder, the console's stdout and stderr."""
    out = tmp_path_factory.mktemp("encoded") / "data"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["encode", str(clip_folder), "--components", str(components), "--out", str(out), *FLAGS])
    assert code == 0, stderr.getvalue()
    return out, stdout.getvalue(), stderr.getvalue()


def test_a_clip_folder_names_every_file_it_skips(encoded: tuple[Path, str, str]) -> None:
    data, out, _ = encoded
    assert {e.sample_id for e in read_index(data)} == {"ok", "tiny"}
    skipped = [line for line in out.splitlines() if line.startswith("skipped")]
    assert skipped == [
        "skipped 1 file, captions without a clip of the same name: 'orphan.txt'",
        "skipped 3 files, image files are not clips (a sample is a video; stills serve as keyframes or references): "
        "'a.png', 'b.png', 'c.jpg'",
        "skipped 1 file, not a clip (clips are .mp4, .mov, .mkv, .webm, .avi, .m4v): 'notes.md'",
    ], out


def test_short_and_upscaled_clips_are_warned_of_with_their_setting(
    encoded: tuple[Path, str, str], clip_folder: Path, components: Path, tmp_path: Path, capsys
) -> None:
    data, _, err = encoded
    warnings = [line for line in err.splitlines() if "warning" in line]
    floor = f"{SHORTEST_RENDERED / FPS:.2f}"
    # Half a second at 24 fps is 12 frames, 5 by the 17 n + 5 rule; the 16x12 clip lands on a 43x32 canvas or more.
    (short,) = [line for line in warnings if "shorter than" in line]
    assert short.startswith(
        f"h3train encode: warning: 1 sample shorter than the {SHORTEST_RENDERED} frames ({floor} s) the pipeline "
        "renders at least: 'tiny' (5 frames of a 0.50 s clip); "
        f"--min-seconds {floor} (now 0) leaves such clips out"
    ), short
    (upscaled,) = [line for line in warnings if "scaled up" in line]
    assert "1 clip scaled up more than 2x onto the canvas: 'tiny' (16x12 -> " in upscaled, upscaled
    assert "a lower --short-edge (now 32)" in upscaled
    # No flag cuts a second window out of half a second: the unused footage is not advertised as windows'.
    assert not [line for line in warnings if "--windows" in line], warnings
    # The advice holds: --min-seconds at the floor leaves the short clip out and keeps the one-second clip.
    again = Path(shutil.copytree(data, tmp_path / "data"))
    code, out, err = _encode(capsys, clip_folder, components, again, "--min-seconds", floor)
    assert code == 0, err
    assert {e.sample_id for e in read_index(again)} == {"ok"}
    assert "failed (too short): 'tiny'" in out, out


def test_a_clip_folder_failure_names_its_file_not_a_manifest_line(
    clip_folder: Path, components: Path, tmp_path: Path, capsys
) -> None:
    folder = Path(shutil.copytree(clip_folder, tmp_path / "clips"))
    (folder / "broken.mp4").write_bytes(b"not a video at all" * 64)
    (folder / "broken.txt").write_text("a broken clip\n")
    code, out, err = _encode(capsys, folder, components, tmp_path / "data")
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("h3train encode: broken")]
    assert line.startswith("h3train encode: broken (file 'broken.mp4'): ") and "manifest line" not in err, err
    assert "failed (unusable media): 'broken'" in out, out


def test_a_manifest_still_fails_as_no_clip(clip_folder: Path, components: Path, tmp_path: Path, capsys) -> None:
    for name in ("ok.mp4", "a.png"):
        shutil.copy(clip_folder / name, tmp_path / name)
    rows = [{"video": "ok.mp4", "prompt": "a square"}, {"video": "a.png", "prompt": "a still", "id": "still"}]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = _encode(capsys, tmp_path / "manifest.jsonl", components, tmp_path / "data")
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("h3train encode: still")]
    assert line.startswith("h3train encode: still (manifest line 2): NotAClip: image files are not clips: 'a.png'")
    assert "too short" not in err, err
    assert "failed (image, not a clip): 'still'" in out, out


def test_a_short_edge_over_the_presets_area_names_the_preset(
    clip_folder: Path, components: Path, tmp_path: Path, capsys
) -> None:
    capsys.readouterr()
    code = main(["encode", str(clip_folder), "--components", str(components), "--out", str(tmp_path / "o"),
                 "--short-edge", "256"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--short-edge 256 needs a canvas of at least 65536 pixels, but max pixels 6144 comes from the preset" in err
    assert "h3train_encode_preset.json" in err and "pass --max-pixels 65536 or more too" in err
