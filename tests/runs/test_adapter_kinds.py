"""The adapter kinds beside LoRA, through peft: DoRA (`lora.use_dora`), LoKr and LoHa (`lora.kind`).

Per kind, the module shares (`KindRuns`, each trained once by `trained_runs`):

- `parity`: forked ranks at sp=2 (LoKr: dp_shard=2 x sp=2, its small factors sharded four ways) with
  adapters in every kind of FSDP unit (blocks, refiner, the float32 proj_out island, the root's
  context_embedder and norm_out), dumping step 2 (the zero-started factors make step 1's other
  gradients zero), recomputed by a single-process peft model (`peft_model_from_dump`: diffusers and
  peft alone, the peft config class taken from the record);
- `sp1`: one process, 4 steps with a checkpoint after each, an EMA, a held-out pass at start and every
  2 steps, and a dump of step 3, whose weights are those of the checkpoint at step 2: the "trained
  model" every export of that checkpoint is held against;
- `resumed`: `sp1` resumed from its step-2 checkpoint, which must continue it bitwise.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file

from h3train.cli import main
from h3train.config import load_config
from h3train.lora.adapters import adapter_config, add_adapters, lora_counts, trainable_state_dict
from h3train.lora.files import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME, comfyui_state_dict, save_diffusers_lora
from h3train.lora.names import export_name
from h3train.model.architecture import model_dims
from h3train.model.build import build_model
from h3train.plan import checkpoint_bytes

from helpers.launch import (
    checkpoint_dir,
    checkpoint_tensor_bytes,
    checkpoint_tensors,
    dump_dir,
    read_metrics,
    tiny_args,
)
from helpers.paths import ROOT
from helpers.reference import (
    Parity,
    dump_forward_inputs,
    forward_outputs,
    peft_model_from_dump,
    reference_backward,
    relative_l2,
)
from helpers.runs import TrainedRuns

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
TOL = 1e-5
KINDS = {"dora": ["lora.use_dora=true"], "lokr": ["lora.kind=lokr"], "loha": ["lora.kind=loha"]}
# The zero-started factor of each kind: the one whose value moves the adapted layer off its base.
MOVES = {"dora": ".lora_B.weight", "lokr": ".lokr_w1", "loha": ".hada_w2_b"}
DECAY = 0.9
COMMON = [
    "train.steps=4",
    "train.grad_accum=1",
    "checkpoint.every=1",
    "checkpoint.keep_last=0",
    "optim.lr=2.0e-2",
    f"train.ema.decay={DECAY}",
    "validation.every=2",
    "validation.sigmas=[0.3,0.7]",
]
WIDE_TARGETS = (
    "lora.target_modules=[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,adaln_proj.linear,proj_out,"
    "context_embedder,norm_out.linear]"
)
# The parity runs' (ranks, data-parallel ranks): sp=2, and LoKr's small factors sharded over dp_shard=2 x sp=2.
LAYOUTS = {"dora": (2, 1), "lokr": (4, 2), "loha": (2, 1)}
TRAIN_KEYS = ("loss", "loss_video", "loss_audio", "grad_norm", "lr")


# -- the single-process peft reference -------------------------------------------------------------


def parity_run(trained_runs: TrainedRuns, kind: str, step: int = 2) -> Parity:
    """`reference.lora_parity_run` for any kind: `step` steps at sp=2 (`LAYOUTS`), the dump recomputed with peft."""
    nproc, dp = LAYOUTS[kind]
    overrides = [
        f"train.steps={step}",
        f"debug.dump_step={step}",
        "checkpoint.every=0",
        f"data.path={trained_runs.root / kind / 'parity-data'}",
        "parallel.sp=2",
        WIDE_TARGETS,
        *KINDS[kind],
    ]
    run_dir = trained_runs.get(*overrides, config=TINY_LORA, nproc=nproc).dir
    dump = dump_dir(run_dir, step)
    cfg = load_config(TINY_LORA, overrides)
    meta = json.loads((dump / "meta.json").read_text())
    ref_loss, grads, ref_norm = reference_backward(cfg, meta, peft_model_from_dump(dump), dump, dp, step)
    metrics = read_metrics(run_dir)[step - 1]
    ref_grads = {export_name(k): v for k, v in grads.items()}
    return Parity(
        metrics["loss"], ref_loss, metrics["grad_norm"], ref_norm, load_file(dump / "grads.safetensors"), ref_grads
    )


# -- the shared runs --------------------------------------------------------------------------------


def _train(log_dir: Path, *extra: str) -> None:
    assert main(tiny_args(log_dir, *extra, config=TINY_LORA)) == 0


def _rows(run: Path, kind: str | None = None) -> list[dict]:
    return [m for m in read_metrics(run) if m.get("kind") == kind]


def _curve(run: Path) -> list[list]:
    return [[m["step"], *(m[k] for k in TRAIN_KEYS)] for m in _rows(run)]


HELDOUT = ("--task", "fl2va", "--num-samples", "2", "--text-dim", "16")


class KindRuns:
    """One kind's shared runs (module docstring), each trained once (`trained_runs`)."""

    def __init__(self, trained_runs: TrainedRuns, kind: str) -> None:
        self.trained_runs, self.kind, self.root = trained_runs, kind, trained_runs.root / kind

    @property
    def heldout(self) -> Path:
        return self.trained_runs.dataset(*HELDOUT)

    @property
    def args(self) -> list[str]:
        held_out = [f"validation.dataset={self.heldout}", "validation.at_start=true"]
        return [*COMMON, *KINDS[self.kind], *held_out, f"data.path={self.root / 'data'}"]

    @property
    def parity(self) -> Parity:
        return parity_run(self.trained_runs, self.kind)

    @property
    def sp1(self) -> Path:
        return self.trained_runs.get(*self.args, "debug.dump_step=3", config=TINY_LORA).dir

    @property
    def resumed(self) -> Path:
        resume = f"checkpoint.resume={self.ckpt(2)}"
        return self.trained_runs.get(*self.args, "debug.dump_step=3", resume, config=TINY_LORA).dir

    def ckpt(self, step: int) -> Path:
        return checkpoint_dir(self.sp1, step)

    @property
    def trained_model(self) -> MiniMaxH3Transformer3DModel:
        """The sp1 run's model at step 2 (the weights of step 3's dump), diffusers + peft alone."""
        return peft_model_from_dump(dump_dir(self.sp1, 3)).eval()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return dump_forward_inputs(dump_dir(self.sp1, 3))

    def base(self) -> MiniMaxH3Transformer3DModel:
        """A plain diffusers model holding the run's base (what a user loads the adapter onto)."""
        model = self.trained_model
        base = MiniMaxH3Transformer3DModel(**dict(model.config))
        names = {export_name(n): p for n, p in model.named_parameters()}
        base.load_state_dict({k: names[k].detach().clone() for k in base.state_dict()}, strict=True)
        return base.float().eval()

    def export(self, out: Path, *extra: str) -> Path:
        assert main(["export", str(self.ckpt(2)), "--out", str(out), *extra]) == 0
        return out


