"""LoRA: the `lora` config section, the adapter transform, and the export formats, in one process.

The multi-rank gradient contract for adapters is in test_lora_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from omegaconf import OmegaConf
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from h3train.cli import main
from h3train.config import load_config
from h3train.data.source import build_source
from h3train.errors import ConfigError
from h3train.lora.adapters import (
    adapter_config,
    adapter_init,
    add_adapters,
    init_adapters,
    trainable_state_dict,
)
from h3train.lora.files import (
    COMFYUI_PREFIX,
    DIFFUSERS_WEIGHT_NAME,
    comfyui_state_dict,
    merge_adapters,
    save_comfyui_lora,
    save_diffusers_lora,
    save_merged_transformer,
)
from h3train.lora.names import export_name
from h3train.model.build import build_meta_model, build_model, fp32_island_names
from h3train.objective import micro_batch_inputs
from h3train.run.assemble import build_trainer
from h3train.run.preflight import load_checked

from helpers.paths import ROOT

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
DEFAULT_SUFFIXES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
# Every module family the ComfyUI layout knows: fused qkv, SwiGLU fc1, refiner, AdaLN, the heads.
WIDE_TARGETS = (
    "lora.target_modules=[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,adaln_proj.linear,"
    "proj_out,context_embedder,norm_out.linear]"
)


def _cfg(*extra: str):
    return load_checked(TINY_LORA, list(extra))


def _adapted(cfg, trained_b: bool = True) -> MiniMaxH3Transformer3DModel:
    """The tiny model with its adapters, computing in float32 (base values bf16-rounded).

    With `trained_b` the lora_B factors get random values, as after training: at init they are zero
    and every export would compare the base against itself.
    """
    model = build_model(cfg, cfg.train.seed)
    add_adapters(model, cfg)
    if trained_b:
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model.float()


def _base_like(model: MiniMaxH3Transformer3DModel, cfg) -> MiniMaxH3Transformer3DModel:
    """A plain diffusers model holding `model`'s base weights (what a user loads a LoRA onto)."""
    base = MiniMaxH3Transformer3DModel(**dict(cfg.model.config))
    weights = {export_name(n): p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    base.load_state_dict(weights, strict=True)
    return base.float()


def _inputs(cfg) -> dict[str, torch.Tensor]:
    source = build_source(cfg, cfg.model.config["text_dim"])
    return micro_batch_inputs(cfg, source[3], step=1, slot=0).model_inputs


@torch.no_grad()
def _forward(model, inputs) -> torch.Tensor:
    video, audio = model(**inputs, return_dict=False)
    return torch.cat([video.flatten(), audio.flatten()])


def _assert_same_forward(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> None:
    err = float((a.double() - b.double()).norm() / b.double().norm())
    assert err <= tol, f"relative L2 forward difference {err:.3e}"


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["lora.rank=-1"], "'lora.rank'"),
        (["lora.alpha=0"], "'lora.alpha'"),
        (["lora.dropout=1.0"], "'lora.dropout'"),
        (["lora.target_modules=[to_q,to_qq,bogus_proj]"], "'to_qq', 'bogus_proj' match no module"),
        (["lora.target_modules=[attn]"], "not Linear"),
        (["lora.target_modules=[]"], "'lora.target_modules' is empty"),
        (["lora.train_modules=[nope]"], "'nope' select no module"),
        (["lora.train_modules=[to_q]"], "overlaps the LoRA target"),
        (["lora.init_from=/nonexistent/lora.safetensors"], "'lora.init_from'"),
        (["lora.rank=0", "lora.train_modules=[norm1]"], "'lora.train_modules' needs LoRA"),
    ],
)
def test_bad_lora_config_is_one_line_exit_2(overrides, needle, capsys) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert main(["check", str(TINY_LORA), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_targets_default_to_block_attention_and_feed_forward() -> None:
    cfg = _cfg()
    model = build_model(cfg, 0)
    add_adapters(model, cfg)
    adapted = {n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if ".lora_A." in n}
    expected = {f"transformer_blocks.{i}.{s}" for i in range(2) for s in DEFAULT_SUFFIXES}
    assert adapted == expected
    # Suffixes select everywhere (the refiner too), regular expressions by full path.
    cfg = _cfg("lora.target_modules=[to_q, 'transformer_blocks\\.1\\.adaln_proj\\.linear']")
    model = build_model(cfg, 0)
    add_adapters(model, cfg)
    adapted = {n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {
        "token_refiner.refiner_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.1.attn.to_q",
        "transformer_blocks.1.adaln_proj.linear",
    }


def test_presets_name_the_modules_of_each_modality() -> None:
    adapted = {}
    for preset in ("video_only", "audio_only", "video_and_audio"):
        model = build_model(cfg := _cfg(f"lora.target_modules={preset}"), 0)
        add_adapters(model, cfg)
        adapted[preset] = {
            n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if ".lora_A." in n
        }
    assert adapted["video_only"] == {"proj_out"} and adapted["audio_only"] == {"audio_proj_out"}
    assert adapted["video_and_audio"] == {f"transformer_blocks.{i}.{s}" for i in range(2) for s in DEFAULT_SUFFIXES}
    # A preset joins other entries.
    model = build_model(cfg := _cfg("lora.target_modules=[audio_only, proj_in]"), 0)
    add_adapters(model, cfg)
    assert {n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if ".lora_A." in n} == {
        "audio_proj_out",
        "proj_in",
    }


def test_full_fine_tuning_has_no_transform() -> None:
    from h3train.lora.transforms import model_transforms

    assert model_transforms(load_config(ROOT / "configs" / "tiny_fl2va.yaml")) == []
    assert len(model_transforms(_cfg())) == 1


# -- the adapter transform ---------------------------------------------------------------------


def test_frozen_base_is_bf16_and_only_adapters_train() -> None:
    cfg = _cfg("lora.train_modules=[norm_out.norm]")
    model = build_model(cfg, 0)
    add_adapters(model, cfg)
    islands = tuple(f"{n}." for n in fp32_island_names(model))
    for name, param in model.named_parameters():
        if ".lora_" in name or name.startswith("norm_out.norm."):
            assert param.requires_grad and param.dtype == torch.float32, name
        else:
            assert not param.requires_grad, name
            assert param.dtype == (torch.float32 if name.startswith(islands) else torch.bfloat16), name
    names = set(trainable_state_dict(model))
    assert names == set(get_peft_model_state_dict(model)) | {"norm_out.norm.weight"}


def test_adapter_init_is_seeded_identical_across_builds_and_from_meta() -> None:
    cfg = _cfg()
    first, second = build_model(cfg, 0), build_model(cfg, 0)
    add_adapters(first, cfg)
    add_adapters(second, cfg)
    a, b = get_peft_model_state_dict(first), get_peft_model_state_dict(second)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # lora_A as peft initialises it (Kaiming-uniform bound 1/sqrt(fan_in)), lora_B zero.
    for key, value in a.items():
        if ".lora_A." in key:
            assert value.abs().max() <= 1 / value.shape[1] ** 0.5 and value.std() > 0
            assert torch.equal(value, adapter_init(key, value.shape, cfg.train.seed))
        else:
            assert torch.count_nonzero(value) == 0
    # A meta build has no values: after materialising, `init_adapters` gives the same ones.
    meta = build_meta_model(cfg)
    add_adapters(meta, cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    init_adapters(meta, cfg)
    c = get_peft_model_state_dict(meta)
    assert all(torch.equal(a[k], c[k]) for k in a)
    other = build_model(cfg, 0)
    add_adapters(other, _cfg("train.seed=1"))
    key = "transformer_blocks.0.attn.to_q.lora_A.weight"
    assert not torch.equal(get_peft_model_state_dict(other)[key], a[key])


def _trainer_config(tmp_path, *extra: str):
    return _cfg(f"logging.dir={tmp_path}", "train.steps=2", "logging.progress=false", "checkpoint.every=0", *extra)


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }


def test_sharded_lora_run_trains_adapters_only(tmp_path) -> None:
    trainer = build_trainer(_trainer_config(tmp_path), hooks=[])
    try:
        params = dict(trainer.model.named_parameters())
        trainable = {n for n, p in params.items() if p.requires_grad}
        in_optimizer = {id(p) for g in trainer.parts.optimizer.param_groups for p in g["params"]}
        assert in_optimizer == {id(params[n]) for n in trainable}
        assert trainable and all(".lora_" in n for n in trainable)
        frozen_dtypes = {p.dtype for n, p in params.items() if n not in trainable and "blocks." in n}
        assert frozen_dtypes == {torch.bfloat16}, "the sharded frozen block weights are not bf16"
        assert all(params[n].dtype == torch.float32 for n in trainable)
        before = _full(trainer.model)
        trainer.fit()
        after = _full(trainer.model)
        state = trainer.parts.optimizer.state
        assert {id(p) for p in state} == in_optimizer, "optimizer state exists for a frozen parameter"
    finally:
        trainer.close()
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable), "a frozen weight moved"
    assert all(not torch.equal(before[n], after[n]) for n in trainable if ".lora_B." in n)


def test_pretrained_meta_build_loads_base_and_seeds_adapters(tmp_path) -> None:
    """A pretrained run builds on meta: base from the files, adapters from the seed after the load."""
    cfg = _cfg()
    source = build_model(cfg, 3)
    source.save_pretrained(tmp_path / "pretrained" / "transformer")
    raw = OmegaConf.load(TINY_LORA)
    del raw.model["config"]
    raw.model.pretrained = str(tmp_path / "pretrained")
    config = tmp_path / "lora_pretrained.yaml"
    OmegaConf.save(raw, config)
    run_cfg = load_config(config, [f"logging.dir={tmp_path / 'run'}", "train.steps=1", "logging.progress=false"])
    trainer = build_trainer(run_cfg, hooks=[])
    try:
        live = _full(trainer.model.transformer)
    finally:
        trainer.close()
    expected = {n: p.detach() for n, p in source.named_parameters()}
    islands = tuple(f"{n}." for n in fp32_island_names(source))
    for name, value in live.items():
        key = export_name(name)
        if ".lora_" in name:
            assert torch.equal(value, adapter_init(key, value.shape, run_cfg.train.seed)), name
        else:
            want = expected[key] if key.startswith(islands) else expected[key].to(torch.bfloat16)
            assert value.dtype == want.dtype and torch.equal(value, want), name


# -- exports -----------------------------------------------------------------------------------


def test_diffusers_format_loads_with_load_lora_adapter_and_the_pipeline(tmp_path) -> None:
    cfg = _cfg(WIDE_TARGETS)
    model = _adapted(cfg)
    inputs = _inputs(cfg)
    want = _forward(model, inputs)
    adapters = trainable_state_dict(model, adapters_only=True)
    file = save_diffusers_lora(tmp_path / "out", adapters, adapter_config(model), task="fl2va")
    assert file.name == DIFFUSERS_WEIGHT_NAME
    with safe_open(file, "pt") as f:
        assert all(k.startswith("transformer.") for k in f.keys())  # noqa: SIM118 - not iterable
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["transformer.r"] == 4 and meta["transformer.lora_alpha"] == 8
    assert "transformer_blocks.0.attn.to_q" in meta["transformer.target_modules"]

    base = _base_like(model, cfg)
    assert not torch.allclose(_forward(base, inputs), want, atol=1e-4), "the adapters change nothing"
    base.load_lora_adapter(str(tmp_path / "out"), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")
    _assert_same_forward(_forward(base, inputs), want)

    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=_base_like(model, cfg))
    pipe.load_lora_weights(str(tmp_path / "out"), weight_name=DIFFUSERS_WEIGHT_NAME)
    _assert_same_forward(_forward(pipe.transformer, inputs), want)


def test_ref2va_lora_lands_in_transformer_ref(tmp_path) -> None:
    cfg = _cfg()
    model = _adapted(cfg)
    inputs = _inputs(cfg)
    adapters = trainable_state_dict(model, adapters_only=True)
    file = save_diffusers_lora(tmp_path / "out", adapters, adapter_config(model), task="ref2va")
    assert all(k.startswith("transformer_ref.") for k in load_file(file))
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=_base_like(model, cfg), transformer_ref=_base_like(model, cfg))
    pipe.load_lora_weights(str(tmp_path / "out"), weight_name=DIFFUSERS_WEIGHT_NAME)
    _assert_same_forward(_forward(pipe.transformer_ref, inputs), _forward(model, inputs))
    assert not getattr(pipe.transformer, "_hf_peft_config_loaded", False), "the LoRA went into transformer"


def test_comfyui_format_round_trips_through_diffusers_converter(tmp_path) -> None:
    cfg = _cfg(WIDE_TARGETS)
    model = _adapted(cfg)
    inputs = _inputs(cfg)
    want = _forward(model, inputs)
    adapters = trainable_state_dict(model, adapters_only=True)
    lora_config = adapter_config(model)
    file = save_comfyui_lora(tmp_path / "lora.safetensors", adapters, lora_config)
    tensors = load_file(file)
    assert all(k.startswith(COMFYUI_PREFIX) for k in tensors)
    assert f"{COMFYUI_PREFIX}blocks.0.attn.qkv_proj.lora_down.weight" in tensors
    assert f"{COMFYUI_PREFIX}token_refiner.blocks.0.mlp.fc1.lora_up.weight" in tensors
    assert f"{COMFYUI_PREFIX}final_layer.video_out.alpha" in tensors
    with safe_open(file, "pt") as f:
        assert f.metadata()["swiglu_fc1_halves"] == "gate,value"
    # fc1's halves are in the original [gate; value] order: the converter swaps them back exactly.
    up = tensors[f"{COMFYUI_PREFIX}blocks.1.mlp.fc1.lora_up.weight"]
    value, gate = adapters["transformer_blocks.1.ff.net.0.proj.lora_B.weight"].chunk(2)
    assert torch.equal(up, torch.cat([gate, value]))

    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(dict(tensors))
    # alpha / rank = 2 here, folded into the factors by the converter: the module deltas match.
    for name, a in adapters.items():
        if ".lora_A." not in name or ".attn.to_" in name and "to_out" not in name:
            continue
        module = name.removesuffix(".lora_A.weight")
        got = converted[f"transformer.{module}.lora_B.weight"] @ converted[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, 2.0 * adapters[f"{module}.lora_B.weight"] @ a, rtol=0, atol=1e-6)
    base = _base_like(model, cfg)
    base.load_lora_adapter(converted, prefix="transformer")
    _assert_same_forward(_forward(base, inputs), want)
    # And through the loader users call, which detects the format itself.
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(transformer=_base_like(model, cfg))
    pipe.load_lora_weights(str(tmp_path), weight_name="lora.safetensors")
    _assert_same_forward(_forward(pipe.transformer, inputs), want)


def test_comfyui_format_refuses_modules_the_original_layout_lacks() -> None:
    adapters = {
        "time_proj.lora_A.weight": torch.zeros(4, 8),
        "time_proj.lora_B.weight": torch.zeros(8, 4),
    }
    with pytest.raises(ValueError, match="'time_proj' has no module in the original"):
        comfyui_state_dict(adapters, {"lora_alpha": 4, "r": 4})


def test_merged_weights_give_the_adapted_forward(tmp_path) -> None:
    cfg = _cfg(WIDE_TARGETS, "lora.train_modules=[norm_out.norm]")
    model = _adapted(cfg)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if n == "norm_out.norm.weight").mul_(1.5)
    inputs = _inputs(cfg)
    want = _forward(model, inputs)
    # The base as a released checkpoint stores it: bf16, the float32 islands in float32.
    islands = tuple(f"{n}." for n in fp32_island_names(model))
    base = {
        k: v if k.startswith(islands) else v.to(torch.bfloat16) for k, v in _base_like(model, cfg).state_dict().items()
    }
    merged = merge_adapters(base, trainable_state_dict(model), adapter_config(model))
    assert all(v.dtype == (torch.float32 if k.startswith(islands) else torch.bfloat16) for k, v in merged.items())
    # A float32 merge compares to 1e-6; the bf16 one holds the same weights rounded to bf16.
    merged32 = merge_adapters(
        {k: v.float() for k, v in base.items()}, trainable_state_dict(model), adapter_config(model)
    )
    folder = save_merged_transformer(tmp_path / "merged", dict(cfg.model.config), merged32)
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(folder).float()
    _assert_same_forward(_forward(loaded, inputs), want)
    for k, v in merged.items():
        assert torch.equal(v, merged32[k].to(v.dtype)), k


