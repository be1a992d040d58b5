"""`h3train config`: the resolved config, every key with where its value came from, and the table of
defaults, which must hold the schema's (docs/config.md: `tests/cli/test_config_reference.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from h3train.config import Config, get_key, leaf_types, load_config
from h3train.tools.config_reference import key_docs

from helpers.launch import run_cli
from helpers.paths import ROOT, TINY_FL2VA

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"


def _sources(text: str) -> dict[str, str]:
    """Dotted key -> the trailing comment of its line, read from the printed YAML's indentation."""
    found: dict[str, str] = {}
    path: list[str] = []
    for line in text.splitlines():
        body = line.strip()
        if not body or body.startswith(("#", "- ")):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        path = [*path[:depth], body.split(":", 1)[0]]
        if "  # " in line:
            found[".".join(path)] = line.rsplit("  # ", 1)[1]
    return found


def _flat_keys(tree: dict, prefix: str = "") -> set[str]:
    """Every dotted path to a non-mapping value of a YAML tree."""
    keys = set()
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            keys |= _flat_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def _reloads_as(text: str, tmp_path: Path, path: Path, overrides: list[str]) -> None:
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    assert load_config(printed) == load_config(path, overrides), "the printed config loads as another config"


def test_config_prints_every_key_once_with_where_its_value_came_from(capsys, tmp_path) -> None:
    overrides = ["train.steps=3", "model.config.num_layers=3"]
    rc, out, err = run_cli(capsys, ["config", str(TINY_LORA), *overrides])
    assert rc == 0 and err == ""
    sources = _sources(out)

    in_file = _flat_keys(yaml.safe_load(TINY_LORA.read_text()))
    kwargs = {key for key in in_file if key.startswith("model.config.")}
    assert kwargs, "the tiny config sets model.config"
    assert set(sources) == (set(leaf_types()) - {"model.config"}) | kwargs
    assert {key for key, source in sources.items() if source == "override"} == {
        "train.steps",
        "model.config.num_layers",
    }
    assert {key for key, source in sources.items() if source == str(TINY_LORA)} == in_file - {
        "train.steps",
        "model.config.num_layers",
    }
    assert {source for source in sources.values()} == {"default", "override", str(TINY_LORA)}
    # The file setting a key to its default's value is still the file's doing.
    assert yaml.safe_load(TINY_LORA.read_text())["train"]["seed"] == get_key(Config(), "train.seed")
    assert sources["train.seed"] == str(TINY_LORA)
    _reloads_as(out, tmp_path, TINY_LORA, overrides)


def test_a_value_set_by_another_key_is_marked_derived(capsys, tmp_path) -> None:
    # The file says gradient_checkpointing: false; the override's true is the older spelling of `full`.
    overrides = ["model.gradient_checkpointing=true"]
    rc, out, _ = run_cli(capsys, ["config", str(TINY_FL2VA), *overrides])
    assert rc == 0
    sources = _sources(out)
    assert sources["model.gradient_checkpointing"] == "override"
    assert sources["model.activation_checkpointing"] == "derived"
    assert "  activation_checkpointing: full" in out
    _reloads_as(out, tmp_path, TINY_FL2VA, overrides)


def test_text_yaml_would_misread_prints_as_a_config_that_loads_the_same(capsys, tmp_path) -> None:
    overrides = [
        "logging.dir=runs/a #b: c",
        "logging.wandb.run_name=null",
        'validation.samples=[{prompt: "one\\ntwo: three", task: fl2va, keyframes: {first: a.png}}]',
        "lora.target_modules=[to_q, 'attn\\.(to_k|to_v)']",
    ]
    rc, out, _ = run_cli(capsys, ["config", str(TINY_FL2VA), *overrides])
    assert rc == 0
    sources = _sources(out)
    assert sources["logging.dir"] == sources["validation.samples"] == sources["lora.target_modules"] == "override"
    assert load_config(TINY_FL2VA, overrides).validation.samples[0].prompt == "one\ntwo: three"
    _reloads_as(out, tmp_path, TINY_FL2VA, overrides)


@pytest.mark.parametrize(
    "args",
    [
        [str(TINY_FL2VA), "train.stepz=3"],
        [str(TINY_FL2VA), "train.steps=many"],
        [str(TINY_FL2VA), "optim.schedule=sometimes"],
        ["configs/no_such.yaml"],
    ],
)
def test_a_bad_config_is_the_one_line_check_gives(capsys, args: list[str]) -> None:
    rc, out, err = run_cli(capsys, ["config", *args])
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("h3train: error: ")
    assert run_cli(capsys, ["check", *args])[2] == err


def test_defaults_table_holds_each_schema_default() -> None:
    rows = {doc.key: doc.default for doc in key_docs()}
    assert list(rows) == list(leaf_types())
    for key, cell in rows.items():
        written = cell.removeprefix("`").removesuffix("`").replace("\\|", "|")
        assert yaml.safe_load(written) == get_key(Config(), key), key
    assert rows["model.config"] == "`{}`" and rows["lora.rank"] == "`0`" and rows["optim.lr"] == "`1.0e-05`"
