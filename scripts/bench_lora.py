"""LoRA against full fine-tuning on the CPU bench's reduced model: optimizer-state bytes and step time.

The model is `h3train bench --reduced`'s (`h3train.tools.bench.REDUCED_DIMS`, 2 blocks) and the sample its
FL2VA clip (`REDUCED_CLIP`: 22 frames at 128x192, both keyframes, stereo audio), laid out as
synthetic data of that geometry. Both runs go through `Trainer.train_step` in this process on one
rank (forward, backward, clip, AdamW): the full fine-tune with float32 master weights, the LoRA run
with `lora.rank` adapters on the default targets and the base frozen in bfloat16 (computed in
float32). Optimizer state is every tensor in `optimizer.state` after the first step (AdamW's
`exp_avg`, `exp_avg_sq`, `step`); step time is the median of `--repeats` steps after a warm-up, the two runs'
steps alternating in one process, wall clock and CPU time.

    .venv/bin/python scripts/bench_lora.py [--rank 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from h3train.tasks.synthetic import clip_sample

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from h3train.config import load_config  # noqa: E402
from h3train.run.assemble import build_trainer  # noqa: E402
from h3train.tasks.layout import Geometry  # noqa: E402
from h3train.tools.bench import REDUCED_CLIP, REDUCED_DIMS  # noqa: E402


def _overrides(tmp: Path, steps: int) -> list[str]:
    geometry = clip_sample(REDUCED_CLIP, REDUCED_DIMS["text_dim"], 0).geometry
    dims = [f"model.config.{k}={v}" for k, v in REDUCED_DIMS.items()]
    return [
        *dims,
        "model.config.num_layers=2",
        f"data.synthetic.text_len={REDUCED_CLIP.text_len}",
        f"data.synthetic.vision_tokens={REDUCED_CLIP.vision_tokens}",
        *_geometry(geometry),
        "train.grad_accum=1",
        f"train.steps={steps}",
        "checkpoint.every=0",
        f"logging.dir={tmp}",
        "logging.progress=false",
    ]


def _geometry(g: Geometry) -> list[str]:
    return [
        f"data.synthetic.num_latent_frames={g.num_latent_frames}",
        f"data.synthetic.latent_height={g.latent_height}",
        f"data.synthetic.latent_width={g.latent_width}",
        f"data.synthetic.num_audio_latents={g.num_audio_latents}",
    ]


def _state_bytes(trainer) -> int:
    return sum(
        t.numel() * t.element_size()
        for per_param in trainer.parts.optimizer.state.values()
        for t in per_param.values()
        if torch.is_tensor(t)
    )


def measure(runs: dict[str, tuple[str, list[str]]], repeats: int) -> dict[str, dict[str, float]]:
    """Per run: optimizer-state bytes, trainable parameters, median step seconds (wall and CPU), rows.

    The runs' steps alternate (one of each, `repeats` times), so a machine shared with other work
    slows them alike; CPU time (`time.process_time`) is the steadier figure on a busy machine.
    """
    trainers = {
        name: build_trainer(load_config(ROOT / "configs" / config, o), hooks=[]) for name, (config, o) in runs.items()
    }
    out: dict[str, dict[str, float]] = {}
    try:
        for name, trainer in trainers.items():
            stats = trainer.train_step(1)  # warm-up; creates the AdamW state
            out[name] = {
                "state_bytes": _state_bytes(trainer),
                "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
                "rows": stats["seq_len"],
            }
        wall: dict[str, list[float]] = {name: [] for name in trainers}
        cpu: dict[str, list[float]] = {name: [] for name in trainers}
        for step in range(2, repeats + 2):
            for name, trainer in trainers.items():
                w, c = time.perf_counter(), time.process_time()
                trainer.train_step(step)
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - c)
        for name in trainers:
            out[name].update(wall=statistics.median(wall[name]), cpu=statistics.median(cpu[name]))
    finally:
        # One process group serves both; the last close leaves it.
        names = list(trainers)
        for name in names[:-1]:
            trainers[name].close(clean=False)
        trainers[names[-1]].close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=4, help="lora.rank (alpha = rank)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per run (median)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        steps = args.repeats + 1
        lora = [*_overrides(tmp / "lora", steps), f"lora.rank={args.rank}", f"lora.alpha={args.rank}"]
        got = measure(
            {"full": ("tiny_fl2va.yaml", _overrides(tmp / "full", steps)), "lora": ("tiny_lora.yaml", lora)},
            args.repeats,
        )
    full, lora = got["full"], got["lora"]
    dims = ", ".join(f"{k} {REDUCED_DIMS[k]}" for k in ("hidden_size", "num_attention_heads", "ffn_dim"))
    print(f"model: h3train bench --reduced ({dims}, 2 blocks), {int(full['rows'])} packed rows, CPU, one rank")
    print(f"{'':28}{'full':>14}{f'LoRA r={args.rank}':>14}{'LoRA / full':>14}")
    rows = (
        ("trainable parameters", "trainable", "{:,.0f}", 1),
        ("optimizer state bytes", "state_bytes", "{:,.0f}", 1),
        ("step time, wall (ms)", "wall", "{:.1f}", 1e3),
        ("step time, CPU (ms)", "cpu", "{:.1f}", 1e3),
    )
    for label, key, spec, scale in rows:
        a, b = full[key] * scale, lora[key] * scale
        print(f"{label:28}{spec.format(a):>14}{spec.format(b):>14}{b / a:>14.4f}")
    print(f"(step times: medians of {args.repeats} alternating steps after a warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
