"""The trainer's extension points: model transforms run before sharding, step hooks at every step."""

from __future__ import annotations

import json

import torch
from torch.distributed.fsdp import FSDPModule

from h3train.config import load_config
from h3train.run.assemble import build_trainer
from h3train.train.dump import full_tensor
from h3train.train.hooks import TrainerHook, TrainerView
from h3train.train.profile import trace_step_ranges

from helpers.paths import TINY_FL2VA


def _config(tmp_path, *extra: str):
    return load_config(
        TINY_FL2VA,
        [f"logging.dir={tmp_path}", "train.steps=3", "logging.progress=false", "checkpoint.every=0", *extra],
    )


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p).detach().clone() for name, p in module.named_parameters()}


class Recorder(TrainerHook):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_fit_start(self, trainer: TrainerView) -> None:
        self.calls.append(("start", trainer.step))

    def before_step(self, trainer: TrainerView, step: int) -> None:
        self.calls.append(("before", step))

    def after_step(self, trainer: TrainerView, step: int, stats):
        assert "loss" in stats and trainer.step == step
        self.calls.append(("after", step))
        return {"hook_metric": 10.0 * step}

    def on_fit_end(self, trainer: TrainerView) -> None:
        self.calls.append(("end", trainer.step))


def test_model_transform_edits_the_bare_model_before_sharding(tmp_path) -> None:
    seen = {}

    def freeze_proj_out(transformer, cfg) -> None:
        seen["sharded"] = isinstance(transformer.transformer_blocks[0], FSDPModule)
        seen["task"] = cfg.task.name
        transformer.proj_out.requires_grad_(False)

    trainer = build_trainer(_config(tmp_path), transforms=[freeze_proj_out], hooks=[])
    try:
        transformer = trainer.model.transformer
        before = _full(transformer)
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        in_optimizer = [p for group in trainer.parts.optimizer.param_groups for p in group["params"]]
        trainer.fit()
        after = _full(transformer)
    finally:
        trainer.close()
    assert seen == {"sharded": False, "task": "fl2va"}
    assert len(in_optimizer) == len(trainable) < len(list(trainer.model.parameters()))
    frozen = [name for name in before if name.startswith("proj_out.")]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen), "a frozen parameter changed"
    trained = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(before[trained], after[trained]), "training did not update the other parameters"


def test_step_hooks_run_in_order_and_their_values_are_logged(tmp_path) -> None:
    recorder = Recorder()
    trainer = build_trainer(_config(tmp_path), hooks=[recorder])
    try:
        trainer.fit()
    finally:
        trainer.close()
    steps = [c for s in (1, 2, 3) for c in (("before", s), ("after", s))]
    assert recorder.calls == [("start", 0), *steps, ("end", 3)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["hook_metric"] for line in lines] == [10.0, 20.0, 30.0]


def test_profile_steps_trace_exactly_those_steps(tmp_path) -> None:
    trainer = build_trainer(_config(tmp_path, "debug.profile_steps=[2,3]"))
    try:
        trainer.fit()
    finally:
        trainer.close()
    trace = tmp_path / "profile" / "steps_2-3_rank0.json"
    assert trace_step_ranges(trace) == ["h3train step 2", "h3train step 3"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events), "no operator was recorded"
