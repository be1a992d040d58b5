"""LoRA runs end to end: trainable-only checkpoints, bitwise and resharded resume, the recorded base,
`h3train export` of real checkpoints in every format (and `--ema`), `lora.init_from` continuing a
saved run, and the held-out drift from the base.

One sp=1 run (in-process) and one sp=2 run (torchrun) of tiny_lora are shared by the module: 6
steps, a checkpoint every 3, an EMA and a held-out pass at start and every 3 steps. The sp=1 run
dumps step 4, whose weights are those of the checkpoint at step 3: the reference "trained model",
rebuilt with diffusers and peft alone (`helpers.reference.reference_model_from_dump`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from h3train.checkpoint import read_trainer_state
from h3train.cli import main
from h3train.config import load_config
from h3train.lora.files import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME
from h3train.model.architecture import model_dims
from h3train.plan import checkpoint_bytes

from helpers.launch import checkpoint_dir, checkpoint_tensor_bytes, dump_dir, read_metrics, run_forked, tiny_args
from helpers.paths import ROOT
from helpers.reference import dump_forward_inputs, forward_outputs, reference_model_from_dump, relative_l2
from helpers.runs import TrainedRuns

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
TINY_REF2VA = ROOT / "configs" / "tiny_ref2va.yaml"
# A learning rate large enough that the adapters move visibly in 3 steps (drift, exports vs the base).
COMMON = [
    "train.steps=6",
    "checkpoint.every=3",
    "checkpoint.keep_last=0",
    "optim.lr=2.0e-2",
    "train.ema.decay=0.9",
    "validation.every=3",
    "validation.sigmas=[0.3,0.7]",
]
TRAIN_KEYS = ("loss", "loss_video", "loss_audio", "grad_norm", "lr")


def _train(log_dir: Path, *extra: str, config: Path = TINY_LORA) -> None:
    assert main(tiny_args(log_dir, *extra, config=config)) == 0


def _ckpt(run: Path, step: int) -> Path:
    return checkpoint_dir(run, step)


def _rows(run: Path, kind: str | None = None) -> list[dict]:
    return [m for m in read_metrics(run) if m.get("kind") == kind]


def _curve(run: Path) -> list[list]:
    return [[m["step"], *(m[k] for k in TRAIN_KEYS)] for m in _rows(run)]


def _components(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint under `prefix` (e.g. `model.`, `ema.`), read in one process."""
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }
    dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out


HELDOUT = ("--task", "fl2va", "--num-samples", "2", "--text-dim", "16")


class LoraRuns:
    """The module's shared runs, each trained once (`trained_runs`)."""

    def __init__(self, trained_runs: TrainedRuns) -> None:
        self.trained_runs = trained_runs

    @property
    def heldout(self) -> Path:
        return self.trained_runs.dataset(*HELDOUT)

    @property
    def validation(self) -> list[str]:
        return [f"validation.dataset={self.heldout}", "validation.at_start=true"]

    @property
    def sp1(self) -> Path:
        return self.trained_runs.get(*COMMON, *self.validation, "debug.dump_step=4", config=TINY_LORA).dir

    @property
    def sp2(self) -> Path:
        return self.trained_runs.get(*COMMON, *self.validation, "parallel.sp=2", config=TINY_LORA, nproc=2).dir

    @property
    def trained_model(self) -> MiniMaxH3Transformer3DModel:
        """The sp=1 run's model at step 3 (the weights of step 4's dump), diffusers + peft alone."""
        return reference_model_from_dump(dump_dir(self.sp1, 4)).eval()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return dump_forward_inputs(dump_dir(self.sp1, 4))

    def export(self, out: Path, *extra: str, step: int = 3) -> Path:
        assert main(["export", str(_ckpt(self.sp1, step)), "--out", str(out), *extra]) == 0
        return out


@pytest.fixture(scope="module")
def runs(trained_runs: TrainedRuns) -> LoraRuns:
    return LoraRuns(trained_runs)