@pytest.fixture(scope="module")
def runs(trained_runs: TrainedRuns) -> dict[str, KindRuns]:
    return {kind: KindRuns(trained_runs, kind) for kind in KINDS}


# -- the memory plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", *KINDS])
def test_plan_counts_each_kind_as_a_peft_build_holds(kind: str) -> None:
    """Adapter parameters (whole model and one block) equal the trainable ones of the transform's peft build."""
    extra = [] if kind == "lora" else KINDS[kind]
    cfg = load_config(TINY_LORA, [*extra, "lora.rank=2", WIDE_TARGETS, "lora.train_modules=[norm_out.norm]"])
    counts = lora_counts(model_dims(cfg), cfg.lora)
    model = build_model(cfg, 0)
    add_adapters(model, cfg)
    named = dict(model.named_parameters())
    adapters = {n: p.numel() for n, p in named.items() if p.requires_grad and ".default" in n}
    assert counts.adapters == sum(adapters.values()) > 0
    assert counts.trainable == sum(p.numel() for p in named.values() if p.requires_grad)
    assert counts.block_adapters == sum(v for n, v in adapters.items() if n.startswith("transformer_blocks.0."))
    layers = [n.removesuffix(".base_layer.weight") for n in named if n.endswith(".base_layer.weight")]
    block = [n for n in layers if n.startswith("transformer_blocks.0.")]
    weights = sum(named[f"{n}.base_layer.weight"].numel() for n in block)
    # What the backward keeps: per row for LoRA-type adapters, one delta weight per layer for LoKr / LoHa.
    if kind in ("lokr", "loha"):
        assert (counts.block_row_values, counts.block_delta_values) == (0, weights)
    else:
        outs = sum(named[f"{n}.base_layer.weight"].shape[0] for n in block)
        assert counts.block_row_values == len(block) * 2 + (2 * outs if kind == "dora" else 0)
        assert counts.block_delta_values == 0


