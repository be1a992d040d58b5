"""Audio is not collateral: held-out audio metrics without sound in the training data, and LoRA presets
that move one modality's prediction alone, measured by the held-out drift of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3train.cli import main
from h3train.data.synthetic_dataset import write_synthetic_dataset

from helpers.launch import read_metrics
from helpers.paths import ROOT, TINY_FL2VA

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> str:
    # Synthetic fl2va samples 0 and 1 have a soundtrack.
    folder = tmp_path_factory.mktemp("heldout") / "data"
    write_synthetic_dataset(folder, task="fl2va", num_samples=2, seed=7, text_dim=16)
    return str(folder)


def _last_validation(run: Path, config: Path, heldout: str, *extra: str) -> dict:
    args = [
        "train",
        str(config),
        f"logging.dir={run}",
        "logging.progress=false",
        "checkpoint.every=0",
        "train.steps=3",
        "optim.lr=5e-2",
        f"validation.dataset={heldout}",
        "validation.sigmas=[0.3,0.7]",
        "validation.every=3",
        *extra,
    ]
    assert main(args) == 0
    return [r for r in read_metrics(run) if r.get("kind") == "validation"][-1]


def test_heldout_audio_is_measured_when_the_training_data_has_no_sound(tmp_path: Path, heldout: str) -> None:
    row = _last_validation(tmp_path / "run", TINY_FL2VA, heldout, "data.synthetic.has_audio=false")
    assert all(r.get("loss_audio") is None for r in read_metrics(tmp_path / "run") if "loss" in r)
    for key in ("val/loss_audio", "val/drift_audio", "val/guidance_ratio_audio", "val/guidance_cos_audio@0.30"):
        assert row[key] is not None, key
    # Trained on silent clips only, the audio prediction moved all the same, and it shows.
    assert row["val/loss_audio"] > 0 and row["val/drift_audio"] > 0 and row["val/guidance_ratio_audio"] > 0


@pytest.mark.parametrize(
    ("preset", "moved", "kept"), [("video_only", "video", "audio"), ("audio_only", "audio", "video")]
)
def test_a_one_modality_preset_leaves_the_other_prediction_exactly_as_it_was(
    preset: str, moved: str, kept: str, tmp_path: Path, heldout: str
) -> None:
    row = _last_validation(tmp_path / "run", TINY_LORA, heldout, f"lora.target_modules={preset}")
    assert row[f"val/drift_{moved}"] > 1e-6
    assert row[f"val/drift_{kept}"] == 0.0 and row[f"val/guidance_cos_{kept}"] == pytest.approx(1.0, abs=1e-12)
