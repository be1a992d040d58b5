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

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402

from h3train.cli import main as h3train  # noqa: E402
from h3train.config import CfgConfig, LossWeights, TimestepConfig  # noqa: E402
from h3train.data.dataset import CachedDataset  # noqa: E402
from h3train.data.format import CachedSample, write_index, write_sample  # noqa: E402
from h3train.data.synth import _presentation_tags  # noqa: E402
from h3train.objective import compute_loss, make_training_inputs, masked_mse  # noqa: E402
from h3train.tasks.layout import AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS  # noqa: E402
from h3train.tasks.packed import PackedSample  # noqa: E402
from h3train.train.validation import heldout_generator  # noqa: E402

TINY = yaml.safe_load((ROOT / "configs" / "tiny_fl2va.yaml").read_text())["model"]["config"]
# The geometry of every clip: 5 pixel frames -> 2 latent frames of 4 x 6, 8 audio latents per channel.
NUM_FRAMES, LATENT_FRAMES, HEIGHT, WIDTH, AUDIO_LATENTS = 5, 2, 4, 6, 8
PROMPT_TOKENS, NEGATIVE_TOKENS = 10, 3
CONCEPTS = 4
SIGMAS = [0.2, 0.4, 0.6, 0.8]
TIMESTEPS = TimestepConfig()
WEIGHTS = LossWeights()


# -- data -------------------------------------------------------------------------------------------


class World:
    """The concepts (video and audio patterns, prompt embeddings), the negative prompt and a style."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        text_dim = TINY["text_dim"]
        self.video = torch.randn(CONCEPTS, VIDEO_LATENT_CHANNELS, LATENT_FRAMES, HEIGHT, WIDTH, generator=g)
        self.audio = torch.randn(CONCEPTS, 2, AUDIO_LATENT_CHANNELS, AUDIO_LATENTS, generator=g)
        self.prompts = torch.randn(CONCEPTS, PROMPT_TOKENS, text_dim, generator=g)
        self.negative = torch.randn(NEGATIVE_TOKENS, text_dim, generator=g)
        # The new data's style: the same concepts, shifted.
        self.style_video = 0.8 * torch.randn(VIDEO_LATENT_CHANNELS, LATENT_FRAMES, HEIGHT, WIDTH, generator=g)
        self.style_audio = 0.8 * torch.randn(2, AUDIO_LATENT_CHANNELS, AUDIO_LATENTS, generator=g)

    def sample(self, name: str, concept: int, g: torch.Generator, styled: bool) -> CachedSample:
        video = self.video[concept] + 0.5 * torch.randn(self.video[concept].shape, generator=g)
        audio = self.audio[concept] + 0.5 * torch.randn(self.audio[concept].shape, generator=g)
        if styled:
            video, audio = video + self.style_video, audio + self.style_audio
        prompt = self.prompts[concept] + 0.05 * torch.randn(self.prompts[concept].shape, generator=g)
        negative_tags = _presentation_tags([], NEGATIVE_TOKENS)
        return CachedSample(
            sample_id=name,
            task="t2va",
            num_frames=NUM_FRAMES,
            video_latents=video,
            audio_latents=audio,
            prompt_embeds=prompt,
            text_token_tags=_presentation_tags([], PROMPT_TOKENS),
            negative_prompt_embeds=self.negative.clone(),
            negative_text_token_tags=negative_tags,
            negative_visual_prompt_embeds=self.negative.clone(),
            negative_visual_text_token_tags=negative_tags.clone(),
            source=f"distill_study(concept={concept}, styled={styled})",
        )

    def dataset(self, folder: Path, count: int, seed: int, styled: bool) -> list[PackedSample]:
        """`count` clips, concepts in turn, written as a cached dataset; returns them packed."""
        g = torch.Generator().manual_seed(seed)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            write_sample(folder / f"clip-{i:04d}.safetensors", self.sample(f"clip-{i:04d}", i % CONCEPTS, g, styled))
        write_index(folder)
        return list(CachedDataset(folder, "t2va"))


# -- teacher and student ----------------------------------------------------------------------------


def _forward(model: MiniMaxH3Transformer3DModel):
    return lambda **inputs: model(**inputs, return_dict=False)


def train_teacher(samples: list[PackedSample], steps: int, seed: int) -> MiniMaxH3Transformer3DModel:
    """Flow matching, the prompt dropped to the negative one on a quarter of the steps."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**TINY).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        sample = samples[int(torch.randint(len(samples), (), generator=g))]
        drop = bool(torch.rand((), generator=g) < 0.25)
        ti = make_training_inputs(sample, g, TIMESTEPS, WEIGHTS, CfgConfig(), drop_text=drop)
        opt.zero_grad(set_to_none=True)
        compute_loss(_forward(model), ti).loss.backward()
        opt.step()
    return model.eval()


def _guided_pair(sample: PackedSample, g: torch.Generator, scale: float, sigma: float | None = None):
    """Inputs of one pair with the negative branch (`uncond_inputs`) built, at `sigma` or a drawn one."""
    return make_training_inputs(sample, g, TIMESTEPS, WEIGHTS, CfgConfig(scale=scale), sigma=sigma)


