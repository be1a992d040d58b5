"""`scripts/bench_optim.py` (`h3train.tools.bench_optim`) at its smallest: every optimizer kind's row, its
state bytes and times, and the plan."""

from __future__ import annotations

import json
import math

import pytest
import torch

from h3train.model.quant import INTEGER_CODES_SHARD
from h3train.tools import bench_optim


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run: width 128, one block (its matrices quantize), one warm-up and one timed step, torchao eager."""
    bench = bench_optim
    out = tmp_path_factory.mktemp("bench_optim") / "optim.json"
    compile_before = torch.compile
    smallest = ["--width", "128", "--layers", "1", "--warmup", "1", "--steps", "1", "--eager"]
    assert bench.main([*smallest, "--json", str(out)]) == 0
    assert torch.compile is compile_before, "--eager left torch.compile patched"
    return bench, json.loads(out.read_text())


def test_every_kind_has_a_row_with_its_state_bytes(report) -> None:
    bench, data = report
    rows = {r["kind"]: r for r in data["kinds"]}
    assert list(rows) == list(bench.KINDS) == ["adamw", "adamw8bit", "adamw4bit", "adamw_bf16"]
    count = rows["adamw"]["trainable_parameters"]
    assert count > 100_000 and all(r["trainable_parameters"] == count for r in rows.values())
    for r in rows.values():
        # Measured: both moments as lowbit.state_bytes has them, plus a 4-byte step counter per tensor.
        assert r["state_bytes"] == r["exact_state_bytes"] + 4 * r["parameter_tensors"], r["kind"]
    assert 8.0 <= rows["adamw"]["state_bytes_per_param"] < 8.01
    assert rows["adamw"]["weights_grad_bytes_per_param"] == 8.0
    assert 2.0 < rows["adamw8bit"]["state_bytes_per_param"] < 2.5
    assert 1.0 < rows["adamw4bit"]["state_bytes_per_param"] < 1.5
    bf16 = rows["adamw_bf16"]
    assert 4.0 <= bf16["state_by_dtype"]["bfloat16"]["state_bytes_per_param"] < 4.01
    assert 8.0 <= bf16["state_by_dtype"]["float32"]["state_bytes_per_param"] < 8.01
    assert 4.0 < bf16["weights_grad_bytes_per_param"] < 5.0
    assert [r["plan_state_bytes_per_value"] for r in rows.values()] == [8.0, 2.03125, 1.0625, 4.0]


def test_times_are_positive_ratios_and_losses_agree(report) -> None:
    _, data = report
    rows = {r["kind"]: r for r in data["kinds"]}
    assert rows["adamw"]["optimizer_step_ratio"] == rows["adamw"]["train_step_ratio"] == 1.0
    for r in rows.values():
        for key in ("optimizer_step_s", "train_step_s", "optimizer_step_ratio", "train_step_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["kind"], key)
        assert math.isfinite(r["loss"])
        # The same weights and data: step 1's loss is one figure (bfloat16 weights round it a little).
        rel = 1e-2 if r["kind"] == "adamw_bf16" else 0
        assert r["first_loss"] == pytest.approx(rows["adamw"]["first_loss"], rel=rel)
        assert r["loss"] == pytest.approx(rows["adamw"]["loss"], rel=1e-2)


def test_the_printed_table_and_the_released_models_plan(report) -> None:
    bench, data = report
    plans = data["plan"]
    setups = [s[0] for s in bench.PLAN_SETUPS]
    assert [(p["setup"], p["kind"]) for p in plans] == [(s, k) for s in setups for k in bench.KINDS]
    total = {(p["setup"], p["kind"]): p["total_bytes"] for p in plans}
    for setup in setups:
        adamw, q8, q4, b16 = (total[(setup, k)] for k in bench.KINDS)
        # bfloat16 weights and moments (6 B a parameter) against float32 weights and 4-bit moments
        # (5 B): adamw_bf16 is below adamw4bit only where the gradients count in the peak (4 B against 2).
        assert adamw > q8 > q4 > 0 and adamw > b16 > 0, setup
    # A full fine-tune's moments are most of the difference; a LoRA's adapters are a few hundred MiB.
    assert total[("full, 8 x A100", "adamw")] - total[("full, 8 x A100", "adamw4bit")] > 20 * 1024**3
    assert total[("LoRA, 8 GPUs", "adamw")] - total[("LoRA, 8 GPUs", "adamw4bit")] < 1024**3
    rows = {r["kind"]: r for r in data["kinds"]}
    printed = bench.format_measured(data["kinds"], bench.parse_args(["--width", "128", "--layers", "1", "--eager"]))
    printed += bench.format_plan_totals(plans)
    text = "\n".join(printed)
    for kind, r in rows.items():
        line = next(line for line in printed if line.startswith(f"{kind} "))
        assert f"{r['state_bytes_per_param']:.3f}" in line and f"{r['train_step_ratio']:.2f}" in line, line
    assert "torchao step eager" in text and "configs/h3_a100_64gpu.yaml" in text


def test_each_lora_base_has_a_row_with_its_bytes_against_bfloat16(report) -> None:
    _, data = report
    rows = {r["kind"]: r for r in data["bases"]}
    # torch 2.8's FSDP2 cannot shard int8 codes: that lane measures float8 only (int8 is refused there).
    assert list(rows) == ["none", "int8", "float8"] if INTEGER_CODES_SHARD else ["none", "float8"]
    assert rows["none"]["base_bytes_ratio"] == 1.0
    # The matrices at 1 byte instead of 2; vectors, islands and row scales keep the rest.
    for kind in set(rows) - {"none"}:
        assert 0.5 < rows[kind]["base_bytes_ratio"] < 0.7, rows[kind]["base_bytes_ratio"]
        assert rows[kind]["train_step_s"] > 0 and rows[kind]["loss"] == pytest.approx(rows["none"]["loss"], rel=1e-2)
    plans = {(p["setup"], p["kind"]): p["total_bytes"] for p in data["base_plan"]}
    for setup in {s for s, _ in plans}:
        # The same bytes at rest; FSDP2 all-gathers int8 codes as stored, float8 ones cast to bfloat16.
        assert plans[(setup, "int8")] < plans[(setup, "float8")] < plans[(setup, "none")]
