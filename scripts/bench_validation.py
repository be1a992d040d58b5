"""Time one held-out validation pass and one sample render against one training step (tiny config, CPU).

Everything runs in this process on one rank (gloo), with the tiny H3 of `configs/tiny_fl2va.yaml`
(text_dim 64, the tiny text encoder's width) and tiny random components (`write_tiny_components`).
The training data, the held-out set and the rendered request share one geometry, a 22-frame 96x64
fl2va clip with both keyframes (7 latent frames of 2x3 rows, 37 stereo audio latents), so the ratios
compare like with like:

- training step: `Trainer.train_step` (forward, backward, AdamW), median of `--repeats`;
- held-out pass: `HeldOutLoss.evaluate` over `--heldout` samples x the default 8 sigmas (one
  forward each);
- render: `SampleRenderer.render` of one request, `--inference-steps` sigma grid points
  (`validation.num_inference_steps`, default 50: 49 forwards), then both VAE decoders and the mp4;
  and the denoising loop alone. Each is timed after a warm-up call.

    .venv/bin/python scripts/bench_validation.py [--inference-steps 50] [--heldout 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from h3train.config import load_config  # noqa: E402
from h3train.data.components import TINY_TEXT_HIDDEN, write_tiny_components  # noqa: E402
from h3train.data.synthetic_dataset import write_synthetic_dataset  # noqa: E402
from h3train.encode.media import moving_pattern  # noqa: E402
from h3train.render.pipeline import denoise  # noqa: E402
from h3train.run.assemble import build_trainer  # noqa: E402
from h3train.train.render_hook import SampleRenderer  # noqa: E402
from h3train.train.validation import HeldOutLoss  # noqa: E402

# 22 frames -> 7 latent frames; a 96x64 canvas -> 4x6 latents, 2x3 rows per frame; 37 audio latents.
GEOMETRY = ["data.synthetic.num_latent_frames=7", "data.synthetic.latent_height=4",
            "data.synthetic.latent_width=6", "data.synthetic.num_audio_latents=37"]  # fmt: skip


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inference-steps", type=int, default=50, help="validation.num_inference_steps")
    parser.add_argument("--heldout", type=int, default=4, help="held-out samples")
    parser.add_argument("--repeats", type=int, default=5, help="timed training steps (median)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        components = write_tiny_components(tmp / "components")
        for seed, name in ((1, "first.png"), (2, "last.png")):
            Image.fromarray(moving_pattern(1, 64, 96, seed)[0]).save(tmp / name)
        heldout = tmp / "heldout"
        write_synthetic_dataset(heldout, task="fl2va", num_samples=args.heldout, seed=7, text_dim=TINY_TEXT_HIDDEN)
        request = {"id": "bench", "task": "fl2va", "prompt": "a square drifts over a gradient",
                   "keyframes": {"first": str(tmp / "first.png"), "last": str(tmp / "last.png")},
                   "frames": 22, "resolution": "96x64", "seed": 0}  # fmt: skip
        cfg = load_config(
            ROOT / "configs" / "tiny_fl2va.yaml",
            [
                f"model.config.text_dim={TINY_TEXT_HIDDEN}",
                *GEOMETRY,
                "train.grad_accum=1",
                f"train.steps={args.repeats + 1}",
                "checkpoint.every=0",
                f"logging.dir={tmp / 'run'}",
                "logging.progress=false",
                f"validation.dataset={heldout}",
                "validation.at_start=true",
                f"validation.samples=[{json.dumps(request)}]",
                f"validation.components={components}",
                f"validation.num_inference_steps={args.inference_steps}",
            ],
        )
        heldout_loss, renderer = HeldOutLoss(cfg), SampleRenderer(cfg)
        trainer = build_trainer(cfg, hooks=[heldout_loss, renderer])
        try:
            renderer.prepare(trainer)
            trainer.train_step(1)  # warm-up
            steps = [_timed(lambda s=s: trainer.train_step(s)) for s in range(2, args.repeats + 2)]
            heldout_loss.evaluate(trainer)  # warm-up (reads the dataset)
            validation = _timed(lambda: heldout_loss.evaluate(trainer))
            renderer.render(trainer, 0)  # warm-up (first decoder and encoder calls)
            render = _timed(lambda: renderer.render(trainer, 1))
            forwards = renderer.transformer.forwards
            with torch.no_grad():
                loop = _timed(lambda: denoise(renderer.pipe, renderer.conditioning[0], args.inference_steps))
        finally:
            trainer.close()

    step = statistics.median(steps)
    print(f"training step          {step * 1e3:9.1f} ms  (median of {len(steps)}; forward + backward + AdamW)")
    print(
        f"held-out pass          {validation * 1e3:9.1f} ms  = {validation / step:6.2f} training steps  "
        f"({heldout_loss.forwards} forwards: {args.heldout} samples x {len(cfg.validation.sigmas)} sigmas)"
    )
    print(
        f"render of one sample   {render * 1e3:9.1f} ms  = {render / step:6.2f} training steps  "
        f"({forwards} forwards, then the video and audio VAE decoders and the mp4)"
    )
    print(
        f"  its denoising loop   {loop * 1e3:9.1f} ms  = {loop / step:6.2f} training steps  "
        f"(decoders and mp4 {max(render - loop, 0.0) * 1e3:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
