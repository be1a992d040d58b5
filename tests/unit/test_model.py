"""The sequence-parallel forward against `MiniMaxH3Transformer3DModel.forward` in one process."""

from __future__ import annotations

import pytest
import torch

from h3train.config import load_config
from h3train.model.build import build_model, fp32_island_names
from h3train.model.sp_forward import FORWARD_ARGS, SequenceParallelH3
from h3train.objective import micro_batch_inputs
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.synthetic import SyntheticSource

from helpers.paths import TINY_FL2VA


def _inputs(cfg, text_dim: int, index: int = 0):
    sample = SyntheticSource(cfg.data.synthetic, text_dim, cfg.train.seed)[index]
    return micro_batch_inputs(cfg, sample, step=1, slot=0)


def test_sp1_forward_equals_diffusers_forward_exactly() -> None:
    cfg = load_config(TINY_FL2VA)
    model = build_model(cfg, seed=0)
    ti = _inputs(cfg, model.config.text_dim)
    assert set(ti.model_inputs) == set(FORWARD_ARGS)
    expected = model(**ti.model_inputs, return_dict=False)
    got = SequenceParallelH3(model, SequenceParallel(None))(**ti.model_inputs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_sp1_forward_with_checkpointing_gives_same_gradients() -> None:
    cfg = load_config(TINY_FL2VA)
    ti = _inputs(cfg, 16)
    grads = []
    for ckpt in (False, True):
        model = build_model(cfg, seed=0)
        mode = "full" if ckpt else "none"
        out = SequenceParallelH3(model, SequenceParallel(None), activation_checkpointing=mode)(**ti.model_inputs)
        (out[0].square().mean() + out[1].square().mean()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_model_init_is_seeded_and_leaves_global_rng_alone() -> None:
    cfg = load_config(TINY_FL2VA)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = build_model(cfg, seed=5), build_model(cfg, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = build_model(cfg, seed=6)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_fp32_islands_are_the_diffusers_keep_list() -> None:
    model = build_model(load_config(TINY_FL2VA), seed=0)
    assert fp32_island_names(model) == ["proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"]


def test_checkpointing_modes_recompute_the_chosen_blocks_and_keep_the_gradients(monkeypatch) -> None:
    from h3train.model import sp_forward

    cfg = load_config(TINY_FL2VA)
    ti = _inputs(cfg, 16)
    recomputed: list[str] = []
    real = sp_forward.checkpoint

    def spy(fn, *args, **kwargs):
        recomputed.append(type(fn).__name__)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(sp_forward, "checkpoint", spy)
    grads, calls = {}, {}
    for mode in ("none", "full", "selective"):
        recomputed.clear()
        model = build_model(cfg, seed=0)
        wrapped = SequenceParallelH3(model, SequenceParallel(None), activation_checkpointing=mode, checkpoint_every=2)
        out = wrapped(**ti.model_inputs)
        (out[0].square().mean() + out[1].square().mean()).backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        calls[mode] = list(recomputed)
    # tiny_fl2va: 1 refiner block, 2 transformer blocks; selective every 2nd block is block 0 alone.
    assert calls == {
        "none": [],
        "full": ["MiniMaxH3TokenRefinerBlock", "MiniMaxH3TransformerBlock", "MiniMaxH3TransformerBlock"],
        "selective": ["MiniMaxH3TransformerBlock"],
    }
    assert torch.equal(grads["none"], grads["full"]) and torch.equal(grads["none"], grads["selective"])


def test_saved_activations_shrink_with_checkpointing() -> None:
    from h3train.tools.bench_memory import saved_activation_bytes

    cfg = load_config(TINY_FL2VA)
    ti = _inputs(cfg, 16)
    saved = {}
    for mode in ("none", "selective", "full"):
        wrapped = SequenceParallelH3(
            build_model(cfg, seed=0), SequenceParallel(None), activation_checkpointing=mode, checkpoint_every=2
        )
        saved[mode] = saved_activation_bytes(wrapped, ti)
    assert 0 < saved["full"] < saved["selective"] < saved["none"]


def test_gradient_checkpointing_is_an_alias_of_full() -> None:
    from h3train.errors import ConfigError
    from h3train.plan import checkpointed_layers

    cfg = load_config(TINY_FL2VA, ["model.gradient_checkpointing=true"])
    assert cfg.model.activation_checkpointing == "full"
    full = load_config(TINY_FL2VA, ["model.activation_checkpointing=full"])
    assert full.model.gradient_checkpointing  # what older readers of the bool see
    with pytest.raises(ConfigError, match="model.gradient_checkpointing") as info:
        load_config(TINY_FL2VA, ["model.gradient_checkpointing=true", "model.activation_checkpointing=selective"])
    assert "\n" not in str(info.value)
    selective = load_config(TINY_FL2VA, ["model.activation_checkpointing=selective", "model.checkpoint_every=3"])
    assert [checkpointed_layers(c, 7) for c in (cfg, selective, load_config(TINY_FL2VA))] == [7, 3, 0]