# -- gradient parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_sp2_gradients_match_single_process_peft(runs, kind: str) -> None:
    result = runs[kind].parity
    assert set(result.grads) == set(result.ref_grads)
    assert all(".default" not in n and ".base_layer" not in n for n in result.grads)
    assert all(g.abs().sum() > 0 for g in result.ref_grads.values()), "a zero adapter gradient"
    if kind == "dora":
        magnitudes = [g for n, g in result.grads.items() if n.endswith(".lora_magnitude_vector")]
        assert magnitudes and all(g.dim() == 1 for g in magnitudes)
    worst, name = result.worst()
    assert worst <= TOL, f"{kind}: gradient of {name} off by relative L2 {worst:.3e}"
    diff = max(float((result.grads[n] - g).abs().max()) for n, g in result.ref_grads.items())
    scale = max(float(g.abs().max()) for g in result.ref_grads.values())
    assert diff <= TOL * scale, (kind, diff, scale)
    assert result.loss == pytest.approx(result.ref_loss, rel=TOL)
    assert result.grad_norm == pytest.approx(result.ref_norm, rel=TOL)
    assert all(g.dtype == torch.float32 for g in result.grads.values())


# -- checkpoints, resume, EMA, held-out drift --------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoint_holds_the_adapters_only_and_resumes_bitwise(runs, kind: str) -> None:
    r = runs[kind]
    model = checkpoint_tensors(r.ckpt(4), "model.")
    trained = set(load_file(dump_dir(r.sp1, 3) / "grads.safetensors"))
    assert {export_name(k.removeprefix("transformer.")) for k in model} == trained
    assert all(".default" in k for k in model), "a base weight is saved"
    record = json.loads((r.ckpt(4) / "trainer_state.json").read_text())["lora"]
    assert (record["peft_type"], record.get("use_dora", False)) == {
        "dora": ("LORA", True),
        "lokr": ("LOKR", False),
        "loha": ("LOHA", False),
    }[kind]
    # The plan counts the adapters exactly: four float32 copies (weights, AdamW's moments, the EMA).
    cfg = load_config(TINY_LORA, r.args)
    planned, held = checkpoint_bytes(model_dims(cfg), cfg), checkpoint_tensor_bytes(r.ckpt(4))
    assert planned == 16 * sum(v.numel() for v in model.values())
    assert 0 <= held - planned <= 0.01 * planned, (held, planned)
    # Resumed from step 2, the run continues bitwise: losses, held-out rows, weights, EMA, optimizer.
    assert _curve(r.resumed) == _curve(r.sp1)[2:]
    assert _rows(r.resumed, "validation") == _rows(r.sp1, "validation")[2:]
    for prefix in ("model.", "ema.", "optim.state."):
        a, b = checkpoint_tensors(checkpoint_dir(r.resumed, 4), prefix), checkpoint_tensors(r.ckpt(4), prefix)
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), prefix


@pytest.mark.parametrize("kind", list(KINDS))
def test_ema_follows_the_adapters(runs, kind: str) -> None:
    r = runs[kind]
    ema = {step: checkpoint_tensors(r.ckpt(step), "ema.") for step in (1, 2, 3, 4)}
    weights = {step: checkpoint_tensors(r.ckpt(step), "model.") for step in (1, 2, 3, 4)}
    assert ema[4].keys() == weights[4].keys()
    for step in (2, 3, 4):
        for key, value in ema[step].items():
            want = DECAY * ema[step - 1][key].double() + (1 - DECAY) * weights[step][key].double()
            torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7, msg=f"step {step}: {key}")
    moving = [k for k in ema[4] if export_name(k.removeprefix("transformer.")).endswith(MOVES[kind])]
    assert moving and all(not torch.equal(ema[4][k], weights[4][k]) for k in moving)


