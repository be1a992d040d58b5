"""`parallel.adaln_tables: auto` as `check` plans and prints it, for every shipped cluster config.

Each config is checked at the world size of its `# plan:` line. The line `AdaLN tables: ...` gives both
settings' estimated step and peak; the setting taken must be the one its rule takes from those figures
(`plan/tables.py`): where both fit, the shorter step; where one fits, that one; where neither, the smaller
peak. Then the rule itself on one config, its memory set so that each branch is the one taken.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.model.architecture import model_kwargs
from h3train.parallel.dims import ParallelDims
from h3train.plan import GIB, estimate
from h3train.plan.step_time import DEFAULT_DEVICE, rates_of_kind
from h3train.plan.tables import choose_tables, tables_line

from helpers.launch import run_cli
from helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

CLUSTER = sorted(p.name for p in (ROOT / "configs").glob("h3_*.yaml"))
SETTING = r"(?:~([\d,.]+) s a step, ([\d.]+) GiB|does not fit \(([\d.]+) GiB\)|not servable)"
LINE = re.compile(
    rf"^AdaLN tables: (on|off) \(parallel\.adaln_tables: auto, ([^)]*)\); with them {SETTING}, without {SETTING}$",
    re.M,
)


@pytest.fixture
def away(tmp_path: Path, monkeypatch) -> Path:
    """Plan away from the model and the data, 8 GPUs a node whatever the environment says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return tmp_path


def _world(name: str) -> int:
    found = re.search(r"^# plan: world (\d+)", (ROOT / "configs" / name).read_text(), re.M)
    assert found, f"{name} lacks its '# plan:' line"
    return int(found[1])


def test_every_cluster_config_is_checked() -> None:
    assert len(CLUSTER) >= 7 and "h3_a100_64gpu.yaml" in CLUSTER


@pytest.mark.parametrize("name", CLUSTER)
def test_check_prints_both_settings_and_takes_the_one_its_rule_takes(away: Path, capsys, name: str) -> None:
    rc, out, err = run_cli(capsys, ["check", str(ROOT / "configs" / name), "--world-size", str(_world(name))])
    assert rc == 0, out[-2000:] + err
    found = LINE.search(out)
    assert found, f"{name}: no AdaLN tables line in\n{out[:3000]}"
    word, reason, on_step, on_peak, on_over, off_step, off_peak, off_over = found.groups()
    assert on_step and off_step or on_over or off_over, f"{name}: both settings' figures: {found[0]}"
    if on_step and off_step:
        assert (word == "on") == (float(on_step.replace(",", "")) < float(off_step.replace(",", ""))), found[0]
    elif on_step or off_step:
        assert (word == "on") == bool(on_step), found[0]
    else:
        assert (word == "on") == (float(on_over) < float(off_over)), found[0]
    assert reason


def _choice(memory_gib: float, **overrides: str):
    args = [f"parallel.{k}={v}" for k, v in overrides.items()]
    cfg = load_config(ROOT / "configs" / "h3_a100_16gpu.yaml", ["model.activation_checkpointing=full", *args])
    dims = ParallelDims.from_config(cfg.parallel, 16)
    model = model_kwargs({})

    def plan_of(c, d):
        return estimate(model, d, c, device_memory_gib=memory_gib, fused_norm=True)

    return choose_tables(cfg, dims, model, rates_of_kind(DEFAULT_DEVICE), ranks_per_node=8, plan_of=plan_of)


def test_the_rule_fits_first_then_takes_the_shorter_step() -> None:
    roomy = _choice(200.0)
    with_them, without = (roomy.plans[s].peak_bytes / GIB for s in (True, False))
    # The tables keep the projections out of the gathered blocks: the smaller peak.
    assert with_them < without
    assert roomy.steps[True] is not None and roomy.steps[False] is not None
    assert roomy.served == (roomy.steps[True].step_s < roomy.steps[False].step_s)
    # Room for the tables' peak only: they are what makes the run fit.
    between = _choice((with_them + without) / 2)
    assert between.served and between.reason == "what makes the run fit" and between.steps[False] is None
    # Room for neither: the smaller peak.
    short = _choice(with_them / 2)
    assert short.served and short.reason == "neither fits: the smaller peak"
    # Nothing to serve offloaded; a configured setting is kept.
    assert not _choice(200.0, cpu_offload="true").served
    assert not _choice((with_them + without) / 2, adaln_tables="false").served
    assert "parallel.adaln_tables: false, as configured" in tables_line(_choice(200.0, adaln_tables="false"))
