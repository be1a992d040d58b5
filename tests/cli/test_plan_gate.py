"""The memory plan as a gate: `check` fails a plan that does not fit, every shipped config fits its own
`# plan: world N` line away from its data, `data.max_rows` bounds the samples, and `train` refuses on a
GPU a run that does not fit (the device check taken on a CPU by passing the device type)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.errors import ConfigError
from h3train.model.architecture import model_dims, planned_model_dims
from h3train.parallel.dims import ParallelDims
from h3train.plan import (
    GIB,
    EvaluationPlan,
    dropped_line,
    estimate,
    format_plan,
    plan_memory,
    refuse_over_plan,
)
from h3train.tasks.released import LONGEST_ROWS

from helpers.launch import run_cli
from helpers.paths import ROOT, TINY_FL2VA

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
HEADER = re.compile(r"^# plan: world (\d+)\b", re.MULTILINE)
# The plan's arithmetic and the gate's lines are h3train's own: no torch, diffusers or peft version changes them.
pytestmark = pytest.mark.one_lane


def _world(config: Path) -> int:
    found = HEADER.search(config.read_text())
    assert found, f"{config.name} lacks its '# plan: world N' line"
    return int(found[1])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_fits_its_plan_header_without_its_data(
    config: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # Relative data and model folders resolve under an empty folder: nothing of the config is here but
    # the components folder that renders validation.samples, which check requires (the stand-in's).
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    components = load_config(config, []).validation.components
    if components and not Path(components).is_absolute():
        from h3train.data.components import write_tiny_components

        write_tiny_components(components)
    rc, out, err = run_cli(capsys, ["check", str(config), "--world-size", str(_world(config))])
    assert rc == 0, out[-2000:] + err
    assert "fits: yes" in out and "fits: NO" not in out


def test_a_plan_that_does_not_fit_fails_check_naming_the_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / "h3_fl2va_a100.yaml"
    rc, out, err = run_cli(capsys, ["check", str(config), "--world-size", "8", "model.activation_checkpointing=none"])
    assert rc == ConfigError.exit_code == 2
    assert "fits: NO" in out
    line = err.strip().splitlines()
    assert len(line) == 1 and "of the device's 79.3 GiB" in line[0] and "set data.max_rows=" in line[0]
    # Knowingly over the plan: check prints it and lets a launch go on, as train starts.
    rc, out, _ = run_cli(capsys, ["check", str(config), "--world-size", "8", "model.activation_checkpointing=none",
                                  "train.ignore_memory_plan=true"])  # fmt: skip
    assert rc == 0 and "fits: NO" in out


def test_check_prints_the_global_batch_and_the_tasks_own_clip(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / "h3_fl2va_lora_a100.yaml"
    rc, out, _ = run_cli(capsys, ["check", str(config), "--world-size", "16", "task.name=t2va", "data.path=/nowhere"])
    assert rc == 0, out
    assert "batch         32 samples per optimizer step (dp 2 x grad_accum 16), 2 per micro-batch" in out
    assert "longest released t2va clip: 15 s at 768x1344, no keyframes" in out
    assert "FL2VA" not in out and "s of 768x1344 T2VA" in out


def test_check_plans_checkpoint_staging_in_host_memory_per_rank_and_node(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / "h3_a100_16gpu.yaml"
    cfg = load_config(config, [])
    plan = estimate(planned_model_dims(cfg)[0], ParallelDims.from_config(cfg.parallel, 16), cfg)
    assert plan.staging_bytes == -(-plan.checkpoint_bytes // 16)
    for per_node in (8, 4):
        rc, out, _ = run_cli(capsys, ["check", str(config), "--world-size", "16", "--gpus-per-node", str(per_node)])
        assert rc == 0, out
        ckpt = float(re.search(r"checkpoint    ([\d.]+) GiB on disk", out)[1])
        rank = float(re.search(r"host          ([\d.]+) GiB per rank: checkpoint staging", out)[1])
        node = float(re.search(rf"([\d.]+) GiB per node of {per_node} ranks", out)[1])
        assert rank == pytest.approx(ckpt / 16, abs=0.01) and node == pytest.approx(rank * per_node, abs=0.05)
    rc, out, _ = run_cli(capsys, ["check", str(config), "--world-size", "16", "checkpoint.async_save=false"])
    assert "checkpoint staging none" in out


def _tiny_dataset(tmp_path: Path) -> tuple[Path, list[int]]:
    from h3train.data.dataset import CachedDataset
    from h3train.data.synthetic_dataset import write_synthetic_dataset

    folder = write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=8, seed=0, text_dim=16)
    return Path(folder), CachedDataset(folder, "fl2va").lengths


def test_max_rows_drops_longer_samples_and_bounds_the_plan(tmp_path: Path) -> None:
    from h3train.data.dataset import CachedDataset

    folder, lengths = _tiny_dataset(tmp_path)
    bound = sorted(set(lengths))[-2]
    longer = [n for n in lengths if n > bound]
    assert longer and bound < max(lengths)
    kept = CachedDataset(folder, "fl2va", max_rows=bound)
    assert kept.lengths == [n for n in lengths if n <= bound]
    assert sorted(n for _, n in kept.dropped) == sorted(longer)
    overrides = ["data.source=cached", f"data.path={folder}", f"data.max_rows={bound}"]
    cfg = load_config(TINY_FL2VA, overrides)
    mesh = ParallelDims.from_config(cfg.parallel, 1)
    assert estimate(model_dims(cfg), mesh, cfg).rows == bound
    line = dropped_line(cfg)
    assert line is not None and f"drops {len(longer)} samples" in line and f"{max(lengths):,} rows" in line
    # Away from the data the bound is the longest sample, not the released clip.
    cfg.data.path = str(tmp_path / "elsewhere")
    plan = estimate(model_dims(cfg), mesh, cfg)
    assert plan.rows == bound and plan.rows_origin.startswith("data.max_rows")
    cfg.data.max_rows = 0
    assert estimate(model_dims(cfg), mesh, cfg).rows == LONGEST_ROWS
    with pytest.raises(ConfigError, match="data.max_rows"):
        cfg.data.path, cfg.data.max_rows = str(folder), min(lengths) - 1
        estimate(model_dims(cfg), mesh, cfg)


def _over_plan():
    """A tiny run's plan on a device too small for it."""
    cfg = load_config(TINY_FL2VA, [])
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg, device_memory_gib=4.0)
    assert not plan.fits  # the 4 GiB reserve alone fills it
    return cfg, plan