def _base(runs: LoraRuns) -> MiniMaxH3Transformer3DModel:
    """A plain diffusers model holding the run's base (what a user loads the LoRA onto)."""
    model = runs.trained_model
    base = MiniMaxH3Transformer3DModel(**dict(model.config))
    weights = {
        n.replace(".base_layer.", "."): p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n
    }
    base.load_state_dict(weights, strict=True)
    return base.float().eval()


# -- checkpoints ---------------------------------------------------------------------------------


def test_lora_checkpoint_holds_the_trainable_state_only(tmp_path) -> None:
    """No base weight in it; its tensor bytes are within 10 % of the trainables' weights and AdamW moments."""
    wide = [
        "model.config.hidden_size=256",
        "model.config.attention_head_dim=64",
        "model.config.ffn_dim=1024",
        "model.config.time_embed_dim=64",
        "lora.rank=32",
        "lora.alpha=32",
        "train.steps=1",
        "train.grad_accum=1",
        "checkpoint.every=1",
    ]
    _train(tmp_path, *wide)
    path = _ckpt(tmp_path, 1)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), "a base weight is saved"
    trainable = sum(metadata[k].size.numel() for k in model_keys)
    # fp32 weight + AdamW exp_avg + exp_avg_sq: 12 bytes per trainable parameter.
    expected = 12 * trainable
    saved = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert abs(saved - expected) <= 0.1 * expected, (saved, expected)
    # The test can fail: the frozen base, even in bf16, is far more than the 10 % slack.
    with torch.device("meta"):
        base = MiniMaxH3Transformer3DModel(**json.loads((path / "trainer_state.json").read_text())["model_config"])
    assert 2 * sum(p.numel() for p in base.parameters()) > expected
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["lora_base"] == {"kind": "random", "seed": 0} and state["lora"]["r"] == 32


def test_resume_at_sp1_is_bitwise(runs, tmp_path) -> None:
    resumed = tmp_path / "resumed"
    _train(resumed, *COMMON, *runs.validation, "debug.dump_step=4", f"checkpoint.resume={_ckpt(runs.sp1, 3)}")
    assert _curve(resumed) == _curve(runs.sp1)[3:]
    assert _rows(resumed, "validation") == _rows(runs.sp1, "validation")[2:]
    for prefix in ("model.", "ema.", "optim.state."):
        a, b = _components(_ckpt(resumed, 6), prefix), _components(_ckpt(runs.sp1, 6), prefix)
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), prefix


def test_ema_of_a_lora_run_covers_the_adapters_only(runs) -> None:
    ema = _components(_ckpt(runs.sp1, 6), "ema.")
    model = _components(_ckpt(runs.sp1, 6), "model.")
    assert {k.removeprefix("ema.") for k in ema} == {k.removeprefix("model.") for k in model}
    assert all(".lora_" in k for k in ema)


def test_planned_checkpoint_size_of_a_lora_run(runs) -> None:
    # The adapters alone, four times in float32 (weights, AdamW's moments, the EMA): no frozen base.
    cfg = load_config(TINY_LORA, [o for o in COMMON if o.startswith("train.")])
    planned, held = checkpoint_bytes(model_dims(cfg), cfg), checkpoint_tensor_bytes(_ckpt(runs.sp1, 6))
    assert 0 <= held - planned <= 0.01 * planned, (held, planned)
    adapters = sum(v.numel() for v in _components(_ckpt(runs.sp1, 6), "model.").values())
    assert planned == 4 * 4 * adapters