def distill_student(
    teacher: MiniMaxH3Transformer3DModel, samples: list[PackedSample], steps: int, scale: float, seed: int
) -> MiniMaxH3Transformer3DModel:
    """The student's conditional prediction toward the teacher's `u + s (c - u)`, its negative toward `u`."""
    student = MiniMaxH3Transformer3DModel(**TINY).float()
    student.load_state_dict(teacher.state_dict())
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        ti = _guided_pair(samples[int(torch.randint(len(samples), (), generator=g))], g, scale)
        with torch.no_grad():
            c = teacher(**ti.model_inputs, return_dict=False)
            u = teacher(**ti.uncond_inputs, return_dict=False)
        p = student(**ti.model_inputs, return_dict=False)
        q = student(**ti.uncond_inputs, return_dict=False)
        masks = (ti.loss_mask_video, ti.loss_mask_audio)
        loss = sum(
            masked_mse(p[m], (u[m] + scale * (c[m] - u[m]))[0], masks[m]) + masked_mse(q[m], u[m][0], masks[m])
            for m in range(2)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return student.eval()


def held_out_measures(
    model: MiniMaxH3Transformer3DModel,
    teacher: MiniMaxH3Transformer3DModel,
    heldout: list[PackedSample],
    scale: float,
    seed: int,
) -> dict[str, float]:
    """Means over the held-out pairs (the validation's own noise), over the loss rows, per modality:

    - `to_guided_*`: `MSE(p(c), u_T + s (c_T - u_T))`, the distance from the teacher's guided prediction;
    - `calibrated_*`: `MSE((p(c) + (s - 1) p(neg)) / s, v)`, how well the model fits the new data read
      as a distilled model (its prediction undone by its own guidance), whatever objective trained it.
    """
    sums: dict[str, float] = {}
    pairs = 0
    for sample in heldout:
        for sigma in SIGMAS:
            ti = _guided_pair(sample, heldout_generator(seed, sample.sample_id, sigma), scale, sigma=sigma)
            with torch.no_grad():
                c = teacher(**ti.model_inputs, return_dict=False)
                u = teacher(**ti.uncond_inputs, return_dict=False)
                p = model(**ti.model_inputs, return_dict=False)
                q = model(**ti.uncond_inputs, return_dict=False)
            for m, name in enumerate(("video", "audio")):
                mask = (ti.loss_mask_video, ti.loss_mask_audio)[m]
                target = (ti.target_video, ti.target_audio)[m]
                guided = float(masked_mse(p[m], (u[m] + scale * (c[m] - u[m]))[0], mask))
                calibrated = float(masked_mse((p[m] + (scale - 1.0) * q[m]) / scale, target, mask))
                sums[f"to_guided_{name}"] = sums.get(f"to_guided_{name}", 0.0) + guided
                sums[f"calibrated_{name}"] = sums.get(f"calibrated_{name}", 0.0) + calibrated
            pairs += 1
    return {key: value / pairs for key, value in sums.items()}


# -- the fine-tunes ---------------------------------------------------------------------------------

ARMS = {
    # name: (overrides, what it is)
    "plain_full": ([], "full fine-tune, plain flow matching"),
    "cfg_full": (["cfg.scale={scale}"], "full fine-tune, CFG-calibrated objective"),
    "plain_lora": (["lora.rank=8", "optim.lr={lora_lr}"], "LoRA rank 8, plain flow matching"),
    "cfg_lora": (["lora.rank=8", "optim.lr={lora_lr}", "cfg.scale={scale}"], "LoRA rank 8, CFG-calibrated objective"),
}


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


# -- the table --------------------------------------------------------------------------------------

COLUMNS = (
    ("val_loss", "held-out loss"),
    ("calibrated", "calibrated"),
    ("guidance_ratio_video", "g ratio v"),
    ("guidance_cos_video", "g cos v"),
    ("guidance_ratio_audio", "g ratio a"),
    ("guidance_cos_audio", "g cos a"),
    ("to_guided_video", "to guided v"),
    ("to_guided_audio", "to guided a"),
)


def _row(validation: dict, measured: dict[str, float]) -> dict[str, float]:
    out = {
        "val_loss": validation["val/loss"],
        "calibrated": measured["calibrated_video"] + measured["calibrated_audio"],
    }
    for name in ("video", "audio"):
        out[f"guidance_ratio_{name}"] = validation[f"val/guidance_ratio_{name}"]
        out[f"guidance_cos_{name}"] = validation[f"val/guidance_cos_{name}"]
        out[f"to_guided_{name}"] = measured[f"to_guided_{name}"]
    return out


def format_table(rows: dict[str, dict[str, float]]) -> str:
    width = max(len(name) for name in rows) + 2
    lines = ["arm".ljust(width) + "".join(f"{title:>15}" for _, title in COLUMNS)]
    for name, row in rows.items():
        lines.append(name.ljust(width) + "".join(f"{row[key]:>15.4f}" for key, _ in COLUMNS))
    return "\n".join(lines)


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
            rows["student"] = _row(
                validation["start"], held_out_measures(student, teacher, heldout, args.scale, args.seed)
            )
        rows[arm] = _row(validation["end"], held_out_measures(tuned, teacher, heldout, args.scale, args.seed))
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