def test_train_refuses_a_run_over_its_plan_on_a_gpu_only(tmp_path: Path, monkeypatch, capsys) -> None:
    from helpers.blueprints import start_plan

    cfg, plan = _over_plan()
    with pytest.raises(ConfigError, match=r"memory plan needs .* set train.ignore_memory_plan=true"):
        refuse_over_plan(plan, "cuda", ignored=False)
    refuse_over_plan(plan, "cpu", ignored=False)
    refuse_over_plan(plan, "cuda", ignored=True)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="train.ignore_memory_plan"):
        start_plan(cfg, "cuda", 4.0)
    assert "memory plan: fits: NO" in capsys.readouterr().out
    start_plan(cfg, "cpu", 4.0)
    assert "memory plan: fits: NO" in capsys.readouterr().out
    cfg.train.ignore_memory_plan = True
    start_plan(cfg, "cuda", 4.0)
    start_plan(load_config(TINY_FL2VA, []), "cuda", 80.0)
    assert "memory plan: fits: yes" in capsys.readouterr().out


def test_the_evaluation_forward_is_the_peak_when_it_holds_more(tmp_path: Path) -> None:
    """No gradients between steps, but a forward over longer rows and the VAEs on the device: the verdict
    is over whichever is more, and the printout says which."""
    from h3train.plan.activations import evaluation_activation_bytes

    cfg = load_config(TINY_FL2VA, [])
    dims = model_dims(cfg)
    plan = plan_memory(
        dims, dp_replicate=1, dp_shard=1, sp=1, dtype="float32", activation_checkpointing="none", rows=51
    )
    assert plan.evaluation_bytes == 0 and plan.peak_bytes == plan.total_bytes
    rows = 200_000
    act = evaluation_activation_bytes(dims, rows, "float32", 1, 13)
    vaes = 3 * GIB
    evaluated = replace(plan, evaluation=EvaluationPlan(rows, rows, act, vaes, "held-out loss and rendering"))
    expected = plan.sharded_state_bytes - plan.grads_bytes + plan.unsharded_params_bytes + act + vaes
    assert evaluated.evaluation_bytes == expected + plan.reserve_bytes > plan.total_bytes
    assert evaluated.peak_bytes == evaluated.evaluation_bytes
    text = format_plan(evaluated)
    assert "between steps (no gradients)" in text and "(the peak; held-out" in text and "VAEs 3.00 GiB" in text
    device = (plan.total_bytes + evaluated.evaluation_bytes) / 2 / GIB
    assert replace(plan, device_bytes=int(device * GIB)).fits
    assert not replace(evaluated, device_bytes=int(device * GIB)).fits


def test_train_refuses_the_longest_sample_by_name_and_max_rows_lets_it_start(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from h3train.data.dataset import CachedDataset

    from helpers.blueprints import start_plan

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder, lengths = _tiny_dataset(tmp_path)
    longest = CachedDataset(folder, "fl2va").entries[lengths.index(max(lengths))].sample_id
    cfg = load_config(TINY_FL2VA, ["data.source=cached", f"data.path={folder}", "model.activation_checkpointing=none"])
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg)
    # A device with room for the shortest sample, not the longest.
    shorter = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 1), cfg, rows=min(lengths))
    device = (shorter.total_bytes + plan.total_bytes) / 2 / GIB
    with pytest.raises(ConfigError, match=rf"'{longest}'.*set data.max_rows=\d+") as caught:
        start_plan(cfg, "cuda", device)
    bound = int(re.search(r"data.max_rows=(\d+)", str(caught.value))[1])
    assert min(lengths) <= bound < max(lengths)
    cfg.data.max_rows = bound
    start_plan(cfg, "cuda", device)
    out = capsys.readouterr().out
    assert "memory plan: fits: yes" in out and f"data.max_rows={bound:,} drops" in out
