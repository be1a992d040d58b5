"""A background save's host copy (`HostStaging`): allocated once, reused by every save, equal to a blocking save."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from h3train.checkpoint import Checkpointer, HostStaging
from h3train.checkpoint.staging import plain_parts

from helpers.launch import checkpoint_tensors, tiny_overrides
from helpers.paths import TINY_FL2VA


def _storages(state: dict) -> list[int]:
    """The address of each storage the tensors of `state` are made of (a DTensor's local shard's, ...);
    empty tensors, which have none, left out."""
    leaves, _ = tree_flatten(state)
    parts = [p for t in leaves if isinstance(t, torch.Tensor) for p in plain_parts(t)]
    return [p.untyped_storage().data_ptr() for p in parts if p.numel()]


def test_the_host_copy_is_kept_across_saves_and_renewed_when_the_layout_changes() -> None:
    staging = HostStaging(torch.device("cpu"))
    weight = torch.randn(3, 5, dtype=torch.bfloat16)
    state = {"model": {"w": weight, "step": torch.tensor(4.0), "empty": torch.empty(0, 2)}, "lr": 0.5}
    first = staging.stage(state)
    assert first["lr"] == 0.5 and torch.equal(first["model"]["w"], weight)
    # Each tensor its own storage of exactly its bytes: DCP's writer writes whole storages.
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in staging.host_buffers())
    weight.add_(1.0)
    second = staging.stage(state)
    assert _storages(second) == _storages(first)
    assert torch.equal(second["model"]["w"], weight) and not torch.equal(first["model"]["w"], weight - 1.0)
    assert not set(_storages(second)) & set(_storages(state))  # a copy, not the live tensors
    grown = staging.stage({**state, "model": {**state["model"], "w": torch.zeros(4, 5, dtype=torch.bfloat16)}})
    assert grown["model"]["w"].shape == (4, 5) and _storages(grown) != _storages(first)
    staging.close()
    assert staging.host_buffers() == []


def _trainer(log_dir):
    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    overrides = tiny_overrides(log_dir, "train.steps=8", "checkpoint.async_save=true", "checkpoint.keep_last=0")
    return build_trainer(load_config(TINY_FL2VA, overrides), hooks=[])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_background_saves_write_from_one_host_copy_what_a_blocking_save_writes(tmp_path, monkeypatch) -> None:
    """Two async saves, the next step right after each: the same staged storages both times, and each
    checkpoint equal to a blocking save of the state at its step."""
    staged: list[list[int]] = []
    stage = HostStaging.stage

    def recorded(self: HostStaging, state_dict: dict) -> dict:
        out = stage(self, state_dict)
        staged.append(_storages(out))
        return out

    monkeypatch.setattr(HostStaging, "stage", recorded)
    trainer = _trainer(tmp_path / "run")
    try:
        trainer.train_step(1)  # AdamW's moments exist from here on
        trainer.step = 1
        saves = []
        for n in range(2):
            blocking = Checkpointer(tmp_path / f"blocking{n}", keep_last=0, is_main=True)
            expected = blocking.save(trainer.parts.checkpoint_state, {}, trainer.step)
            saves.append((expected, trainer.save_checkpoint()))
            trainer.train_step(trainer.step + 1)
            trainer.step += 1
            trainer.parts.checkpointer.wait()
        buffers = trainer.parts.checkpointer.staging.host_buffers()
    finally:
        trainer.close()
    assert len(staged) == 2 and staged[0] and staged[1] == staged[0]
    assert sorted(staged[0]) == sorted(b.untyped_storage().data_ptr() for b in buffers if b.numel())
    assert trainer.parts.checkpointer.staging.host_buffers() == []  # freed at close
    for expected, path in saves:
        want, got = checkpoint_tensors(expected), checkpoint_tensors(path)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), path.name
    # The saves are of different states: equal checkpoints were not a given.
    first, last = checkpoint_tensors(saves[0][1]), checkpoint_tensors(saves[-1][1])
    assert any(not torch.equal(first[k], last[k]) for k in first if k.startswith("optim."))
