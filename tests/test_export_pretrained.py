"""Export to a diffusers folder, and pretrained diffusers weights loaded shard by shard into FSDP2."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from omegaconf import OmegaConf
from safetensors.torch import load_file

from h3train.config import load_config
from h3train.model.build import build_model
from h3train.model.sp_forward import FORWARD_ARGS

from reference import TINY_FL2VA, read_metrics, reference_step, run_h3train


def _forward_inputs(dump_dir, micro: int = 0) -> dict[str, torch.Tensor]:
    tensors = load_file(dump_dir / "inputs.safetensors")
    return {name: tensors[f"m{micro}.{name}"] for name in FORWARD_ARGS}


@pytest.mark.slow
def test_export_loads_in_diffusers_and_forwards_like_the_trained_model(tmp_path) -> None:
    run = tmp_path / "run"
    # The dump at step 2 holds the weights before step 2's update: those saved at step 1.
    run_h3train(
        [
            "train",
            str(TINY_FL2VA),
            f"logging.dir={run}",
            "train.steps=2",
            "checkpoint.every=1",
            "checkpoint.keep_last=0",
            "debug.dump_step=2",
            "logging.progress=false",
            "parallel.sp=2",
        ],
        nproc=2,
    )
    out = tmp_path / "export"
    run_h3train(
        [
            "export",
            str(run / "checkpoints" / "step_00000001"),
            "--out",
            str(out),
            "--max-shard-gb",
            str(20_000 / 1024**3),
        ]
    )
    assert len(json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]) > 0
    exported = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32)

    dump = run / "dump" / "step_2"
    meta = json.loads((dump / "meta.json").read_text())
    trained = MiniMaxH3Transformer3DModel(**meta["model_config"])
    trained.load_state_dict(load_file(dump / "weights.safetensors"))
    inputs = _forward_inputs(dump)
    with torch.no_grad():
        a = exported(**inputs, return_dict=False)
        b = trained(**inputs, return_dict=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    bf16 = tmp_path / "export_bf16"
    run_h3train(["export", str(run / "checkpoints" / "step_00000001"), "--out", str(bf16), "--dtype", "bfloat16"])
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
    overrides = [
        "train.steps=1",
        "debug.dump_step=1",
        "logging.progress=false",
        "parallel.sp=2",
        "checkpoint.every=1",
        "optim.schedule=constant",
    ]
    run_h3train(["train", str(path), f"logging.dir={tmp_path / 'run'}", *overrides], nproc=2)

    dump = tmp_path / "run" / "dump" / "step_1"
    weights = load_file(dump / "weights.safetensors")
    expected = model.state_dict()
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    ref_loss, _, _ = reference_step(path, overrides, dump, dp=1)
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)

    # Resuming a pretrained run skips the pretrained read: the checkpoint fills every shard, and the
    # computed rotary buffer is rebuilt (a wrong one would change the loss against the reference).
    resumed = [*overrides[:-2], "train.steps=2", "debug.dump_step=2", "checkpoint.every=1", "optim.schedule=constant"]
    proc = run_h3train(["train", str(path), f"logging.dir={tmp_path / 'run'}", *resumed], nproc=2)
    assert "resumed from" in proc.stdout
    ref_loss, _, _ = reference_step(path, resumed, tmp_path / "run" / "dump" / "step_2", dp=1, step=2)
    assert read_metrics(tmp_path / "run")[1]["loss"] == pytest.approx(ref_loss, rel=1e-5)
