"""The stand-in folder `h3train tiny-components` writes: a MiniMax-H3 diffusers pipeline of tiny random weights.

One folder and one LoRA run for the module. The folder loads with
`MiniMaxH3ModularPipeline.from_pretrained` from local files only, `h3train train` trains a LoRA with
it as `model.pretrained`, diffusers' `load_lora_weights` loads the export into the folder's pipeline
and changes what its transformer computes (to exactly what the merged export computes), and the
pipeline generates a clip on the CPU on the canvas of the folder's encode preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size
from safetensors.torch import load_file
from transformers.utils import is_torchvision_available

from h3train.checkpoint import read_trainer_state
from h3train.cli import main
from h3train.config import load_config
from h3train.data.components import (
    TINY_TEXT_HIDDEN,
    ComponentsError,
    encode_preset,
    load_processor,
    write_tiny_components,
)
from h3train.data.stand_in import ENCODE_PRESET_FILE, PARTITIONS, TINY_ENCODE_PRESET
from h3train.encode import EncodeSettings
from h3train.model.sp_forward import FORWARD_ARGS
from h3train.render.pipeline import AUDIO_SHIFT, VIDEO_SHIFT

from helpers.launch import checkpoint_dir, dump_dir, tiny_args
from helpers.paths import ROOT

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
TINY_DEMO = ROOT / "configs" / "tiny_demo.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_components(tmp_path_factory.mktemp("stand_in") / "H3")


@pytest.fixture(scope="module")
def lora_run(stand_in: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny_lora.yaml trained `STEPS` steps from the stand-in: `model.pretrained=DIR` on the
    command line replaces the file's `model.config`."""
    run = tmp_path_factory.mktemp("lora") / "run"
    args = [f"model.pretrained={stand_in}", f"train.steps={STEPS}", f"debug.dump_step={STEPS}"]
    assert main(tiny_args(run, *args, config=TINY_LORA)) == 0
    return run


def _export(run: Path, out: Path, *extra: str) -> Path:
    assert main(["export", str(checkpoint_dir(run, STEPS)), "--out", str(out), *extra]) == 0
    return out


def _pipeline(folder: Path) -> MiniMaxH3ModularPipeline:
    """The README's load: the pipeline and every component from the folder, nothing downloaded.

    Without torchvision transformers cannot build Qwen3-VL's processor (its video half needs it), so
    that one is h3train's build of the same files.
    """
    pipe = MiniMaxH3ModularPipeline.from_pretrained(str(folder), local_files_only=True)
    names = pipe.pretrained_component_names
    if not is_torchvision_available():
        names = [name for name in names if name != "processor"]
        pipe.update_components(processor=load_processor(folder / "processor"))
    pipe.load_components(names=names, local_files_only=True)
    return pipe


