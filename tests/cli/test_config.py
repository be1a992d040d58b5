"""Config loading and the one-line, exit-2 errors for bad configs."""

from __future__ import annotations

import pytest

from h3train.cli import main
from h3train.config import load_config
from h3train.errors import ConfigError
from h3train.parallel.dims import ParallelDims
from h3train.run.preflight import load_checked

from helpers.launch import run_forked
from helpers.paths import ROOT, TINY_FL2VA


def test_tiny_config_loads_with_overrides() -> None:
    cfg = load_config(TINY_FL2VA, ["parallel.sp=2", "train.steps=7", "optim.lr=0.5"])
    assert (cfg.parallel.sp, cfg.train.steps, cfg.optim.lr) == (2, 7, 0.5)
    assert cfg.model.config["num_attention_heads"] == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.stepz=3"], "'train.stepz'"),
        (["model.config.num_heads=4"], "'model.config.num_heads'"),
        (["train.steps=three"], "'train.steps'"),
        (["parallel.sp=3"], "'parallel.sp'"),
        (["optim.schedule=exp"], "'optim.schedule'"),
        (["train.grad_accum=0"], "'train.grad_accum'"),
        (["parallel.dp_shard=0"], "'parallel.dp_shard'"),
        (["debug.dump_step=99"], "'debug.dump_step'"),
        (["model.dtype=float16"], "'model.dtype'"),
        (["notakey"], "'notakey'"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(overrides, needle, capsys) -> None:
    with pytest.raises(ConfigError) as info:
        load_checked(TINY_FL2VA, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert main(["check", str(TINY_FL2VA), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")


def test_mesh_must_match_world_size() -> None:
    cfg = load_config(TINY_FL2VA, ["parallel.sp=2", "parallel.dp_shard=2"])
    assert ParallelDims.from_config(cfg.parallel, 4).dp == 2
    with pytest.raises(ConfigError, match="world size is 2"):
        ParallelDims.from_config(cfg.parallel, 2)
    inferred = ParallelDims.from_config(load_config(TINY_FL2VA, ["parallel.sp=2"]).parallel, 8)
    assert (inferred.dp_replicate, inferred.dp_shard, inferred.sp, inferred.shard_size) == (1, 4, 2, 8)


def test_train_cli_exits_2_before_any_work(tmp_path) -> None:
    proc = run_forked(["train", str(TINY_FL2VA), "parallel.sp=3", f"logging.dir={tmp_path}"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "'parallel.sp'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_check_prints_mesh_and_memory(capsys) -> None:
    assert main(["check", str(TINY_FL2VA), "parallel.sp=2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard=2" in out and "sp=2" in out


def test_an_override_of_one_exclusive_model_key_replaces_the_other_from_the_file(tmp_path) -> None:
    tiny = ROOT / "configs" / "tiny_lora.yaml"
    cfg = load_config(tiny, [f"model.pretrained={tmp_path}"])
    assert cfg.model.pretrained == str(tmp_path) and cfg.model.config == {}
    both = tmp_path / "both.yaml"
    both.write_text(f"model:\n  pretrained: {tmp_path}\n  config: {{hidden_size: 32}}\n")
    with pytest.raises(ConfigError, match="are exclusive: set one of them"):
        load_config(both, [])
    assert load_config(both, ["model.config={hidden_size: 8}"]).model.pretrained is None
