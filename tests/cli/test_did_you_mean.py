"""A name that is not one of a known set names the nearest valid ones, in the same one-line error.

Config keys, config choices, LoRA targets and presets, command-line subcommands, flags and choices,
render-request fields and the encoder manifest's fields each say `(did you mean 'x'?)` when a valid
name is near the one given, and nothing when none is: a word far from every name gets no guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3train.cli import main
from h3train.config import SampleRequestConfig, load_config
from h3train.errors import ConfigError, did_you_mean, did_you_mean_each, nearest
from h3train.run.preflight import load_checked

from helpers.paths import ROOT

TINY_FL2VA = ROOT / "configs" / "tiny_fl2va.yaml"
TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
FAR = "zzzzzzzz"


def _message(call, *args) -> str:
    """The one-line `ConfigError` message `call(*args)` raises."""
    with pytest.raises(ConfigError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# -- the helper ---------------------------------------------------------------------------------------


def test_nearest_ranks_by_spelling_and_ignores_case() -> None:
    assert nearest("rnak", ["alpha", "rank", "dropout"]) == ["rank"]
    assert nearest("LoRA", ["lokr", "lora"]) == ["lora", "lokr"]
    assert nearest(FAR, ["rank", "alpha"]) == []
    assert did_you_mean("cosin", ["constant", "cosine", "linear"]) == " (did you mean 'cosine'?)"
    # Equally near candidates are all named.
    assert (
        did_you_mean("adamw6bit", ["adamw", "adamw8bit", "adamw4bit"]) == " (did you mean 'adamw8bit' or 'adamw4bit'?)"
    )
    assert did_you_mean(FAR, ["constant", "cosine"]) == ""
    assert did_you_mean_each(["to_qq", FAR], ["to_q", "to_k"]) == " (did you mean 'to_q' for 'to_qq'?)"
    assert did_you_mean_each(["to_(qq"], ["to_q"], ignore=lambda word: "(" in word) == ""


# -- config keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "suggested"),
    [
        ("lora.rnak=8", "lora.rnak", "'lora.rank'"),
        ("train.stepz=3", "train.stepz", "'train.steps'"),
        ("logging.wandb.projet=x", "logging.wandb.projet", "'logging.wandb.project'"),
        ("trian.steps=3", "trian", "'train'"),
        # The same last part under another section.
        ("train.lr=0.1", "train.lr", "'optim.lr'"),
        ("lr=0.1", "lr", "'optim.lr'"),
        ("train.sampling=uniform", "train.sampling", "'train.timestep.sampling'"),
        ("model.seed=1", "model.seed", "'train.seed' or 'validation.seed'"),
    ],
)
def test_an_unknown_key_names_the_nearest_keys(override: str, key: str, suggested: str) -> None:
    message = _message(load_config, TINY_FL2VA, [override])
    assert message == (
        f"unknown config key '{key}' in the overrides (did you mean {suggested}?): remove it or fix its spelling"
    )


def test_an_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(TINY_FL2VA.read_text() + "lora:\n  rnak: 8\n")
    message = _message(load_config, config, [])
    assert f"unknown config key 'lora.rnak' in '{config}' (did you mean 'lora.rank'?)" in message


def test_an_unknown_key_near_nothing_gets_no_guess(capsys: pytest.CaptureFixture) -> None:
    for key in (f"lora.{FAR}", f"validation.{FAR}", FAR):
        message = _message(load_config, TINY_FL2VA, [f"{key}=1"])
        assert message == (
            f"unknown config key '{key}' in the overrides: remove it or check the spelling against configs/*.yaml"
        )
    assert main(["config", str(TINY_FL2VA), "lora.rnak=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h3train: error: unknown config key 'lora.rnak'") and err.count("\n") == 1, err
    assert "(did you mean 'lora.rank'?)" in err


# -- config choices -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "tail"),
    [
        ("optim.schedule=cosin", "choose one of constant, cosine, linear (did you mean 'cosine'?)"),
        ("lora.kind=lorra", "choose one of lora, lokr, loha (did you mean 'lora'?)"),
        ("optim.name=adamw6bit", "(did you mean 'adamw8bit' or 'adamw4bit'?)"),
        ("data.source=cahced", "choose one of synthetic, cached (did you mean 'cached'?)"),
        ("model.attention_backend=flsh", "(did you mean 'flash'?)"),
        ("model.dtype=BFloat16", "(did you mean 'bfloat16'?)"),
        ("task.name=fl2vaa", "choose one of fl2va, t2va, ref2va, mixed (did you mean 'fl2va'?)"),
    ],
)
def test_a_bad_choice_names_the_nearest_choice(override: str, tail: str) -> None:
    key, value = override.split("=")
    message = _message(load_checked, TINY_FL2VA, [override])
    assert message.startswith(f"config key '{key}' is '{value}'; choose one of ") and message.endswith(tail), message


def test_a_choice_near_nothing_gets_no_guess() -> None:
    message = _message(load_config, TINY_FL2VA, [f"optim.schedule={FAR}"])
    assert message == f"config key 'optim.schedule' is '{FAR}'; choose one of constant, cosine, linear"


def test_the_extension_tables_name_the_nearest_kind() -> None:
    from h3train.debug.faults import parse_faults
    from h3train.lora.adapter_kinds import config_kind
    from h3train.ops.attention import resolve_attention_backend
    from h3train.optim.kinds import optimizer_kind

    lora = load_config(TINY_LORA).lora
    lora.kind = "lohha"
    assert _message(config_kind, lora).endswith("(did you mean 'loha'?)")
    assert _message(optimizer_kind, "adamw_bf61").endswith("(did you mean 'adamw_bf16'?)")
    assert _message(resolve_attention_backend, "cudn", "cpu", "float32").endswith("(did you mean 'cudnn'?)")
    assert _message(parse_faults, ["nan_los@2"]).endswith("(did you mean 'nan_loss'?)")
    assert "did you mean" not in _message(parse_faults, [f"{FAR}@2"])


def test_a_model_constructor_argument_names_the_nearest() -> None:
    message = _message(load_checked, TINY_FL2VA, ["model.config.num_heads=4"])
    assert "unknown config key 'model.config.num_heads'" in message
    assert message.endswith("(did you mean 'num_attention_heads'?)")


def test_a_dataset_field_names_the_nearest() -> None:
    message = _message(load_config, TINY_FL2VA, ["data.source=cached", "data.path=[A, {path: B, wieght: 2}]"])
    assert message.endswith("is not a dataset field (fields: path, weight, repeats) (did you mean 'weight'?)")


# -- LoRA targets and presets ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_lora_model():
    from h3train.lora.targets import meta_model

    return meta_model(load_config(TINY_LORA))


def test_a_misspelt_preset_names_the_preset_and_lists_the_presets(meta_lora_model) -> None:
    from h3train.lora.targets import PRESETS, resolve_targets

    message = _message(resolve_targets, meta_lora_model, ["video_onyl"])
    assert message.startswith("config key 'lora.target_modules': 'video_onyl' match no module of the model")
    assert "(did you mean 'video_only'?)" in message
    assert f"give a preset ({', '.join(PRESETS)})" in message


def test_a_misspelt_module_names_the_nearest_module(meta_lora_model) -> None:
    from h3train.lora.targets import resolve_targets, resolve_train_modules

    message = _message(resolve_targets, meta_lora_model, ["to_q", "to_qq", FAR])
    assert f"'to_qq', '{FAR}' match no module of the model (did you mean 'to_q' for 'to_qq'?);" in message
    assert "(did you mean 'to_out.0'?)" in _message(resolve_targets, meta_lora_model, ["to_out.O"])
    message = _message(resolve_train_modules, meta_lora_model, ["nrom1"], [])
    assert "'nrom1' select no module with parameters (did you mean 'norm1'?);" in message


def test_a_module_near_nothing_or_a_pattern_gets_no_guess(meta_lora_model) -> None:
    from h3train.lora.targets import resolve_targets

    for entry in (FAR, "to_(qq", r"to_q\d"):
        assert "did you mean" not in _message(resolve_targets, meta_lora_model, [entry]), entry


def test_check_names_the_preset_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(TINY_LORA), "lora.target_modules=video_onyl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h3train: error: ") and err.count("\n") == 1, err
    assert "(did you mean 'video_only'?)" in err


# -- the command line -----------------------------------------------------------------------------------


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """argparse's one error line for `argv` (after its usage), checking its exit status 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if ": error: " in line]
    assert errors == lines[-1:], lines
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trian", "c.yaml"], "invalid choice: 'trian'"),
        (["check", "c.yaml", "--stirct"], "unrecognized arguments: --stirct (did you mean '--strict'?)"),
        (
            ["check", "c.yaml", "--wrld-size", "8"],
            "unrecognized arguments: --wrld-size 8 (did you mean '--world-size'?)",
        ),
        (["check", "c.yaml", "--world-sise=8"], "(did you mean '--world-size'?)"),
        (["train", "c.yaml", "--overwirte"], "(did you mean '--overwrite'?)"),
        (
            ["check", "c.yaml", "--stirct", "--rehaerse"],
            "(did you mean '--strict' for '--stirct', '--rehearse' for '--rehaerse'?)",
        ),
        (["export", "ckpt", "--out", "o", "--dtype", "bf61"], "invalid choice: 'bf61'"),
        (["synth", "--out", "o", "--task", "fl2vaa"], "(did you mean 'fl2va'?)"),
    ],
)
def test_a_bad_command_line_names_the_nearest_flag_or_choice(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    line = _usage_error(argv, capsys)
    assert needle in line and "did you mean" in line, line
    if argv[0] == "trian":
        assert line.endswith("(did you mean 'train'?)")


@pytest.mark.parametrize(
    "argv",
    [[FAR, "c.yaml"], ["check", "c.yaml", f"--{FAR}"], ["export", "ckpt", "--out", "o", "--dtype", FAR]],
)
def test_a_command_line_near_nothing_gets_no_guess(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert "did you mean" not in _usage_error(argv, capsys)


# -- render requests and encoder manifests --------------------------------------------------------------


def test_an_unknown_request_field_names_the_nearest_field(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(TINY_FL2VA.read_text() + "validation:\n  samples:\n    - {promt: a cat, task: t2va}\n")
    message = _message(load_config, config, [])
    assert message.startswith(f"config key 'validation.samples[0].promt' (in '{config}') is not a request field")
    assert message.endswith("(did you mean 'prompt'?)")
    override = ["validation.samples=[{prompt: a, task: t2va, sead: 3}]"]
    assert _message(load_config, TINY_FL2VA, override).endswith("(did you mean 'seed'?)")
    far = [f"validation.samples=[{{prompt: a, {FAR}: 3}}]"]
    assert "did you mean" not in _message(load_config, TINY_FL2VA, far)
    ref = ["validation.samples=[{prompt: a, task: ref2va, references: [{kind: image, pth: a.png}]}]"]
    assert _message(load_config, TINY_FL2VA, ref).endswith("(did you mean 'path'?)")


def test_a_request_task_or_reference_kind_names_the_nearest() -> None:
    from h3train.render.requests import parse_request

    assert _message(parse_request, 0, SampleRequestConfig(task="ref2vaa")).endswith("(did you mean 'ref2va'?)")
    bad_kind = SampleRequestConfig(task="ref2va", references=[{"kind": "imag", "path": "a.png"}])
    message = _message(parse_request, 0, bad_kind)
    assert message.startswith("config key 'validation.samples[0].references[0].kind' is 'imag'")
    assert message.endswith("(did you mean 'image'?)")
    bad_anchor = SampleRequestConfig(task="fl2va", keyframes={"frist": "a.png"})
    assert _message(parse_request, 0, bad_anchor).endswith("(did you mean 'first'?)")


def test_a_manifest_field_names_the_nearest(tmp_path: Path) -> None:
    from h3train.encode.manifest import read_manifest

    manifest = tmp_path / "m.jsonl"
    rows = [
        {"video": "a.mp4", "promt": "p", "task": "t2va"},
        {"video": "b.mp4", "prompt": "p", "task": "t2vaa"},
        {"video": "c.mp4", "prompt": "p", FAR: 1},
    ]
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = _message(read_manifest, manifest)
    assert "line 1: field 'promt' is not a manifest field" in message and "(did you mean 'prompt'?)" in message
    assert "line 2: field 'task' is 't2vaa', expected one of" in message and "(did you mean 't2va'?)" in message
    assert message.count("did you mean") == 2, message


def test_an_encode_preset_key_names_the_nearest(tmp_path: Path) -> None:
    from h3train.data.components import encode_preset
    from h3train.data.stand_in import ENCODE_PRESET_FILE

    (tmp_path / ENCODE_PRESET_FILE).write_text('{"short_egde": 64}')
    assert _message(encode_preset, tmp_path).endswith("(did you mean 'short_edge'?)")


def test_a_bench_backend_names_the_nearest() -> None:
    import torch

    from h3train.tools.bench.cases import select_backends

    cpu = torch.device("cpu")
    assert _message(select_backends, "native,mth", cpu, "float32").endswith("(did you mean 'math'?)")
    assert "did you mean" not in _message(select_backends, FAR, cpu, "float32")
