"""scripts/distill_study.py and its models (`h3train.tools.distill_study`): its table is complete and
measured, and it is deterministic under --seed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from h3train.tools import distill_study as study

from helpers.paths import ROOT
from helpers.ranks import fork_script

SCRIPT = ROOT / "scripts" / "distill_study.py"


def test_teacher_and_student_are_the_same_under_the_same_seed(tmp_path: Path) -> None:
    world = study.World(3)
    samples = world.dataset(tmp_path / "data", 4, 5, styled=False)
    first = [study.train_teacher(samples, 6, seed=3) for _ in range(2)]
    for a, b in zip(first[0].state_dict().values(), first[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    students = [study.distill_student(first[0], samples, 6, 4.0, seed=3) for _ in range(2)]
    for a, b in zip(students[0].state_dict().values(), students[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # The distillation moved the student: its guidance is not the teacher's.
    assert any(not torch.equal(a, b) for a, b in zip(first[0].state_dict().values(), students[0].state_dict().values()))


def test_the_study_writes_a_row_per_arm_from_what_the_runs_logged(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--teacher-steps", "8", "--distill-steps", "8", "--finetune-steps", "2"]
    # `python SCRIPT ARGS`, forked from a server that has imported what the script imports.
    done = fork_script(SCRIPT, [*args, "--clips", "4"], dict(os.environ), Path.cwd(), timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "distill_study.json").read_text())
    assert list(result["rows"]) == ["student", "plain_full", "cfg_full", "plain_lora", "cfg_lora"]
    for row in result["rows"].values():
        assert set(row) == {key for key, _ in study.COLUMNS} and all(math.isfinite(v) for v in row.values())
    student = result["rows"]["student"]
    assert abs(student["guidance_ratio_video"] - 1.0) < 1e-6 and abs(student["guidance_cos_video"] - 1.0) < 1e-6
    # The guidance columns are the runs' own last validation rows.
    for arm in ("plain_full", "cfg_lora"):
        logged = [json.loads(line) for line in (tmp_path / "runs" / arm / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in logged if r.get("kind") == "validation"][-1]
        assert result["rows"][arm]["guidance_ratio_audio"] == last["val/guidance_ratio_audio"]
        assert result["rows"][arm]["val_loss"] == last["val/loss"]
    assert "cfg.scale=4.0" in " ".join(study.ARMS["cfg_full"][0]).format(scale=4.0, lora_lr=0.01)
    out = done.stdout
    assert out.count("\n") and "held-out loss" in out and "cfg_lora" in out
