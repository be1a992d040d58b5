"""A start makes each of its decisions once (`run/blueprint.py`), and every part reads them from the blueprint.

Counted over a whole start: the memory plan (`plan.estimate`), the compile decision
(`config.values.resolve_compile`) and the adapter kind's check (`AdapterKind.check`), wherever a caller
looks them up. On CUDA with `auto` tables and recompute (drawn here on a CPU, at the released 16-GPU
config), each table setting's memory plan is computed once, and the run's plan, policies and tables are
the chosen setting's.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from h3train.cli import main
from h3train.config import load_config
from h3train.lora.adapter_kinds import ADAPTER_KINDS

from helpers.launch import tiny_args
from helpers.paths import ROOT

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
RELEASED = ROOT / "configs" / "h3_a100_16gpu.yaml"


def _count_everywhere(monkeypatch: pytest.MonkeyPatch, original: Callable, key: str, counts: collections.Counter):
    """Replace `original` in every loaded module that holds it (a caller that imported it, and its own
    module for a caller that imports it when it runs) by a wrapper that counts its calls under `key`."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return original(*args, **kwargs)

    holders = [m for m in list(sys.modules.values()) if getattr(m, original.__name__, None) is original]
    assert holders, f"no module holds {original.__name__}"
    for module in holders:
        monkeypatch.setattr(module, original.__name__, counted)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    import h3train.commands.check  # noqa: F401 - loaded, so that its names are counted too
    import h3train.run.assemble  # noqa: F401
    import h3train.train.trainer  # noqa: F401
    from h3train.config.values import resolve_compile
    from h3train.plan import estimate

    found: collections.Counter = collections.Counter()
    _count_everywhere(monkeypatch, estimate, "memory plan", found)
    _count_everywhere(monkeypatch, resolve_compile, "compile", found)
    for kind_class in {type(kind) for kind in ADAPTER_KINDS.values()}:
        check = kind_class.check

        def counted(self: Any, lora: Any, _check: Callable = check) -> None:
            found["adapter kind"] += 1
            _check(self, lora)

        monkeypatch.setattr(kind_class, "check", counted)
    return found


def test_a_training_start_decides_each_thing_once(tmp_path: Path, counts: collections.Counter) -> None:
    # Adapter files into each checkpoint: the checks build the adapters on meta to judge the formats.
    args = tiny_args(tmp_path / "run", "train.steps=1", "checkpoint.export=both", config=TINY_LORA)
    assert main(args) == 0
    assert counts == {"memory plan": 1, "compile": 1, "adapter kind": 1}, counts


def test_check_decides_each_thing_once(tmp_path: Path, counts: collections.Counter, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(TINY_LORA)]) == 0
    # `check` prints both table settings side by side: one shard rank serves none, so one is planned.
    assert counts == {"memory plan": 1, "compile": 1, "adapter kind": 1}, counts
    assert "compile: off" in capsys.readouterr().out


def test_cuda_auto_plans_each_table_setting_once_and_builds_the_chosen_one(
    tmp_path: Path, counts: collections.Counter, monkeypatch
) -> None:
    from h3train.parallel.dims import ParallelDims
    from h3train.run.blueprint import draw
    from h3train.run.preflight import JobDevice, preflight

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load_config(RELEASED, ["model.pretrained=/nonexistent/MiniMax-H3"])
    assert cfg.parallel.adaln_tables == "auto" and cfg.model.activation_checkpointing == "auto"
    checked = preflight(cfg, planning=True, world_size=16)
    counts.clear()
    blueprint = draw(checked, ParallelDims.from_config(cfg.parallel, 16), JobDevice(79.3, "a100"), device_kind="cuda")
    assert counts == {"memory plan": 2, "compile": 1}, counts
    choice = blueprint.tables
    assert choice is not None and set(choice.plans) == {False, True}
    assert blueprint.cfg.parallel.adaln_tables is choice.served and blueprint.configured_tables == "auto"
    assert blueprint.memory_plan is choice.plans[choice.served]
    assert blueprint.policies == tuple(blueprint.memory_plan.policies)
    assert len(blueprint.policies) == int(checked.model_dims["num_layers"])
    # A start says what the blueprint holds, and decides nothing again.
    lines = blueprint.start_lines()
    assert lines[0].startswith(f"AdaLN tables: {'on' if choice.served else 'off'} (parallel.adaln_tables: auto")
    assert lines[1].startswith("memory plan: ")
    assert counts == {"memory plan": 2, "compile": 1}, counts
