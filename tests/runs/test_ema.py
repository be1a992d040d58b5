"""EMA of the trainable parameters: the recurrence on the saved weights, skipped steps, bitwise resume."""

from __future__ import annotations

import pytest
import torch

from h3train.cli import main
from h3train.config import load_config
from h3train.model.architecture import model_dims
from h3train.model.build import build_model
from h3train.plan import checkpoint_bytes

from helpers.launch import checkpoint_tensor_bytes, checkpoint_tensors, read_metrics, run_forked
from helpers.paths import TINY_FL2VA

DECAY = 0.75


def _args(log_dir, *extra: str) -> list[str]:
    return [
        "train",
        str(TINY_FL2VA),
        f"logging.dir={log_dir}",
        "logging.progress=false",
        f"train.ema.decay={DECAY}",
        "checkpoint.keep_last=0",
        *extra,
    ]


def _step(log_dir, step: int):
    return log_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def every_step(tmp_path_factory):
    """Four steps, a checkpoint after each, step 3 skipped by an injected NaN loss."""
    log_dir = tmp_path_factory.mktemp("ema")
    assert main(_args(log_dir, "train.steps=4", "checkpoint.every=1", "debug.fault=[nan_loss@3]")) == 0
    return log_dir


def test_ema_follows_the_recurrence_over_the_saved_weights(every_step) -> None:
    cfg = load_config(TINY_FL2VA, [])
    initial = {f"transformer.{k}": v.detach() for k, v in build_model(cfg, cfg.train.seed).named_parameters()}
    assert [m["skipped_steps"] for m in read_metrics(every_step)] == [0, 0, 1, 1]
    expected = {k: v.double() for k, v in initial.items()}
    for step in (1, 2, 3, 4):
        weights = checkpoint_tensors(_step(every_step, step), "model.")
        if step != 3:  # a skipped step updates neither the weights nor the EMA
            expected = {k: DECAY * e + (1 - DECAY) * weights[k].double() for k, e in expected.items()}
        ema = checkpoint_tensors(_step(every_step, step), "ema.")
        assert ema.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(ema[key].double(), value, rtol=1e-6, atol=1e-7, msg=f"step {step}: {key}")
    # The EMA is not just the weights: after four steps it lags them.
    assert not torch.allclose(ema["transformer.proj_in.weight"], weights["transformer.proj_in.weight"])


def test_planned_checkpoint_size_counts_the_ema(every_step) -> None:
    cfg = load_config(TINY_FL2VA, [f"train.ema.decay={DECAY}"])
    planned, held = checkpoint_bytes(model_dims(cfg), cfg), checkpoint_tensor_bytes(_step(every_step, 4))
    # Weights, AdamW's two moments and the EMA: four float32 copies; AdamW's step counts on top.
    assert 0 <= held - planned <= 0.01 * planned, (held, planned)
    assert planned == 4 * 4 * sum(p.numel() for p in build_model(cfg, cfg.train.seed).parameters())


@pytest.mark.parametrize("lora", [False, True])
def test_planned_per_rank_memory_holds_the_ema_shadows_the_trainer_keeps(lora: bool, tmp_path) -> None:
    from h3train.parallel.dims import ParallelDims
    from h3train.parallel.shards import local_tensor
    from h3train.plan import estimate
    from h3train.run.assemble import build_trainer
    from h3train.train.ema import EmaHook

    extra = ["lora.rank=4"] if lora else []
    cfg = load_config(TINY_FL2VA, [f"train.ema.decay={DECAY}", f"logging.dir={tmp_path}", *extra])
    trainer = build_trainer(cfg)
    try:
        (ema,) = [h for h in trainer.parts.hooks if isinstance(h, EmaHook)]
        held = sum(local_tensor(s).numel() * local_tensor(s).element_size() for s in ema.shadow.values())
    finally:
        trainer.close()
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg)
    assert plan.ema_bytes == held > 0
    without = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), load_config(TINY_FL2VA, extra))
    assert plan.total_bytes - without.total_bytes == held


def test_ema_resumes_bitwise(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_forked(_args(straight, "train.steps=4", "checkpoint.every=4"))
    run_forked(_args(resumed, "train.steps=4", "checkpoint.every=4", "debug.fault=[sigterm@2]"))
    assert _step(resumed, 2).is_dir() and not _step(resumed, 4).exists()
    run_forked(_args(resumed, "train.steps=4", "checkpoint.every=4"))
    a, b = checkpoint_tensors(_step(straight, 4), "ema."), checkpoint_tensors(_step(resumed, 4), "ema.")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed EMA differs from the straight run's"


def test_validation_can_use_the_ema_weights(tmp_path) -> None:
    from h3train.data.synthetic_dataset import write_synthetic_dataset

    data = tmp_path / "heldout"
    write_synthetic_dataset(data, task="fl2va", num_samples=2, seed=3, text_dim=16)
    rows = {}
    for use_ema in ("false", "true"):
        log_dir = tmp_path / use_ema
        args = _args(
            log_dir,
            "train.steps=3",
            "validation.at_start=true",
            "validation.every=3",
            f"validation.dataset={data}",
            "validation.sigmas=[0.5]",
            f"validation.use_ema={use_ema}",
        )
        assert main(args) == 0
        rows[use_ema] = [m for m in read_metrics(log_dir) if m.get("kind") == "validation"]
        train = [m["loss"] for m in read_metrics(log_dir) if "kind" not in m]
        rows[use_ema + "_train"] = train
    assert rows["false_train"] == rows["true_train"], "evaluating with the EMA changed training"
    # At the start the EMA is the weights; after training it is not.
    assert rows["true"][0]["val/loss"] == rows["false"][0]["val/loss"]
    assert rows["true"][1]["val/loss"] != rows["false"][1]["val/loss"]


def test_ema_config_errors(capsys) -> None:
    assert main(["check", str(TINY_FL2VA), "train.ema.decay=1.0"]) == 2
    assert "train.ema.decay" in capsys.readouterr().err
    assert main(["check", str(TINY_FL2VA), "validation.use_ema=true"]) == 2
    assert "validation.use_ema" in capsys.readouterr().err
