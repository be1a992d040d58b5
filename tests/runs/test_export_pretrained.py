"""Export to a diffusers folder, and pretrained diffusers weights loaded shard by shard into FSDP2."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from omegaconf import OmegaConf
from safetensors.torch import load_file

from h3train.cli import main
from h3train.config import load_config
from h3train.infra.atomic import file_mode
from h3train.model.build import build_model
from h3train.model.sp_forward import FORWARD_ARGS

from helpers.launch import checkpoint_dir, dump_dir, read_metrics, run_forked, tiny_args
from helpers.paths import TINY_FL2VA
from helpers.reference import reference_step


def _forward_inputs(dump_dir, micro: int = 0) -> dict[str, torch.Tensor]:
    tensors = load_file(dump_dir / "inputs.safetensors")
    return {name: tensors[f"m{micro}.{name}"] for name in FORWARD_ARGS}


@pytest.mark.slow
def test_export_loads_in_diffusers_and_forwards_like_the_trained_model(tmp_path) -> None:
    run = tmp_path / "run"
    # The dump at step 2 holds the weights before step 2's update: those saved at step 1.
    run_forked(
        tiny_args(
            run, "train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=0", "debug.dump_step=2", "parallel.sp=2"
        ),
        nproc=2,
    )
    out, step1 = tmp_path / "export", str(checkpoint_dir(run, 1))
    assert main(["export", step1, "--out", str(out), "--max-shard-gb", str(20_000 / 1024**3)]) == 0
    assert len(json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]) > 0
    exported = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32)

    dump = dump_dir(run, 2)
    meta = json.loads((dump / "meta.json").read_text())
    trained = MiniMaxH3Transformer3DModel(**meta["model_config"])
    trained.load_state_dict(load_file(dump / "weights.safetensors"))
    inputs = _forward_inputs(dump)
    with torch.no_grad():
        a = exported(**inputs, return_dict=False)
        b = trained(**inputs, return_dict=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    bf16 = tmp_path / "export_bf16"
    assert main(["export", step1, "--out", str(bf16), "--dtype", "bfloat16"]) == 0
    weights = load_file(bf16 / "diffusion_pytorch_model.safetensors")
    assert weights["proj_in.weight"].dtype == torch.float32
    assert weights["time_embedder.linear_1.weight"].dtype == torch.float32
    assert weights["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(bf16, torch_dtype=torch.bfloat16)
    assert loaded.proj_out.weight.dtype == torch.float32


@pytest.mark.slow
def test_save_pretrained_model_loads_sharded_at_sp2(tmp_path) -> None:
    cfg = load_config(TINY_FL2VA)
    model = build_model(cfg, seed=123)
    folder = tmp_path / "H3"
    # Small shards, so the loader reads through the index across several files.
    model.save_pretrained(folder / "transformer", max_shard_size="20KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()

    config = OmegaConf.load(TINY_FL2VA)
    config.model.pop("config")
    config.model.pretrained = str(folder)
    path = tmp_path / "pretrained.yaml"
    OmegaConf.save(config, path)
    overrides = ["train.steps=1", "debug.dump_step=1", "parallel.sp=2", "checkpoint.every=1", "optim.schedule=constant"]
    run_forked(tiny_args(tmp_path / "run", *overrides, config=path), nproc=2)

    dump = dump_dir(tmp_path / "run", 1)
    weights = load_file(dump / "weights.safetensors")
    expected = model.state_dict()
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    ref_loss, _, _ = reference_step(path, overrides, dump, dp=1)
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)

    # Resuming a pretrained run skips the pretrained read: the checkpoint fills every shard, and the
    # computed rotary buffer is rebuilt (a wrong one would change the loss against the reference).
    resumed = [*overrides[:-2], "train.steps=2", "debug.dump_step=2", "checkpoint.every=1", "optim.schedule=constant"]
    proc = run_forked(tiny_args(tmp_path / "run", *resumed, config=path), nproc=2)
    assert "resumed from" in proc.stdout
    ref_loss, _, _ = reference_step(path, resumed, dump_dir(tmp_path / "run", 2), dp=1, step=2)
    assert read_metrics(tmp_path / "run")[1]["loss"] == pytest.approx(ref_loss, rel=1e-5)


# -- export into a folder: never a mix of two exports, never a partial one ----------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    assert main(tiny_args(run, "train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=0")) == 0
    return run


def _export(capsys, checkpoint, out, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", str(checkpoint), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def _weights(folder) -> dict[str, torch.Tensor]:
    model = MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_reexport_is_refused_unless_overwrite_which_replaces_the_folder_whole(two_steps, tmp_path, capsys) -> None:
    out = tmp_path / "export"
    # A sharded export of step 1: many shards and an index.
    assert _export(capsys, checkpoint_dir(two_steps, 1), out, "--max-shard-gb", str(20_000 / 1024**3))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) > 3

    rc, err = _export(capsys, checkpoint_dir(two_steps, 2), out)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("h3train: error:")]
    assert len(lines) == 1 and str(out) in lines[0] and "--overwrite" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    assert _export(capsys, checkpoint_dir(two_steps, 2), out, "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary sibling left
    reference = tmp_path / "reference"
    assert _export(capsys, checkpoint_dir(two_steps, 2), reference)[0] == 0
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # Readable by whoever can read the JSON beside them (safetensors alone would write 0600).
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {file_mode()}


def test_export_out_that_is_a_file_is_one_line(two_steps, tmp_path, capsys) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"mine")
    rc, err = _export(capsys, checkpoint_dir(two_steps, 2), out)
    assert rc == 2 and err.count("h3train: error:") == 1 and "is a file" in err
    assert out.read_bytes() == b"mine"


def test_export_of_a_checkpoint_missing_a_shard_leaves_nothing(two_steps, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(checkpoint_dir(two_steps, 2), checkpoint_dir(tmp_path, 2))
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    rc, err = _export(capsys, ckpt, tmp_path / "out" / "transformer")
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("h3train: error:")]
    assert len(lines) == 1 and f"{shard.name} is missing" in lines[0]
    assert not (tmp_path / "out").exists()
