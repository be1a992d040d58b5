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


# tiny_fl2va: 1 refiner block, 2 transformer blocks. Each case: the refiner and transformer blocks that are
# checkpointed, in call order, with the kind of checkpoint (`full`: the module whole, hooks included;
# `selective`: the block's forward under the attention-saving policy).
REFINER, BLOCK = "MiniMaxH3TokenRefinerBlock", "MiniMaxH3TransformerBlock"
CHECKPOINTED = {
    "none": [],
    "selective": [("selective", BLOCK), ("selective", BLOCK)],
    "full": [("full", REFINER), ("full", BLOCK), ("full", BLOCK)],
    ("selective", "full"): [("full", REFINER), ("selective", BLOCK), ("full", BLOCK)],
    ("none", "selective"): [("selective", BLOCK)],
}


def test_checkpointing_policies_recompute_the_chosen_blocks_and_keep_the_gradients(monkeypatch) -> None:
    from h3train.model import sp_forward

    cfg = load_config(TINY_FL2VA)
    ti = _inputs(cfg, 16)
    recomputed: list[tuple[str, str]] = []
    real = sp_forward.checkpoint

    def spy(fn, *args, **kwargs):
        kind = "selective" if kwargs.get("context_fn") is sp_forward.selective_contexts else "full"
        recomputed.append((kind, type(getattr(fn, "__self__", fn)).__name__))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(sp_forward, "checkpoint", spy)
    grads, calls = {}, {}
    for policy in CHECKPOINTED:
        recomputed.clear()
        model = build_model(cfg, seed=0)
        wrapped = SequenceParallelH3(model, SequenceParallel(None), activation_checkpointing=policy)
        out = wrapped(**ti.model_inputs)
        (out[0].square().mean() + out[1].square().mean()).backward()
        grads[policy] = torch.cat([p.grad.flatten() for p in model.parameters()])
        calls[policy] = list(recomputed)
        # Without gradients nothing is checkpointed (the CFG negative branch, validation).
        recomputed.clear()
        with torch.no_grad():
            wrapped(**ti.model_inputs)
        assert recomputed == [], policy
    assert calls == CHECKPOINTED
    for policy, g in grads.items():
        assert torch.equal(grads["none"], g), policy


def test_saved_activations_shrink_with_checkpointing() -> None:
    from h3train.tools.bench_memory import saved_activation_bytes

    cfg = load_config(TINY_FL2VA)
    ti = _inputs(cfg, 16)
    saved = {}
    for policy in ("none", "selective", ("selective", "full"), "full"):
        wrapped = SequenceParallelH3(build_model(cfg, seed=0), SequenceParallel(None), activation_checkpointing=policy)
        saved[policy] = saved_activation_bytes(wrapped, ti)
    # The mixed model keeps one block's attention output more than `full`, and recomputes the refiner
    # that `selective` keeps.
    assert 0 < saved["full"] < saved[("selective", "full")] < saved["selective"] < saved["none"]


def test_block_policies_are_one_for_every_block_or_one_per_block() -> None:
    cfg = load_config(TINY_FL2VA)

    def policies(activation_checkpointing):
        wrapped = SequenceParallelH3(
            build_model(cfg, seed=0), SequenceParallel(None), activation_checkpointing=activation_checkpointing
        )
        return [wrapped.policy(0, refiner=True), wrapped.policy(0), wrapped.policy(1)]

    assert policies("selective") == ["none", "selective", "selective"]
    assert policies("full") == ["full", "full", "full"]
    assert policies(["selective", "full"]) == ["full", "selective", "full"]
    assert policies(("none", "selective")) == ["none", "none", "selective"]
    # A model wrapped again takes the new wrapper's policies, and keeps its own block forward.
    model = build_model(cfg, seed=0)
    forward = model.transformer_blocks[0].forward
    SequenceParallelH3(model, SequenceParallel(None), activation_checkpointing="selective")
    SequenceParallelH3(model, SequenceParallel(None), activation_checkpointing="none")
    assert model.transformer_blocks[0].forward == forward
    with pytest.raises(ValueError, match="3 block policies for 2 transformer blocks"):
        policies(("none", "selective", "full"))
    with pytest.raises(ValueError, match="'every' is not one of"):
        policies(("none", "every"))


def test_gradient_checkpointing_is_an_alias_of_full() -> None:
    from h3train.errors import ConfigError

    cfg = load_config(TINY_FL2VA, ["model.gradient_checkpointing=true"])
    assert cfg.model.activation_checkpointing == "full"
    full = load_config(TINY_FL2VA, ["model.activation_checkpointing=full"])
    assert full.model.gradient_checkpointing  # what older readers of the bool see
    with pytest.raises(ConfigError, match="model.gradient_checkpointing") as info:
        load_config(TINY_FL2VA, ["model.gradient_checkpointing=true", "model.activation_checkpointing=selective"])
    assert "\n" not in str(info.value)