def _drift(cfg, heldout: Path, model, base) -> dict[str, float]:
    """val/drift recomputed: the trained model's move off the base, over the base's error, on the fixed noise."""
    from h3train.data.dataset import CachedDataset
    from h3train.objective import make_training_inputs, masked_mse
    from h3train.train.validation import heldout_generator

    num, den = {"video": 0.0, "audio": 0.0}, {"video": 0.0, "audio": 0.0}
    for sample in CachedDataset(str(heldout), "fl2va"):
        for sigma in cfg.validation.sigmas:
            gen = heldout_generator(cfg.validation.seed, sample.sample_id, sigma)
            ti = make_training_inputs(sample, gen, cfg.train.timestep, cfg.train.loss_weights, cfg.cfg, sigma=sigma)
            with torch.no_grad():
                p, q = model(**ti.model_inputs, return_dict=False), base(**ti.model_inputs, return_dict=False)
            for i, (key, target, mask) in enumerate(
                (("video", ti.target_video, ti.loss_mask_video), ("audio", ti.target_audio, ti.loss_mask_audio))
            ):
                weight = 1.0 if key == "video" or sample.has_audio else 0.0
                num[key] += weight * float(masked_mse(p[i], q[i][0].float(), mask))
                den[key] += weight * float(masked_mse(q[i], target, mask))
    return {key: num[key] / den[key] for key in num}


@pytest.mark.parametrize("kind", list(KINDS))
def test_held_out_drift_is_zero_at_start_and_the_trained_models_move(runs, kind: str) -> None:
    r = runs[kind]
    rows = _rows(r.sp1, "validation")
    assert [row["step"] for row in rows] == [0, 2, 4]
    assert rows[0]["val/drift_video"] == 0.0 and rows[0]["val/drift_audio"] == 0.0
    assert 0 < rows[1]["val/drift_video"] < rows[2]["val/drift_video"] and rows[2]["val/drift_audio"] > 0
    drift = _drift(load_config(TINY_LORA, r.args), r.heldout, r.trained_model, r.base())
    assert rows[1]["val/drift_video"] == pytest.approx(drift["video"], rel=1e-4)
    assert rows[1]["val/drift_audio"] == pytest.approx(drift["audio"], rel=1e-4)


# -- exports -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_diffusers_export_loads_with_diffusers_loaders(runs, kind: str, tmp_path) -> None:
    """diffusers' `load_lora_adapter` (and, for DoRA, the pipeline's `load_lora_weights`) rebuild the adapter."""
    r = runs[kind]
    out = r.export(tmp_path / "lora")
    with safe_open(out / DIFFUSERS_WEIGHT_NAME, "pt") as f:
        keys = list(f.keys())  # noqa: SIM118 - not iterable
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert all(k.startswith("transformer.") for k in keys)
    assert any(k.endswith({"dora": ".lora_magnitude_vector", "lokr": ".lokr_w1"}[kind]) for k in keys)
    assert meta["transformer.r"] == 4 and meta["transformer.peft_type"] == {"dora": "LORA", "lokr": "LOKR"}[kind]
    want = forward_outputs(r.trained_model, r.inputs)
    base = r.base()
    assert relative_l2(forward_outputs(base, r.inputs), want) > 1e-4, "the adapters changed nothing"
    base.load_lora_adapter(str(out), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")
    assert relative_l2(forward_outputs(base, r.inputs), want) <= 1e-6
    if kind == "lokr":
        return  # the pipeline's `load_lora_weights` takes names holding 'lora' only; LoKr loads per model, above
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=r.base())
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_WEIGHT_NAME)
    assert relative_l2(forward_outputs(pipe.transformer, r.inputs), want) <= 1e-6


def _module_weights(model, merged: bool) -> dict[str, torch.Tensor]:
    """Each adapted module's base weight, or (`merged`) its change under peft's own merge of the adapter."""
    model = copy.deepcopy(model)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            weight = module.get_base_layer().weight.detach().clone()
            if merged:
                module.merge()
                weight = module.get_base_layer().weight.detach() - weight
            out[name] = weight.double()
    return out


