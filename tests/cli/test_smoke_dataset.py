"""The first GPU session's smoke dataset: `h3train synth --config CONFIG` writes samples at the released
geometry and text width that `h3train check CONFIG --strict` accepts, so a new cluster's launcher
(which runs `check --strict`) passes before any data is encoded. `--strict` still wants the model's
config.json: the test gives it the released architecture's, as a copied model folder would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3train.data.dataset_index import read_index
from h3train.tasks.released import LONGEST_GEOMETRY, LONGEST_ROWS

from helpers.launch import run_cli
from helpers.paths import ROOT

CONFIG = ROOT / "configs" / "h3_fl2va_lora_a100.yaml"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sample is enough for `check --strict`; each is the released clip, about 60 MiB."""
    from h3train.cli import main

    out = tmp_path_factory.mktemp("smoke")
    assert main(["synth", "--config", str(CONFIG), "--out", str(out), "--num-samples", "1"]) == 0
    return out


@pytest.fixture()
def model_folder(tmp_path: Path) -> Path:
    """A model folder holding only the transformer's config.json: the released architecture (diffusers' defaults)."""
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel"}))
    return tmp_path


def test_the_smoke_dataset_is_the_released_clip_of_the_configs_task(smoke: Path) -> None:
    [entry] = read_index(smoke)
    assert entry.task == "fl2va"
    assert entry.seq_len == LONGEST_ROWS
    geometry = entry.geometry
    assert (
        geometry.num_latent_frames,
        geometry.latent_height,
        geometry.latent_width,
        geometry.num_audio_latents,
    ) == LONGEST_GEOMETRY


def test_check_strict_accepts_the_smoke_dataset(smoke: Path, model_folder: Path, capsys) -> None:
    args = ["check", str(CONFIG), "--world-size", "8", "--strict", f"data.path={smoke}"]
    rc, out, err = run_cli(capsys, [*args, f"model.pretrained={model_folder}"])
    assert rc == 0, err
    assert f"sequence      {LONGEST_ROWS:,} rows (longest sample in the dataset index" in out
    assert "fits: yes" in out and "assumed:" not in out


def test_check_strict_still_wants_the_model_folder(smoke: Path, tmp_path: Path, capsys) -> None:
    args = ["check", str(CONFIG), "--world-size", "8", "--strict", f"data.path={smoke}"]
    rc, _, err = run_cli(capsys, [*args, f"model.pretrained={tmp_path / 'no_model'}"])
    assert rc == 2 and "no transformer config at" in err


def test_synth_refuses_a_task_its_config_does_not_train(tmp_path: Path, capsys) -> None:
    args = ["synth", "--config", str(CONFIG), "--out", str(tmp_path / "d"), "--task", "ref2va"]
    rc, _, err = run_cli(capsys, args)
    assert rc == 2 and "--task is ref2va but --config" in err and "gives fl2va" in err
    assert not (tmp_path / "d" / "index.jsonl").exists()
