"""What a background checkpoint save (`checkpoint.async_save=true`) costs the training step right after it.

What runs. The trainer itself (`h3train.run.assemble.build_trainer`) on `configs/tiny_fl2va.yaml`'s
model and synthetic data at `--width` (hidden size; heads of 16 channels, SwiGLU 2 x width) with
`--layers` blocks and `--latent` latent frames' size, one rank, AdamW, where the trainer runs: on
CUDA when there is a GPU (bfloat16 by default, `--dtype`), else on the CPU (float32). `--warmup`
steps first, then `--steps` plain steps, then `--saves` times: an async save
(`Trainer.save_checkpoint`), the next step at once, the wait for the background write
(`Checkpointer.wait`). Each step is wall clock around `Trainer.train_step`, the device
synchronized after it on CUDA.

What it prints. The plain step (median), the step right after a save and the ratio
`step-after-save / plain-step`: the first save separately (it allocates the host copy, and on
CUDA page-locks it), then the median over the later saves, which reuse it. With the host copy kept
across saves the step after a save waits only for the copy itself (on CUDA its optimizer update
queues behind it) and shares the host with the background write (DCP's planning and one
`torch.save` per tensor, Python on another thread), so the ratio stays near 1 where the step
outlasts both. On a small CPU model the write's Python is of the step's order: expect noise there.

    .venv/bin/python scripts/bench_async_save.py [--width 32] [--layers 2] [--latent HxW] [--warmup 1]
                                                 [--steps 3] [--saves 3] [--dtype D] [--json out.json]

The defaults are the smallest case (the tiny config's own model, seconds on a CPU). On a GPU,
for example, `--width 1024 --layers 4 --latent 64x96`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# A checkout without the editable install runs its own package.
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from h3train.config import load_config  # noqa: E402
from h3train.run.assemble import build_trainer  # noqa: E402

CONFIG = ROOT / "configs" / "tiny_fl2va.yaml"
HEAD_DIM = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a plain trainer step and the step right after an async checkpoint save; "
        "print step-after-save / plain-step.",
    )
    parser.add_argument("--width", type=int, default=32, help="hidden size, a multiple of 16 (default 32)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--latent", default="", help="latent height x width, e.g. 32x48 (default: the config's)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed plain steps (default 3)")
    parser.add_argument("--saves", type=int, default=3, help="async saves, each followed by a timed step (default 3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bfloat16 on cuda")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.width % HEAD_DIM or args.width <= 0:
        parser.error(f"--width {args.width}: must be a positive multiple of {HEAD_DIM}")
    if min(args.steps, args.saves) < 1 or args.warmup < 1:
        parser.error("--warmup, --steps and --saves must be at least 1 (the first step builds AdamW's moments)")
    if args.latent and not (len(args.latent.split("x")) == 2 and all(v.isdigit() for v in args.latent.split("x"))):
        parser.error(f"--latent {args.latent}: expected HEIGHTxWIDTH, e.g. 32x48")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return args


def overrides(args: argparse.Namespace, log_dir: Path) -> list[str]:
    """The tiny config's overrides for this bench: the model's size, one rank, async saves only when called."""
    out = [
        f"logging.dir={log_dir}",
        "logging.progress=false",
        f"model.config.hidden_size={args.width}",
        f"model.config.num_attention_heads={args.width // HEAD_DIM}",
        f"model.config.ffn_dim={2 * args.width}",
        f"model.config.num_layers={args.layers}",
        f"model.dtype={args.dtype}",
        "train.grad_accum=1",
        "train.steps=100000",
        "checkpoint.every=0",
        "checkpoint.keep_last=0",
        "checkpoint.async_save=true",
    ]
    if args.latent:
        height, width = args.latent.split("x")
        out += [f"data.synthetic.latent_height={height}", f"data.synthetic.latent_width={width}"]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Plain steps, then saves each followed by a step; their times (seconds) and ratios."""
    with tempfile.TemporaryDirectory(prefix="h3train-bench-async-save-") as tmp:
        trainer = build_trainer(load_config(CONFIG, overrides(args, Path(tmp) / "run")), hooks=[])
        device = trainer.device
        try:

            def step() -> float:
                start = time.perf_counter()
                trainer.train_step(trainer.step + 1)
                trainer.step += 1
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                return time.perf_counter() - start

            for _ in range(args.warmup):
                step()
            plain = [step() for _ in range(args.steps)]
            saves = []
            for _ in range(args.saves):
                start = time.perf_counter()
                trainer.save_checkpoint()
                call = time.perf_counter() - start
                after = step()
                start = time.perf_counter()
                trainer.parts.checkpointer.wait()
                saves.append({"save_call_s": call, "step_after_save_s": after, "wait_s": time.perf_counter() - start})
            state_bytes = _state_bytes(trainer.parts.checkpoint_state)
            parameters = sum(p.numel() for p in trainer.model.parameters())
        finally:
            trainer.close()
    plain_s = statistics.median(plain)
    later = saves[1:] or saves
    after_s = statistics.median(s["step_after_save_s"] for s in later)
    return {
        "device": str(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "parameters": parameters,
        "state_bytes": state_bytes,
        "plain_step_s": plain_s,
        "plain_steps_s": plain,
        "saves": saves,
        "first_step_after_save_s": saves[0]["step_after_save_s"],
        "first_ratio": saves[0]["step_after_save_s"] / plain_s,
        "step_after_save_s": after_s,
        "ratio": after_s / plain_s,
    }


def _state_bytes(components: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in the checkpoint state (what a save copies to host memory)."""
    from torch.utils._pytree import tree_flatten

    from h3train.tools.bench_optim import tensor_bytes

    leaves, _ = tree_flatten({name: c.state_dict() for name, c in components.items()})
    return sum(tensor_bytes(t) for t in leaves if isinstance(t, torch.Tensor))


def format_result(r: dict[str, Any], args: argparse.Namespace) -> str:
    saves = r["saves"]
    later = f"median of saves 2-{len(saves)}" if len(saves) > 1 else "the only save"
    return "\n".join(
        [
            f"model: tiny_fl2va at width {args.width}, {args.layers} blocks, {r['parameters']:,} parameters, "
            f"{r['dtype']}; checkpoint state {r['state_bytes'] / 2**20:.1f} MiB; {r['device']}, torch {r['torch']}",
            f"plain step          {1e3 * r['plain_step_s']:9.1f} ms  (median of {len(r['plain_steps_s'])})",
            f"step after 1st save {1e3 * r['first_step_after_save_s']:9.1f} ms  ratio {r['first_ratio']:.2f}"
            "  (allocates the host copy)",
            f"step after save     {1e3 * r['step_after_save_s']:9.1f} ms  ratio {r['ratio']:.2f}  ({later})",
            "save call " + ", ".join(f"{1e3 * s['save_call_s']:.1f}" for s in saves) + " ms; "
            "wait " + ", ".join(f"{1e3 * s['wait_s']:.1f}" for s in saves) + " ms",
            f"step-after-save / plain-step: {r['ratio']:.2f}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(format_result(result, args), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
