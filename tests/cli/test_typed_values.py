"""Every value a user types is taken as the schema says: text as text, numbers checked at load, flags too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from h3train.cli import main
from h3train.config import SEED_MAX, TEXT_OR_LIST_KEYS, leaf_types, load_config

from helpers.launch import read_metrics, tiny_args
from helpers.paths import TINY_FL2VA


def _one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3train: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("logging.dir=runs/a #b", "logging.dir", "runs/a #b"),
        ("data.path=1e3", "data.path", "1e3"),
        ("logging.wandb.run_name=on", "logging.wandb.run_name", "on"),
        ("logging.wandb.project=0x10", "logging.wandb.project", "0x10"),
        ("checkpoint.resume=none", "checkpoint.resume", "none"),
        ("model.subfolder=null", "model.subfolder", None),
        ("logging.wandb.run_name='quoted'", "logging.wandb.run_name", "'quoted'"),
    ],
)
def test_a_text_key_takes_the_literal_text(override: str, key: str, expected: object) -> None:
    cfg = load_config(TINY_FL2VA, [override])
    section, _, name = key.rpartition(".")
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    assert getattr(obj, name) == expected


def test_numbers_and_booleans_only_where_the_schema_says(capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(TINY_FL2VA, ["model.compile=on", "optim.lr=1e-3", "train.steps=7"])
    assert cfg.model.compile is True and cfg.optim.lr == 1e-3 and cfg.train.steps == 7
    assert main(["check", str(TINY_FL2VA), "train.steps=1e3"]) == 2
    assert "'train.steps'" in _one_line(capsys)
    # Every text key of the schema is read literally: the rule holds for keys added later too.
    text_keys = [k for k, hint in leaf_types().items() if hint is str] + sorted(TEXT_OR_LIST_KEYS)
    assert {"logging.dir", "data.path", "checkpoint.dir", "validation.dataset", "lora.init_from"} <= set(text_keys)


def test_a_run_folder_named_with_a_hash_trains_there(tmp_path: Path) -> None:
    run = tmp_path / "a #b 1e3"
    assert main(tiny_args(run, "train.steps=1", "checkpoint.every=0")) == 0
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a #b 1e3"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lr=nan", "'optim.lr' is nan"),
        ("optim.eps=.inf", "'optim.eps' is inf"),
        ("optim.betas=[0.9,.nan]", "'optim.betas' is nan"),
        ("train.max_grad_norm=.nan", "'train.max_grad_norm' is nan"),
        ("train.timestep.video_shift=.inf", "'train.timestep.video_shift' is inf"),
        ("train.timestep.logit_mean=-.inf", "'train.timestep.logit_mean' is -inf"),
        ("train.loss_weights.audio=.nan", "'train.loss_weights.audio' is nan"),
        ("cfg.scale=.nan", "'cfg.scale' is nan"),
        ("cfg.curvature_power=.inf", "'cfg.curvature_power' is inf"),
        ("train.ema.decay=.nan", "'train.ema.decay' is nan"),
        ("lora.alpha=.inf", "'lora.alpha' is inf"),
        ("validation.sigmas=[0.5,.nan]", "'validation.sigmas' is nan"),
        ("train.seed=18446744073709551616", "'train.seed'"),
        ("train.seed=-1", f"[0, {SEED_MAX}]"),
        ("validation.seed=4294967296", "'validation.seed'"),
        ("parallel.timeout_s=10000000000", "'parallel.timeout_s'"),
        ("parallel.timeout_s=0", "'parallel.timeout_s'"),
        ("logging.wandb.init_timeout_s=.nan", "'logging.wandb.init_timeout_s' is nan"),
        ("train.steps=99999999999999999999", "'train.steps'"),
    ],
)
def test_every_number_is_checked_at_load(override: str, needle: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", str(TINY_FL2VA), override, "logging.dir=/nonexistent/never-written"]) == 2
    assert needle in _one_line(capsys)
    assert not dist.is_initialized()
    assert not Path("/nonexistent/never-written").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["check", str(TINY_FL2VA), "--world-size", "0"], "--world-size is 0"),
        (["check", str(TINY_FL2VA), "--world-size", "-2"], "--world-size is -2"),
        (["synth", "--out", "{tmp}/d", "--num-samples", "0"], "--num-samples is 0"),
        (["synth", "--out", "{tmp}/d", "--seed", "18446744073709551616"], "--seed"),
        (["synth", "--out", "{tmp}/d", "--text-dim", "-3"], "--text-dim is -3"),
        (["export", "{tmp}/ckpt", "--out", "{tmp}/e", "--max-shard-gb", "nan"], "--max-shard-gb is nan"),
        (["export", "{tmp}/ckpt", "--out", "{tmp}/e", "--max-shard-gb", "0"], "--max-shard-gb is 0"),
        (["export", "{tmp}/ckpt", "--out", "/dev/null"], "under /dev"),
        (["export", "{tmp}/ckpt", "--out", "/proc/self/h3"], "under /proc"),
        (["synth", "--out", "/dev/null"], "under /dev"),
        (["synth", "--out", "{tmp}/file/inside"], "lies inside the file"),
        (["synth", "--out", "{tmp}/file"], "is a file, not a folder"),
        (["tiny-components", "/proc/h3"], "under /proc"),
        (["encode", "m.jsonl", "--components", "c", "--out", "{tmp}/o", "--min-seconds", "nan"], "--min-seconds"),
        (["encode", "m.jsonl", "--components", "c", "--out", "{tmp}/o", "--short-edge", "0"], "--short-edge is 0"),
        (["bench", "--reduced", "--repeats", "0"], "--repeats is 0"),
    ],
)
def test_every_command_line_number_and_folder_is_checked_first(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "file").write_text("a user's file\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert needle in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "file").read_text() == "a user's file\n"