@pytest.mark.parametrize("fmt", ["diffusers", "comfyui"])
def test_init_from_a_lora_file_continues_from_its_adapters(fmt: str, tmp_path) -> None:
    cfg = _cfg()
    model = _adapted(cfg)
    inputs = _inputs(cfg)
    adapters = trainable_state_dict(model, adapters_only=True)
    if fmt == "diffusers":
        file = save_diffusers_lora(tmp_path, adapters, adapter_config(model), task="fl2va")
    else:
        file = save_comfyui_lora(tmp_path / "lora.safetensors", adapters, adapter_config(model))
    resumed_cfg = _cfg(f"lora.init_from={file}")
    resumed = build_model(resumed_cfg, resumed_cfg.train.seed)
    add_adapters(resumed, resumed_cfg)
    # The fused qkv is split back and the folded alpha (scale 2, a power of two) divided out exactly.
    values = get_peft_model_state_dict(resumed)
    assert set(values) == set(adapters) and all(torch.equal(values[k], adapters[k]) for k in adapters)
    _assert_same_forward(_forward(resumed.float(), inputs), _forward(model, inputs))


def test_init_from_a_file_of_another_rank_is_one_line(tmp_path) -> None:
    model = _adapted(_cfg())
    file = save_diffusers_lora(
        tmp_path, trainable_state_dict(model, adapters_only=True), adapter_config(model), task="fl2va"
    )
    with pytest.raises(ConfigError, match="has rank 4 .* set lora.rank") as info:
        _cfg(f"lora.init_from={file}", "lora.rank=8")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="which lora.target_modules does not select"):
        _cfg(f"lora.init_from={file}", "lora.target_modules=[to_q]")
