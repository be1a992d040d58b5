"""What a background checkpoint save (`checkpoint.async_save=true`) costs the training step right after it.

What runs. The trainer itself (`h3train.run.assemble.build_trainer`) on `configs/tiny_fl2va.yaml`'s
model and synthetic data at `--width` (hidden size; heads of 16 channels, SwiGLU 2 x width) with
`--layers` blocks and `--latent` latent frames' size, one rank, AdamW, where the trainer runs: on
CUDA when there is a GPU (bfloat16 by default, `--dtype`), else on the CPU (float32). `--warmup`
steps first, then `--saves` rounds of: a plain step, an async save (`Trainer.save_checkpoint`),
the next step at once, the wait for the background write (`Checkpointer.wait`). Each step is wall
clock around `Trainer.train_step`, the device synchronized after it on CUDA. The two steps of a
round run back to back, so a host that other work slows slows both alike: a round's ratio
compares like with like, where medians of separate runs would not.

What it prints. Per round the plain step, the step right after the save and their ratio
`step-after-save / plain-step`: the first round separately (its save allocates the host copy,
and on CUDA page-locks it), then the median over the later rounds, whose saves reuse it. With the host copy kept
across saves the step after a save waits only for the copy itself (on CUDA its optimizer update
queues behind it) and shares the host with the background write (DCP's planning and one
`torch.save` per tensor, Python on another thread), so the ratio stays near 1 where the step
outlasts both. On a small CPU model the write's Python is of the step's order: expect noise there.

    .venv/bin/python scripts/bench_async_save.py [--width 32] [--layers 2] [--latent HxW] [--warmup 1]
                                                 [--saves 4] [--dtype D] [--json out.json]

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
    parser.add_argument(
        "--saves", type=int, default=4, help="rounds of a plain step, an async save and the step after it (default 4)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bfloat16 on cuda")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.width % HEAD_DIM or args.width <= 0:
        parser.error(f"--width {args.width}: must be a positive multiple of {HEAD_DIM}")
    if args.saves < 1 or args.warmup < 1:
        parser.error("--warmup and --saves must be at least 1 (the first step builds AdamW's moments)")
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
    """`--saves` rounds of a plain step, a save and the step after it; their times (seconds) and ratios."""
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
            rounds = []
            for _ in range(args.saves):
                plain = step()
                start = time.perf_counter()
                trainer.save_checkpoint()
                call = time.perf_counter() - start
                after = step()
                start = time.perf_counter()
                trainer.parts.checkpointer.wait()
                wait = time.perf_counter() - start
                rounds.append(
                    {
                        "plain_step_s": plain,
                        "save_call_s": call,
                        "step_after_save_s": after,
                        "wait_s": wait,
                        "ratio": after / plain,
                    }
                )
            state_bytes = _state_bytes(trainer.parts.checkpoint_state)
            parameters = sum(p.numel() for p in trainer.model.parameters())
        finally:
            trainer.close()
    later = rounds[1:] or rounds
    return {
        "device": str(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "parameters": parameters,
        "state_bytes": state_bytes,
        "rounds": rounds,
        "first_ratio": rounds[0]["ratio"],
        "plain_step_s": statistics.median(r["plain_step_s"] for r in later),
        "step_after_save_s": statistics.median(r["step_after_save_s"] for r in later),
        "ratio": statistics.median(r["ratio"] for r in later),
    }


def _state_bytes(components: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in the checkpoint state (what a save copies to host memory)."""
    from torch.utils._pytree import tree_flatten

    from h3train.tools.bench_optim import tensor_bytes

    leaves, _ = tree_flatten({name: c.state_dict() for name, c in components.items()})
    return sum(tensor_bytes(t) for t in leaves if isinstance(t, torch.Tensor))


def format_result(r: dict[str, Any], args: argparse.Namespace) -> str:
    rounds = r["rounds"]
    later = f"rounds 2-{len(rounds)}" if len(rounds) > 1 else "the only round"
    lines = [
        f"model: tiny_fl2va at width {args.width}, {args.layers} blocks, {r['parameters']:,} parameters, "
        f"{r['dtype']}; checkpoint state {r['state_bytes'] / 2**20:.1f} MiB; {r['device']}, torch {r['torch']}",
        f"{'round':>5} {'plain ms':>10} {'save call ms':>13} {'after ms':>10} {'wait ms':>9} {'ratio':>7}",
    ]
    for n, x in enumerate(rounds, 1):
        lines.append(
            f"{n:>5} {1e3 * x['plain_step_s']:>10.1f} {1e3 * x['save_call_s']:>13.1f} "
            f"{1e3 * x['step_after_save_s']:>10.1f} {1e3 * x['wait_s']:>9.1f} {x['ratio']:>7.2f}"
            + ("  (allocates the host copy)" if n == 1 else "")
        )
    lines.append(
        f"plain step {1e3 * r['plain_step_s']:.1f} ms, step after save {1e3 * r['step_after_save_s']:.1f} ms "
        f"(medians of {later})"
    )
    lines.append(
        f"step-after-save / plain-step: {r['ratio']:.2f} (median of {later}; first round {r['first_ratio']:.2f})"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(format_result(result, args), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
