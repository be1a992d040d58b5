"""Does a fine-tune keep a CFG-distilled model's guidance? A study on a tiny H3, end to end on the CPU.

1. **Teacher**: a tiny random `MiniMaxH3Transformer3DModel` trained with flow matching on t2va clips
   of a few concepts (each concept its own video and audio pattern and its own prompt), the prompt
   dropped to the negative one for a quarter of the steps, so its conditional and negative
   predictions differ: `c - u` points at the concept.
2. **Student**: a copy of the teacher, CFG-distilled: its conditional prediction trained toward the
   teacher's guided `u + s (c - u)` at `s = --scale` (4), its negative prediction toward the
   teacher's `u`. Its implicit guidance `p(c) - p(neg)` is then about `s` times the teacher's.
3. **Fine-tunes** of the student on a new small dataset (the same concepts in a new style), each an
   `h3train train` run from the student's folder (`model.pretrained`), with held-out validation
   whose retention metrics compare with the student (the stored base predictions):
   plain flow matching and the CFG-calibrated objective (`cfg.scale = s`), full and LoRA.

One row per arm: the held-out loss on the new data (`val/loss`, plain flow matching, as the run
logged it), the same data's calibrated loss `MSE((p(c) + (s - 1) p(neg)) / s, v)` (the fit of a
distilled model, video plus audio), the guidance ratio and cosine against the distilled student
(`val/guidance_ratio_*`, `val/guidance_cos_*`, as the run logged them), and the distance of the
fine-tuned conditional prediction from the teacher's guided one on the held-out pairs (mean squared
error over the loss rows). Deterministic under
`--seed`; the table is printed and written as JSON (`<out>/distill_study.json`).

    .venv/bin/python scripts/distill_study.py --out runs/distill_study
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel

# A checkout without the editable install runs its own package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h3train.cli import main as h3train  # noqa: E402
from h3train.tools.distill_study import (  # noqa: E402
    ARMS,
    COLUMNS,
    CONCEPTS,
    ROOT,
    SIGMAS,
    World,
    distill_student,
    format_table,
    held_out_measures,
    table_row,
    train_teacher,
)


def fine_tune(arm: str, out: Path, student_dir: Path, data: Path, args: argparse.Namespace) -> tuple[dict, Path]:
    """One `h3train train` run of `arm` from the student; returns its last validation row and its export."""
    run = out / "runs" / arm
    shutil.rmtree(run, ignore_errors=True)
    overrides = [
        f"model.pretrained={student_dir}",
        "task.name=t2va",
        "data.source=cached",
        f"data.path={data / 'train'}",
        f"train.steps={args.finetune_steps}",
        "train.grad_accum=1",
        f"train.seed={args.seed}",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "cfg.negative_visual=drop",
        f"validation.dataset={data / 'heldout'}",
        f"validation.every={args.finetune_steps}",
        "validation.at_start=true",
        f"validation.sigmas=[{','.join(map(str, SIGMAS))}]",
        f"validation.seed={args.seed}",
        f"checkpoint.every={args.finetune_steps}",
        f"logging.dir={run}",
        "logging.progress=false",
    ]
    for item in ARMS[arm][0]:
        overrides.append(item.format(scale=args.scale, lora_lr=args.lora_lr))
    code = h3train(["train", str(ROOT / "configs" / "tiny_fl2va.yaml"), *overrides])
    if code != 0:
        raise SystemExit(f"distill_study: the {arm} run exited {code}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in rows if r.get("kind") == "validation"]
    export = run / "export"
    merge = ["--merge"] if arm.endswith("lora") else []
    if h3train(["export", str(run), "--out", str(export), *merge]) != 0:
        raise SystemExit(f"distill_study: exporting the {arm} run failed")
    return {"start": validation[0], "end": validation[-1]}, export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/distill_study", help="folder for the models, data, runs and JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=4.0, help="guidance scale the student is distilled at")
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--distill-steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--lora-lr", type=float, default=1e-2)
    parser.add_argument("--clips", type=int, default=16, help="clips per dataset")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    began = time.monotonic()
    out = Path(args.out)
    world = World(args.seed)
    original = world.dataset(out / "data" / "original", args.clips, args.seed + 10, styled=False)
    new_train = world.dataset(out / "data" / "new" / "train", args.clips, args.seed + 11, styled=True)
    del new_train
    heldout = world.dataset(out / "data" / "new" / "heldout", CONCEPTS, args.seed + 12, styled=True)

    teacher = train_teacher(original, args.teacher_steps, args.seed)
    student = distill_student(teacher, original, args.distill_steps, args.scale, args.seed)
    student_dir = out / "student"
    shutil.rmtree(student_dir, ignore_errors=True)
    student.save_pretrained(student_dir / "transformer")
    print(f"teacher and student ready in {time.monotonic() - began:.0f} s", flush=True)

    rows: dict[str, dict[str, float]] = {}
    arms: dict[str, dict] = {}
    for arm in ARMS:
        validation, export = fine_tune(arm, out, student_dir, out / "data" / "new", args)
        tuned = MiniMaxH3Transformer3DModel.from_pretrained(export).float().eval()
        if "student" not in rows:
            # Step 0 of any arm is the student itself: ratio and cosine 1 by construction.
            rows["student"] = table_row(
                validation["start"], held_out_measures(student, teacher, heldout, args.scale, args.seed)
            )
        rows[arm] = table_row(validation["end"], held_out_measures(tuned, teacher, heldout, args.scale, args.seed))
        arms[arm] = {"what": ARMS[arm][1], "validation": validation["end"]}
    table = format_table(rows)
    print(table)
    result = {
        "settings": vars(args),
        "columns": {key: title for key, title in COLUMNS},
        "rows": rows,
        "arms": arms,
        "seconds": round(time.monotonic() - began, 1),
    }
    path = out / "distill_study.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