def _original_layout(per_module: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block modules' tensors (rows = outputs) in the original layout: q, k, v stacked, fc1's halves swapped."""
    out = {}
    for i in range(2):
        b = f"transformer_blocks.{i}"
        qkv = [per_module.get(f"{b}.attn.to_{p}") for p in "qkv"]
        if all(t is not None for t in qkv):
            out[f"blocks.{i}.attn.qkv_proj"] = torch.cat(qkv)
        out[f"blocks.{i}.attn.out_proj"] = per_module[f"{b}.attn.to_out.0"]
        value, gate = per_module[f"{b}.ff.net.0.proj"].chunk(2)
        out[f"blocks.{i}.mlp.fc1"] = torch.cat([gate, value])
        out[f"blocks.{i}.mlp.fc2"] = per_module[f"{b}.ff.net.2"]
    return out


def _lycoris_delta(tensors: dict[str, torch.Tensor], name: str, weight: torch.Tensor) -> torch.Tensor:
    """The change of `weight` a ComfyUI-format entry `name` makes, by the kohya / LyCORIS formulas alone."""

    def get(key: str) -> torch.Tensor | None:
        value = tensors.get(f"diffusion_model.{name}.{key}")
        return None if value is None else value.double()

    def product(full: str) -> tuple[torch.Tensor, int | None]:
        if get(full) is not None:
            return get(full), None
        return get(f"{full}_a") @ get(f"{full}_b"), get(f"{full}_b").shape[0]

    alpha = get("alpha")
    if get("lora_up.weight") is not None:
        down = get("lora_down.weight")
        diff = get("lora_up.weight") @ down * (float(alpha) / down.shape[0])
        if get("dora_scale") is None:
            return diff
        adapted = weight + diff  # DoRA, the magnitude on the output axis (LyCORIS `wd_on_out`)
        return get("dora_scale") * adapted / adapted.norm(dim=1, keepdim=True) - weight
    if get("hada_w1_a") is not None:
        rank = get("hada_w1_b").shape[0]
        scale = 1.0 if alpha is None else float(alpha) / rank
        return (get("hada_w1_a") @ get("hada_w1_b")) * (get("hada_w2_a") @ get("hada_w2_b")) * scale
    (w1, dim1), (w2, dim2) = product("lokr_w1"), product("lokr_w2")
    dim = dim2 or dim1
    scale = float(alpha) / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2) * scale


def _check_comfyui(tensors: dict[str, torch.Tensor], model) -> int:
    """Every original module of a ComfyUI-format file changes its weight as peft's merge does; returns how many."""
    bases = _original_layout(_module_weights(model, merged=False))
    deltas = _original_layout(_module_weights(model, merged=True))
    names = {k.removeprefix("diffusion_model.").rsplit(".", 1)[0] for k in tensors}
    names = {n.removesuffix(".lora_up").removesuffix(".lora_down") for n in names}
    assert names <= set(deltas), names - set(deltas)
    for name in names:
        got = _lycoris_delta(tensors, name, bases[name])
        assert relative_l2(got, deltas[name]) <= TOL, name
    return len(names)


@pytest.mark.parametrize("kind", ["dora", "loha"])
def test_comfyui_export_rebuilds_peft_merge_by_lycoris_formulas(runs, kind: str, tmp_path) -> None:
    r = runs[kind]
    file = r.export(tmp_path / "comfy", "--format", "comfyui") / COMFYUI_WEIGHT_NAME
    tensors = load_file(file)
    assert all(k.startswith("diffusion_model.blocks.") for k in tensors)
    suffix = {"dora": ".dora_scale", "loha": ".hada_w1_a"}[kind]
    assert any(k.endswith(suffix) for k in tensors)
    assert any(k.endswith(".alpha") for k in tensors) == (kind == "dora")
    with safe_open(file, "pt") as f:
        assert f.metadata()["adapter_kind"] == kind
    assert _check_comfyui(tensors, r.trained_model) == 8  # qkv, out, fc1, fc2 in each of 2 blocks


def test_comfyui_lokr_outside_qkv_rebuilds_peft_merge_and_qkv_is_refused(runs, tmp_path, capsys) -> None:
    r = runs["lokr"]
    capsys.readouterr()
    assert main(["export", str(r.ckpt(2)), "--out", str(tmp_path / "comfy"), "--format", "comfyui"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora.kind=lokr" in err and "do not fuse" in err, err
    assert not (tmp_path / "comfy").exists()
    model = r.trained_model
    record = adapter_config(model)
    adapters = {
        k: v
        for k, v in trainable_state_dict(model, adapters_only=True).items()
        if not any(f".attn.to_{p}." in k for p in "qkv")
    }
    tensors, metadata = comfyui_state_dict(adapters, record)
    assert any(k.endswith(".lokr_w2_a") for k in tensors) and any(k.endswith(".lokr_w2") for k in tensors)
    assert not any(k.endswith(".alpha") for k in tensors) and metadata["adapter_kind"] == "lokr"
    assert _check_comfyui(tensors, model) == 6  # out, fc1, fc2 in each of 2 blocks


def test_loha_has_no_diffusers_export_in_one_line(runs, tmp_path, capsys) -> None:
    r = runs["loha"]
    capsys.readouterr()
    assert main(["export", str(r.ckpt(2)), "--out", str(tmp_path / "lora")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not LoHa" in err and "ComfyUI format" in err, err
    assert not (tmp_path / "lora").exists()


@pytest.mark.parametrize("kind", list(KINDS))
def test_merged_export_of_each_kind_forwards_like_the_trained_model(runs, kind: str, tmp_path) -> None:
    r = runs[kind]
    out = r.export(tmp_path / "merged", "--merge")
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert relative_l2(forward_outputs(loaded, r.inputs), forward_outputs(r.trained_model, r.inputs)) <= 1e-6


# -- lora.init_from and what a kind cannot do --------------------------------------------------------


def test_dora_init_from_its_export_continues_where_it_was_saved(runs, tmp_path) -> None:
    """Export step 2, start a DoRA run from the file: its first step runs the saved model (step 3's dump)."""
    r = runs["dora"]
    file = r.export(tmp_path / "lora") / DIFFUSERS_WEIGHT_NAME
    run = tmp_path / "run"
    _train(
        run, "lora.use_dora=true", f"lora.init_from={file}", "train.steps=1", "checkpoint.every=0", "debug.dump_step=1"
    )
    saved = load_file(dump_dir(r.sp1, 3) / "weights.safetensors")
    started = load_file(dump_dir(run, 1) / "weights.safetensors")
    assert saved.keys() == started.keys() and any(k.endswith(".lora_magnitude_vector") for k in saved)
    assert all(torch.equal(started[k], v) for k, v in saved.items())


def test_dora_init_from_a_plain_lora_file_starts_as_that_lora(tmp_path) -> None:
    """Magnitudes a LoRA file lacks are the row norms of `W + s B A`: the DoRA model computes the LoRA's."""
    cfg = load_config(TINY_LORA, [])
    lora = build_model(cfg, cfg.train.seed)
    add_adapters(lora, cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    file = save_diffusers_lora(tmp_path, trainable_state_dict(lora, adapters_only=True), adapter_config(lora.float()))
    dora_cfg = load_config(TINY_LORA, ["lora.use_dora=true", f"lora.init_from={file}", "lora.alpha=2"])
    dora = build_model(dora_cfg, dora_cfg.train.seed)
    add_adapters(dora, dora_cfg)
    from h3train.data.source import build_source
    from h3train.objective import micro_batch_inputs

    inputs = micro_batch_inputs(cfg, build_source(cfg, 16)[3], step=1, slot=0).model_inputs
    assert relative_l2(forward_outputs(dora.float(), inputs), forward_outputs(lora, inputs)) <= 1e-6
    magnitudes = [p for n, p in dora.named_parameters() if "lora_magnitude_vector" in n]
    assert magnitudes and all(p.requires_grad and p.dim() == 1 for p in magnitudes)


def test_what_a_kind_cannot_do_is_one_line_exit_2(runs, tmp_path, capsys) -> None:
    existing = str(TINY_LORA)  # any file: the kind refuses it before reading it
    cases = [
        (["lora.kind=lokr", f"lora.init_from={existing}"], "config key 'lora.init_from'"),
        (["lora.kind=loha", "lora.dropout=0.1"], "config key 'lora.dropout'"),
        (["lora.kind=loha", "lora.use_dora=true"], "config key 'lora.use_dora'"),
        # A checkpoint resumes only into adapters of its kind; a plain LoRA run does not drop a file's magnitudes.
        (["lora.kind=lokr", f"checkpoint.resume={runs['dora'].ckpt(2)}"], "lora.use_dora=true -> lora.kind=lokr"),
        ([f"lora.init_from={runs['dora'].export(tmp_path / 'dora') / DIFFUSERS_WEIGHT_NAME}"], "holds DoRA magnitudes"),
    ]
    capsys.readouterr()
    for i, (extra, needle) in enumerate(cases):
        assert main(tiny_args(tmp_path / str(i), "train.steps=1", *extra, config=TINY_LORA)) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
