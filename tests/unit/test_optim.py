"""AdamW parameter groups, the kernel choice, gradient clipping and LR schedules."""

from __future__ import annotations

import math

import pytest

from h3train.config import OptimConfig, load_config
from h3train.model.build import build_model
from h3train.optim.kinds import build_optimizer, lr_factor

from helpers.launch import tiny_overrides
from helpers.paths import TINY_FL2VA


def test_norms_and_biases_are_not_decayed() -> None:
    model = build_model(load_config(TINY_FL2VA), seed=0)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {name: id(p) in decayed for name, p in model.named_parameters()}
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert names["transformer_blocks.0.attn.to_q.weight"]
    assert not names["transformer_blocks.0.norm1.weight"]
    assert not names["proj_in.bias"]
    assert not names["transformer_blocks.0.attn.norm_q.weight"]
    assert names["norm_out.linear.weight"]  # a projection, despite "norm" in its name
    assert sum(names.values()) + sum(not v for v in names.values()) == len(list(model.parameters()))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_warmup_then_schedule(schedule: str) -> None:
    cfg = OptimConfig(schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, total_steps=14) for s in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    if schedule == "constant":
        assert set(factors[4:]) == {1.0}
    else:
        assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
        assert factors[4] == 1.0
        end = lr_factor(14, cfg, 14)
        assert math.isclose(end, 0.1)
        if schedule == "cosine":
            assert math.isclose(lr_factor(9, cfg, 14), 0.1 + 0.9 * 0.5)


@pytest.mark.parametrize(("max_norm", "implementation"), [(1e-3, "fused"), (0.0, "fused"), (1e-3, "for-loop")])
def test_the_update_sees_gradients_clipped_to_max_grad_norm(tmp_path, max_norm, implementation) -> None:
    import torch

    from h3train.run.assemble import build_trainer

    overrides = tiny_overrides(tmp_path, "checkpoint.every=0", "train.steps=1")
    overrides += [f"train.max_grad_norm={max_norm}", f"optim.implementation={implementation}"]
    cfg = load_config(TINY_FL2VA, overrides)
    trainer = build_trainer(cfg, hooks=[])
    seen = {}

    def before_update(optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen["norm"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        seen["kernel"] = (optimizer.defaults["fused"], optimizer.defaults["foreach"])

    trainer.parts.optimizer.register_step_pre_hook(before_update)
    try:
        stats = trainer.train_step(1)
    finally:
        trainer.close()
    assert seen["kernel"] == ((True, None) if implementation == "fused" else (None, False))
    if max_norm:
        # The logged norm is the one before clipping; the update gets it scaled down to max_norm.
        assert stats["grad_norm"] > 100 * max_norm
        assert seen["norm"] == pytest.approx(max_norm, rel=1e-3)
    else:
        assert seen["norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