def _forward(model: MiniMaxH3Transformer3DModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        video, audio = model(**inputs, return_dict=False)
    return torch.cat([video.flatten(), audio.flatten()]).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- the folder ------------------------------------------------------------------------------------


def test_folder_is_a_small_pipeline_folder_of_every_component_the_blocks_load(stand_in: Path) -> None:
    index = json.loads((stand_in / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    components = {name for name, value in index.items() if isinstance(value, list)}
    assert components == set(MiniMaxH3ModularPipeline().pretrained_component_names)
    assert components == {p.name for p in stand_in.iterdir() if p.is_dir()}
    # No repository named: every component comes from the folder, and nothing can be downloaded.
    assert all(index[name][2]["pretrained_model_name_or_path"] is None for name in components)
    size = sum(p.stat().st_size for p in stand_in.rglob("*") if p.is_file())
    assert size < 16 * 2**20, f"{size / 2**20:.1f} MB"


def test_transformers_are_the_tiny_configs_architecture_reading_the_text_encoders_width(stand_in: Path) -> None:
    demo = dict(load_config(TINY_DEMO).model.config)
    lora = dict(load_config(TINY_LORA).model.config)
    text = json.loads((stand_in / "text_encoder" / "config.json").read_text())["text_config"]
    assert demo["text_dim"] == text["hidden_size"] == TINY_TEXT_HIDDEN
    # tiny_lora's synthetic prompts take their width from the model: only text_dim differs.
    lora_architecture = {key: value for key, value in lora.items() if key != "text_dim"}
    weights = {}
    for name in PARTITIONS:
        config = json.loads((stand_in / name / "config.json").read_text())
        assert {key: config[key] for key in demo} == demo, name
        assert {key: config[key] for key in lora_architecture} == lora_architecture, name
        weights[name] = load_file(stand_in / name / "diffusion_pytorch_model.safetensors")
    first, second = (weights[name] for name in PARTITIONS)
    assert first.keys() == second.keys()
    assert any(not torch.equal(first[key], second[key]) for key in first), "the two partitions share weights"
    # Stored as released: bfloat16 but for the float32 islands.
    islands = tuple(f"{name}." for name in MiniMaxH3Transformer3DModel._keep_in_fp32_modules)
    dtypes = {key: value.dtype for key, value in first.items()}
    assert {dtype for key, dtype in dtypes.items() if key.startswith(islands)} == {torch.float32}
    assert {dtype for key, dtype in dtypes.items() if not key.startswith(islands)} == {torch.bfloat16}


def test_pipeline_loads_every_component_from_the_folder_alone(stand_in: Path) -> None:
    pipe = _pipeline(stand_in)
    assert pipe.null_component_names == []
    assert (pipe.scheduler.shift, pipe.audio_scheduler.shift) == (VIDEO_SHIFT, AUDIO_SHIFT)
    assert pipe.transformer.config.text_dim == pipe.text_encoder.config.text_config.hidden_size
    canvas = (pipe.config.canvas_short_edge, pipe.config.canvas_max_pixels, pipe.config.reference_image_short_edge)
    preset = TINY_ENCODE_PRESET
    assert canvas == (preset["short_edge"], preset["max_pixels"], preset["reference_short_edge"])


# -- the encode preset -----------------------------------------------------------------------------


def test_encode_preset_states_valid_settings_for_the_tiny_models(stand_in: Path) -> None:
    preset = encode_preset(stand_in)
    assert preset == TINY_ENCODE_PRESET
    EncodeSettings(**preset).validate()


def test_a_folder_without_a_preset_has_none(tmp_path: Path) -> None:
    assert encode_preset(tmp_path) is None
    assert encode_preset(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "cannot be read"),
        ("[64]", "JSON object"),
        ('{"short_edge": 64, "frames": 22}', "unknown key 'frames'"),
        ('{"short_edge": "64"}', "'short_edge' is '64'"),
        ('{"max_pixels": 6144.5}', "'max_pixels' is 6144.5"),
        ('{"min_seconds": true}', "'min_seconds' is True"),
    ],
    ids=["not_json", "not_object", "unknown_key", "text_edge", "fractional_pixels", "bool_seconds"],
)
def test_a_bad_preset_is_one_error_naming_the_file(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / ENCODE_PRESET_FILE).write_text(text)
    with pytest.raises(ComponentsError) as err:
        encode_preset(tmp_path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and ENCODE_PRESET_FILE in message and needle in message, message


# -- a LoRA trained from the folder ----------------------------------------------------------------


def test_lora_run_trains_on_the_stand_in_base(stand_in: Path, lora_run: Path) -> None:
    base = read_trainer_state(checkpoint_dir(lora_run, STEPS))["lora_base"]
    assert base["kind"] == "pretrained" and Path(base["folder"]) == (stand_in / "transformer").resolve()


def test_lora_export_loads_into_the_pipeline_and_forwards_like_the_merged_export(
    stand_in: Path, lora_run: Path, tmp_path: Path
) -> None:
    tensors = load_file(dump_dir(lora_run, STEPS) / "inputs.safetensors")
    inputs = {name: tensors[f"m0.{name}"] for name in FORWARD_ARGS}
    pipe = _pipeline(stand_in)
    before = _forward(pipe.transformer, inputs)
    pipe.load_lora_weights(str(_export(lora_run, tmp_path / "lora")))
    after = _forward(pipe.transformer, inputs)
    assert _rel(after, before) > 1e-6, "the LoRA changed nothing"
    merged = MiniMaxH3Transformer3DModel.from_pretrained(_export(lora_run, tmp_path / "merged", "--merge"))
    assert _rel(after, _forward(merged.eval(), inputs)) <= 1e-5


def test_pipeline_with_the_lora_generates_a_clip_on_the_preset_canvas(
    stand_in: Path, lora_run: Path, tmp_path: Path
) -> None:
    pipe = _pipeline(stand_in)
    pipe.load_lora_weights(str(_export(lora_run, tmp_path / "lora")))
    frames = 124  # 17 * 7 + 5: the shortest clip of the form the video VAE decodes within the pipeline's 5 s floor
    out = pipe(
        prompt="a square drifts over a gradient",
        num_frames=frames,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        output=["videos", "audio", "sampling_rate"],
    )
    # Without a keyframe the pipeline takes a 16:9 canvas under the folder's canvas configs.
    height, width = resolve_canvas_size(16, 9, 32, TINY_ENCODE_PRESET["short_edge"], TINY_ENCODE_PRESET["max_pixels"])
    video = out["videos"]
    assert video.shape == (1, frames, 3, height, width)
    assert torch.isfinite(video).all() and video.min() >= 0 and video.max() <= 1
    assert out["sampling_rate"] == 32000
    audio = out["audio"]
    assert audio.shape[:2] == (1, 2) and audio.shape[2] >= frames * 32000 // 24
    assert torch.isfinite(audio).all()