@pytest.mark.slow
def test_resume_at_sp2_is_bitwise_and_sp2_agrees_with_sp1(runs, tmp_path) -> None:
    resumed = tmp_path / "resumed"
    args = tiny_args(resumed, *COMMON, *runs.validation, "parallel.sp=2", config=TINY_LORA)
    run_forked([*args, f"checkpoint.resume={_ckpt(runs.sp2, 3)}"], nproc=2)
    assert _curve(resumed) == _curve(runs.sp2)[3:]
    a, b = _components(_ckpt(resumed, 6), "model."), _components(_ckpt(runs.sp2, 6), "model.")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # One process and two SP ranks train the same LoRA: loss and grad_norm per step to 1e-5.
    for one, two in zip(_rows(runs.sp1), _rows(runs.sp2), strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_resume_sp2_checkpoint_at_sp1_continues_the_same_run(runs, tmp_path) -> None:
    resumed = tmp_path / "resharded"
    _train(resumed, *COMMON, *runs.validation, f"checkpoint.resume={_ckpt(runs.sp2, 3)}")
    straight = _rows(runs.sp2)[3:]
    got = _rows(resumed)
    assert [m["step"] for m in got] == [4, 5, 6]
    for a, b in zip(straight, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)


def test_resume_on_another_base_is_one_line_exit_2(runs, tmp_path, capsys) -> None:
    args = tiny_args(tmp_path, *COMMON, f"checkpoint.resume={_ckpt(runs.sp1, 3)}", config=TINY_LORA)
    assert main([*args, *runs.validation, "train.seed=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trained on a random base of train.seed=0" in err and "seed=1" in err
    # A full fine-tune cannot resume the adapters-only checkpoint either.
    assert main([*args, *runs.validation, "lora.rank=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a LoRA checkpoint" in err


def test_resume_with_another_lora_rank_names_the_change_and_the_ways_out(runs, tmp_path, capsys) -> None:
    saved = read_trainer_state(_ckpt(runs.sp1, 3))["lora"]["r"]
    args = tiny_args(tmp_path, *COMMON, f"checkpoint.resume={_ckpt(runs.sp1, 3)}", config=TINY_LORA)
    capsys.readouterr()  # what the shared runs printed
    assert main([*args, *runs.validation, f"lora.rank={saved * 2}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"lora.rank {saved} -> {saved * 2}" in err, err
    assert f"lora.rank={saved}" in err and "checkpoint.resume=none" in err


def _pretrained_config(tmp_path: Path, seed: int, max_shard_size: str = "10GB") -> tuple[Path, Path]:
    """tiny_lora on a pretrained folder holding the tiny model of `seed`: (config file, folder)."""
    from omegaconf import OmegaConf

    from h3train.config import load_config
    from h3train.model.build import build_model

    folder = tmp_path / f"base_{seed}_{max_shard_size}"
    build_model(load_config(TINY_LORA), seed).save_pretrained(folder / "transformer", max_shard_size=max_shard_size)
    raw = OmegaConf.load(TINY_LORA)
    del raw.model["config"]
    raw.model.pretrained = str(folder)
    config = tmp_path / f"lora_{folder.name}.yaml"
    OmegaConf.save(raw, config)
    return config, folder


def test_pretrained_base_is_recorded_by_digest_and_another_one_refused(tmp_path, capsys) -> None:
    """A LoRA run on a pretrained folder resumes on it and not on other weights of the same architecture."""
    config, _ = _pretrained_config(tmp_path, 5)
    common = ["checkpoint.every=1", "checkpoint.keep_last=0", "train.steps=2"]
    run = tmp_path / "run"
    _train(run, *common, "optim.lr=2e-2", config=config)
    state = json.loads((_ckpt(run, 1) / "trainer_state.json").read_text())
    assert state["lora_base"]["kind"] == "pretrained" and len(state["lora_base"]["digest"]) == 64
    # The resume loads the base from the folder again (not from the checkpoint): step 2 is bitwise the same.
    resumed = tmp_path / "resumed"
    _train(resumed, *common, "optim.lr=2e-2", f"checkpoint.resume={_ckpt(run, 1)}", config=config)
    assert "resumed from" in capsys.readouterr().out
    assert _curve(resumed) == _curve(run)[1:]
    _, other = _pretrained_config(tmp_path, 6, max_shard_size="100KB")
    args = tiny_args(run, *common, "train.steps=3", f"model.pretrained={other}", config=config)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was trained on the pretrained base" in err, err


# -- held-out drift --------------------------------------------------------------------------------


def test_drift_is_zero_at_start_and_grows_with_training(runs) -> None:
    rows = _rows(runs.sp1, "validation")
    assert [r["step"] for r in rows] == [0, 3, 6]
    assert rows[0]["val/drift_video"] == 0.0 and rows[0]["val/drift_audio"] == 0.0
    assert 0 < rows[1]["val/drift_video"] < rows[2]["val/drift_video"]
    assert rows[2]["val/drift_audio"] > 0


def test_drift_is_the_prediction_move_relative_to_the_base_error(runs) -> None:
    """val/drift at step 3 recomputed from the trained and the base model on the same fixed noise."""
    from h3train.config import load_config
    from h3train.data.dataset import CachedDataset
    from h3train.objective import make_training_inputs, masked_mse
    from h3train.train.validation import heldout_generator

    cfg = load_config(TINY_LORA, [*COMMON, *runs.validation])
    model, base = runs.trained_model, _base(runs)
    num = {"video": 0.0, "audio": 0.0}
    den = dict(num)
    for sample in CachedDataset(str(runs.heldout), "fl2va"):
        for sigma in cfg.validation.sigmas:
            gen = heldout_generator(cfg.validation.seed, sample.sample_id, sigma)
            ti = make_training_inputs(sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, sigma=sigma)
            with torch.no_grad():
                p = model(**ti.model_inputs, return_dict=False)
                q = base(**ti.model_inputs, return_dict=False)
            for i, (key, target, mask) in enumerate(
                (("video", ti.target_video, ti.loss_mask_video), ("audio", ti.target_audio, ti.loss_mask_audio))
            ):
                weight = 1.0 if key == "video" or sample.has_audio else 0.0
                num[key] += weight * float(masked_mse(p[i], q[i][0].float(), mask))
                den[key] += weight * float(masked_mse(q[i], target, mask))
    row = next(r for r in _rows(runs.sp1, "validation") if r["step"] == 3)
    assert row["val/drift_video"] == pytest.approx(num["video"] / den["video"], rel=1e-4)
    assert row["val/drift_audio"] == pytest.approx(num["audio"] / den["audio"], rel=1e-4)


@pytest.mark.slow
def test_drift_is_the_same_at_sp1_and_sp2(runs, tmp_path) -> None:
    """Both start from the same non-zero adapters (init_from), so step 0's drift is comparable."""
    lora = runs.export(tmp_path / "lora", step=6) / DIFFUSERS_WEIGHT_NAME
    args = [f"lora.init_from={lora}", *COMMON, *runs.validation, "train.steps=1", "checkpoint.every=0"]
    _train(tmp_path / "sp1", *args)
    run_forked(tiny_args(tmp_path / "sp2", *args, "parallel.sp=2", config=TINY_LORA), nproc=2)
    one, two = _rows(tmp_path / "sp1", "validation")[0], _rows(tmp_path / "sp2", "validation")[0]
    assert one["step"] == two["step"] == 0 and one["val/drift_video"] > 1e-4
    for key in ("val/drift_video", "val/drift_audio", "val/loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


# -- export ----------------------------------------------------------------------------------------


def test_diffusers_export_loads_onto_the_base_and_forwards_like_the_trained_model(runs, tmp_path) -> None:
    out = runs.export(tmp_path / "lora")
    assert sorted(p.name for p in out.iterdir()) == [DIFFUSERS_WEIGHT_NAME]
    with safe_open(out / DIFFUSERS_WEIGHT_NAME, "pt") as f:
        assert all(k.startswith("transformer.") for k in f.keys())  # noqa: SIM118 - not iterable
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["transformer.r"] == 4 and meta["transformer.lora_alpha"] == 8
    want = forward_outputs(runs.trained_model, runs.inputs)
    base = _base(runs)
    assert relative_l2(forward_outputs(base, runs.inputs), want) > 1e-4, "the adapters changed nothing"
    base.load_lora_adapter(str(out), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")
    assert relative_l2(forward_outputs(base, runs.inputs), want) <= 1e-6
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=_base(runs))
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_WEIGHT_NAME)
    assert relative_l2(forward_outputs(pipe.transformer, runs.inputs), want) <= 1e-6


def test_comfyui_export_reads_back_through_diffusers_converter(runs, tmp_path) -> None:
    out = runs.export(tmp_path / "comfy", "--format", "comfyui")
    file = out / COMFYUI_WEIGHT_NAME
    assert all(k.startswith("diffusion_model.") for k in load_file(file))
    # diffusers' own reader detects the original layout and converts it to its names.
    converted = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(file))
    base = _base(runs)
    base.load_lora_adapter(converted, prefix="transformer")
    assert relative_l2(forward_outputs(base, runs.inputs), forward_outputs(runs.trained_model, runs.inputs)) <= 1e-6


def test_merged_export_loads_with_from_pretrained(runs, tmp_path) -> None:
    out = runs.export(tmp_path / "merged", "--merge")
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert relative_l2(forward_outputs(loaded, runs.inputs), forward_outputs(runs.trained_model, runs.inputs)) <= 1e-6
    bf16 = runs.export(tmp_path / "merged_bf16", "--merge", "--dtype", "bfloat16")
    weights = load_file(bf16 / "diffusion_pytorch_model.safetensors")
    assert weights["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert weights["proj_in.weight"].dtype == torch.float32


def test_merged_export_reads_a_pretrained_base_shard_by_shard(tmp_path, capsys) -> None:
    config, folder = _pretrained_config(tmp_path, 5, max_shard_size="100KB")
    run = tmp_path / "run"
    common = ["train.steps=2", "checkpoint.every=1", "optim.lr=2e-2", "debug.dump_step=2"]
    _train(run, *common, config=config)
    out = tmp_path / "merged"
    # The base moved: --merge says where it is now; other weights are refused.
    moved = folder.rename(tmp_path / "moved")
    assert main(["export", str(_ckpt(run, 1)), "--out", str(out), "--merge"]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["export", str(_ckpt(run, 1)), "--out", str(out), "--merge", "--base", str(moved / "transformer")]) == 0
    assert len(list(out.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32).eval()
    trained = reference_model_from_dump(dump_dir(run, 2)).eval()
    inputs = dump_forward_inputs(dump_dir(run, 2))
    assert relative_l2(forward_outputs(loaded, inputs), forward_outputs(trained, inputs)) <= 1e-6


def test_lora_export_errors_are_one_line(runs, tmp_path, capsys) -> None:
    ckpt = str(_ckpt(runs.sp1, 3))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--out", str(tmp_path / "full")], "is not empty"),
        (["--out", str(tmp_path / "a"), "--format", "kohya"], "choose diffusers or comfyui"),
        (["--out", str(tmp_path / "b"), "--format", "comfyui", "--merge"], "drop --format or --merge"),
        (["--out", str(tmp_path / "c"), "--merge", "--base", str(tmp_path)], "trained on a random base"),
    ]
    for extra, needle in cases:
        assert main(["export", ckpt, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"], "a failed export left something behind"


def test_train_modules_refuse_lora_formats_and_merge_keeps_them(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    _train(run, "lora.train_modules=[norm_out.norm]", "train.steps=1", "checkpoint.every=1")
    capsys.readouterr()
    assert main(["export", str(_ckpt(run, 1)), "--out", str(tmp_path / "lora")]) == 2
    err = capsys.readouterr().err.strip()
    assert "norm_out.norm.weight" in err and "--merge" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "lora").exists()
    assert main(["export", str(_ckpt(run, 1)), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    trained = _components(_ckpt(run, 1), "model.")["model.transformer.norm_out.norm.weight"]
    merged = load_file(tmp_path / "merged" / "diffusion_pytorch_model.safetensors")["norm_out.norm.weight"]
    assert torch.equal(merged, trained)


def test_ref2va_lora_export_lands_in_transformer_ref(tmp_path) -> None:
    data = tmp_path / "data"
    assert main(["synth", "--out", str(data), "--task", "ref2va", "--num-samples", "2", "--text-dim", "16"]) == 0
    run = tmp_path / "run"
    lora = ["lora.rank=4", "lora.alpha=8", "optim.lr=2e-2"]
    _train(run, f"data.path={data}", *lora, "train.steps=1", "checkpoint.every=1", config=TINY_REF2VA)
    out = tmp_path / "lora"
    assert main(["export", str(_ckpt(run, 1)), "--out", str(out)]) == 0
    assert all(k.startswith("transformer_ref.") for k in load_file(out / DIFFUSERS_WEIGHT_NAME))
    config = json.loads((_ckpt(run, 1) / "trainer_state.json").read_text())["model_config"]
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(
        transformer=MiniMaxH3Transformer3DModel(**config), transformer_ref=MiniMaxH3Transformer3DModel(**config)
    )
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_WEIGHT_NAME)
    assert getattr(pipe.transformer_ref, "_hf_peft_config_loaded", False)
    assert not getattr(pipe.transformer, "_hf_peft_config_loaded", False), "the LoRA went into transformer"


# -- --ema -----------------------------------------------------------------------------------------


def test_ema_export_of_a_lora_checkpoint_writes_the_ema_adapters(runs, tmp_path) -> None:
    plain = load_file(runs.export(tmp_path / "plain", step=6) / DIFFUSERS_WEIGHT_NAME)
    ema = load_file(runs.export(tmp_path / "ema", "--ema", step=6) / DIFFUSERS_WEIGHT_NAME)
    shadow = _components(_ckpt(runs.sp1, 6), "ema.")
    key = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    assert plain.keys() == ema.keys() and not torch.equal(plain[key], ema[key])
    assert torch.equal(ema[key], shadow["ema.transformer.transformer_blocks.0.attn.to_q.lora_B.default.weight"])


def test_ema_export_of_a_full_checkpoint_loads_with_from_pretrained(tmp_path, capsys) -> None:
    from helpers.paths import TINY_FL2VA

    run = tmp_path / "run"
    _train(run, "train.steps=2", "train.ema.decay=0.5", "checkpoint.every=2", config=TINY_FL2VA)
    ckpt = str(_ckpt(run, 2))
    assert main(["export", ckpt, "--out", str(tmp_path / "plain")]) == 0
    assert main(["export", ckpt, "--out", str(tmp_path / "ema"), "--ema"]) == 0
    plain = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "plain").state_dict()
    ema = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "ema").state_dict()
    shadow = _components(_ckpt(run, 2), "ema.")
    assert plain.keys() == ema.keys()
    assert all(torch.equal(ema[k], shadow[f"ema.transformer.{k}"]) for k in ema)
    assert any(not torch.equal(plain[k], ema[k]) for k in ema)
    # A checkpoint without an EMA says so in one line.
    _train(tmp_path / "noema", "train.steps=1", "checkpoint.every=1", config=TINY_FL2VA)
    capsys.readouterr()
    assert main(["export", str(_ckpt(tmp_path / "noema", 1)), "--out", str(tmp_path / "x"), "--ema"]) == 2
    assert "holds no EMA" in capsys.readouterr().err


# -- lora.init_from ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["diffusers", "comfyui"])
def test_init_from_an_export_continues_exactly_where_it_was_saved(runs, tmp_path, fmt) -> None:
    """Export step 3, start a run from the file: its first step runs the saved model (step 4's dump)."""
    out = runs.export(tmp_path / "lora", "--format", fmt)
    file = out / (DIFFUSERS_WEIGHT_NAME if fmt == "diffusers" else COMFYUI_WEIGHT_NAME)
    run = tmp_path / "run"
    _train(run, f"lora.init_from={file}", "train.steps=1", "checkpoint.every=0", "debug.dump_step=1")
    saved = load_file(dump_dir(runs.sp1, 4) / "weights.safetensors")
    started = load_file(dump_dir(run, 1) / "weights.safetensors")
    assert saved.keys() == started.keys()
    for key, value in saved.items():
        if fmt == "diffusers" or ".lora_" not in key:
            assert torch.equal(started[key], value), key
        else:
            # ComfyUI stores alpha beside the factors; the converter folds it in, init_from unfolds it.
            torch.testing.assert_close(started[key], value, rtol=1e-6, atol=1e-7)
    model = reference_model_from_dump(dump_dir(run, 1)).eval()
    assert relative_l2(forward_outputs(model, runs.inputs), forward_outputs(runs.trained_model, runs.inputs)) <= 1e-6
    assert math.isfinite(_rows(run)[0]["loss"])
