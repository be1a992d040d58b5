"""`h3train check --rehearse`: every cluster config rehearsed at its own world size, beside its plan.

Each cluster config is rehearsed (`h3train.run.rehearse.rehearse`) on a fake process group of the world
size its header's `h3train check --world-size N` line names, with the released architecture, its
longest planned sample and its own mesh, optimizer, EMA, checkpointing and adapters, but
`NUM_LAYERS` transformer blocks instead of 50: every block is the same FSDP2 unit over the same
rows, so memory per block is the same and the plan is rehearsed term for term at full width (the
full 50-block model at 64 ranks is what `h3train check configs/h3_a100_64gpu.yaml --world-size 64
--rehearse` runs). Beside the configs as written: the full fine-tune under every other `optim.name`
and the LoRA under every other `lora.base_quant`. Then a resume: the DCP metadata of the 64-rank
config's save plan, loaded by the 32-rank config.

The rehearsals are module-scoped and shared by the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from h3train.config import load_config
from h3train.errors import ConfigError
from h3train.run.rehearse import EMA, GRADS, OPTIM, TOLERANCE, UNSHARDED, WEIGHTS, plan_rows, rehearse, rehearse_resume
from h3train.run.rehearse.formatting import format_rehearsal
from h3train.run.rehearse.memtrack import StorageTracker

from helpers.paths import ROOT

pytestmark = pytest.mark.slow

NUM_LAYERS = 2
CLUSTER = (
    "h3_a100_16gpu",
    "h3_a100_32gpu",
    "h3_a100_64gpu",
    "h3_fl2va_a100",
    "h3_fl2va_lora_a100",
    "h3_ref2va_cfg_a100",
    "h3_ref2va_lora_a100",
)
# (name, config, overrides): the configs as written, then the other optimizer kinds and base quantizations.
VARIANTS = [(name, name, ()) for name in CLUSTER] + [
    *(
        (f"h3_fl2va_a100/{kind}", "h3_fl2va_a100", (f"optim.name={kind}",))
        for kind in ("adamw8bit", "adamw4bit", "adamw_bf16")
    ),
    *((f"h3_fl2va_lora_a100/{q}", "h3_fl2va_lora_a100", (f"lora.base_quant={q}",)) for q in ("int8", "float8")),
]


def _config_path(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


def world_size_of(name: str) -> int:
    """The world size the config's header plans for (`h3train check --world-size N`)."""
    found = re.search(r"h3train check --world-size (\d+)", _config_path(name).read_text())
    assert found, f"{name}.yaml names no 'h3train check --world-size N' in its header"
    return int(found.group(1))


@pytest.fixture(scope="module")
def rehearsals() -> dict:
    out = {}
    for name, config, overrides in VARIANTS:
        cfg = load_config(_config_path(config), list(overrides))
        try:
            out[name] = rehearse(cfg, world_size_of(config), num_layers=NUM_LAYERS)
        except ConfigError as exc:  # what the run itself refuses here (an int8 base before torch 2.12)
            out[name] = exc
    return out


def _get(rehearsals: dict, name: str):
    found = rehearsals[name]
    if isinstance(found, ConfigError):
        assert name.endswith("/int8"), found
        pytest.skip(f"the run refuses it on this torch: {found}")
    return found


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_plan_is_within_tolerance_of_the_rehearsed_peak(rehearsals: dict, name: str) -> None:
    r = _get(rehearsals, name)
    assert r.world_size == world_size_of(name.split("/")[0])
    assert r.peak_bytes > 0
    assert r.agrees, (
        f"{name}: plan {r.planned_bytes:,} B, rehearsed peak {r.device_peak_bytes:,} B\n" + format_rehearsal(r)
    )
    assert abs(r.plan_error) <= TOLERANCE


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_sharded_state_is_the_plans(rehearsals: dict, name: str) -> None:
    """Weights, gradients, optimizer state and EMA as the update begins: the state rows of the plan."""
    r = _get(rehearsals, name)
    planned = plan_rows(r.plan)
    for category in (WEIGHTS, OPTIM, EMA, GRADS):
        held = r.at_update[category]
        if not planned[category]:
            assert held == 0, f"{name}: {category} holds {held:,} B, none planned"
            continue
        assert abs(held / planned[category] - 1) <= 0.02, (
            f"{name}: {category} {held:,} B, planned {planned[category]:,} B"
        )


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_the_all_gathered_blocks_are_seen(rehearsals: dict, name: str) -> None:
    r = _get(rehearsals, name)
    # At least the block running; at most the plan's two (running and prefetched), give or take 10 %.
    one_block = r.plan.gathered_block_bytes
    assert one_block <= r.category_peaks[UNSHARDED] <= r.plan.unsharded_params_bytes * 1.1


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_the_save_plan_writes_each_value_once(rehearsals: dict, name: str) -> None:
    r = _get(rehearsals, name)
    save = r.save
    assert len(save.bytes_per_rank) == r.world_size and save.files == r.world_size
    # DCP de-duplicates the replicas' items: the ranks together write one checkpoint, the plan's size.
    assert abs(save.total_bytes / r.plan.checkpoint_bytes - 1) <= 0.01, (save.total_bytes, r.plan.checkpoint_bytes)
    assert min(save.items_per_rank) > 0


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS if "/" in v[0] and "adamw" in v[0]])
def test_what_fake_tensors_cannot_run_is_named(rehearsals: dict, name: str) -> None:
    r = _get(rehearsals, name)
    assert any(note.startswith("optimizer update:") for note in r.notes), r.notes
    assert "optimizer update" in format_rehearsal(r)


def test_adamw_steps_under_fake_tensors(rehearsals: dict) -> None:
    assert not any(note.startswith("optimizer update:") for note in rehearsals["h3_a100_64gpu"].notes)


def test_resume_at_another_world_size_reads_every_value() -> None:
    saved = load_config(_config_path("h3_a100_64gpu"), [])
    loading = load_config(_config_path("h3_a100_32gpu"), [])
    plan = rehearse_resume(saved, 64, loading, 32, num_layers=NUM_LAYERS)
    assert plan.saved_world_size == 64 and plan.world_size == 32
    assert plan.missing == [] and plan.keys > 0
    assert len(plan.reads_per_rank) == 32 and min(plan.reads_per_rank) > 0
    # HSDP with 2 replicas of a 16-way shard: each replica reads the whole checkpoint once.
    assert sum(plan.bytes_per_rank) == pytest.approx(2 * plan.saved_bytes, rel=1e-6)


def test_tracker_counts_live_storages_and_their_peak() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), StorageTracker() as tracker:
        with tracker.attributing("a"):
            a = torch.empty(1000)
        b = torch.empty(250)
        view = b[10:]
        del b
        assert tracker.live == {"a": 4000, "activations": 1000}
        storage = a.untyped_storage()
        storage.resize_(0)
        assert tracker.live["unsharded params"] == 0 and tracker.live["a"] == 0
        del view
        assert tracker.live["activations"] == 0
    assert tracker.peak.total == 5000
    assert tracker.category_peaks == {"a": 4000, "activations": 1000}
