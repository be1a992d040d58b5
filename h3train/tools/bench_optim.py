"""The optimizer-state kinds (`optim.name`) and LoRA's frozen bases (`lora.base_quant`) on the CPU
bench model: state and base bytes, step time and loss.

What runs. `h3train bench --reduced`'s model (`h3train.tools.bench.REDUCED_DIMS`) at `--width` (hidden
size; heads of 16 channels, SwiGLU 2 x width) with `--layers` blocks, trained on its FL2VA clip
(`REDUCED_CLIP`) as synthetic data. One `Trainer` per kind, built by `build_trainer` from
`h3train.tools.bench.trainer_config`'s `Config` (with `optim.lr` at `--lr`, so that a few steps move the
loss) with `optim.name` the only difference between kinds: one rank, float32 compute. The float32
kinds train plain tensors (a one-rank float32 run skips FSDP2); `adamw_bf16`'s bfloat16 parameters
are cast to float32 for compute, so its trainer runs FSDP2 on a one-rank mesh, whose casts are in
its train step. `adamw` is torch's AdamW with its default `optim.implementation` (fused), the
reference of every ratio. All kinds start from the same seeded weights (`adamw_bf16` stores them
rounded to bfloat16, outside the float32 islands) and draw the same samples and noise at every step.

Steps. Each trainer runs `--warmup` steps first; they absorb torchao's `torch.compile` of its step,
once per parameter shape and group: on a 2-core CPU about 70 s per quantized kind with inductor's
on-disk cache cold, about 12 s warm (a later run at the same width). Then `--steps` timed steps, the
kinds' steps alternating, so a machine shared with other work slows them alike.

Measured, per kind:
- state B/param: the bytes of every tensor in `optimizer.state` after the timed steps (`exp_avg`,
  `exp_avg_sq` and the step counter), a tensor subclass (torchao's quantized moments, a DTensor)
  counted as the sum of its inner tensors (`__tensor_flatten__`: codes, block scales, code book),
  over the trainable parameter count. `exact` is `lowbit.state_bytes` summed over the parameters
  (each at its own dtype; no step counter): the two differ by 4 bytes per parameter tensor.
  `plan` is `lowbit.state_bytes_per_value`, the figure `h3train check` plans with at scale, where
  every matrix shard quantizes; at this width the small tensors torchao keeps in float32 and the
  per-tensor code books weigh more.
- weights+grad B/param: the trainable parameters' and their gradients' bytes over the same count.
- opt step: `optimizer.step()` inside `Trainer.update` (timed by the optimizer's step hooks); train
  step: the whole `Trainer.train_step` (forward, backward, grad norm and clip, the step's
  all-reduce, optimizer, schedule). Medians of the timed steps (wall clock), and their ratios to
  `adamw`'s.
- loss: the trainer's logged loss of the last timed step (computed on the weights the steps before
  it made; step 1's loss is the same for every kind). The kinds see the same data, so the column
  is a sanity check (a broken update shows as a loss apart), not a measure of training quality.

Bases. The same model with rank-8 LoRA adapters (the default targets, fused AdamW), one trainer per
`lora.base_quant` (none, int8, float8): the frozen parameters' bytes (codes and row scales of a
quantized base) and their ratio to the bfloat16 base's, the step times against it, the last loss.

Not measured. GPU speed: these are CPU timings of a model of a few hundred thousand parameters.
torchao's compiled step is written for GPUs, where the moments' memory traffic dominates and
dequantize-update-requantize fuses into one kernel per parameter; on this CPU each parameter's step
is a small compiled call with Python around it, against one fused CPU kernel for `adamw`, so its
ratio says little about a GPU's. Peak memory (the CPU has no allocator statistics here), sharding
over several ranks, and training quality over many steps are not measured either. `--eager` runs
torchao's step without `torch.compile` (the same bytes, other times: for quick checks).

The plan. For the released 33 B model, `h3train check`'s per-rank total (`h3train.plan.estimate`
on the config, with the config's `optim.name` replaced) for each kind: the full fine-tune on 8
A100s (`configs/h3_fl2va_a100.yaml`) and 64 (`configs/h3_a100_64gpu.yaml`), and the LoRA fine-tune
(`configs/h3_fl2va_lora_a100.yaml`) on 8 GPUs and on 1 (there with `parallel.sp=1`, the only mesh
one rank has). Each at the config's planned sequence (the longest released clip where its data
folder is not readable here), against 80 GiB devices.

    .venv/bin/python scripts/bench_optim.py [--width 128] [--layers 2] [--warmup 2] [--steps 5] [--lr 1e-3]
                                            [--eager] [--no-plan] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from h3train.config import check_values, load_config
from h3train.model.architecture import model_kwargs, planned_model_dims
from h3train.model.quant import INTEGER_CODES_SHARD
from h3train.optim.kinds import state_bytes, state_bytes_per_value
from h3train.parallel.dims import ParallelDims
from h3train.plan import estimate
from h3train.run.assemble import build_trainer
from h3train.tools.bench import REDUCED_CLIP, REDUCED_DIMS, trainer_config
from h3train.tools.gpu_checks import eager_torch_compile

# The checkout whose configs/ the plan setups read (`scripts/bench_optim.py` runs from it).
ROOT = Path(__file__).resolve().parents[2]

KINDS = ("adamw", "adamw8bit", "adamw4bit", "adamw_bf16")
REFERENCE = "adamw"
# LoRA's frozen base (`lora.base_quant`), timed with adapters of this rank.
BASES = ("none", "int8", "float8")
# The bases this torch's FSDP2 can train on (torch 2.8 cannot shard int8 codes; the plan still counts them).
TRAINABLE_BASES = tuple(kind for kind in BASES if kind != "int8" or INTEGER_CODES_SHARD)
LORA_RANK = 8
GIB = 1024**3
HEAD_DIM = int(REDUCED_DIMS["attention_head_dim"])

# (label, config, world size, overrides) of the released model's plans.
PLAN_SETUPS: tuple[tuple[str, str, int, tuple[str, ...]], ...] = (
    ("full, 8 x A100", "configs/h3_fl2va_a100.yaml", 8, ()),
    ("full, 64 x A100", "configs/h3_a100_64gpu.yaml", 64, ()),
    ("LoRA, 1 GPU", "configs/h3_fl2va_lora_a100.yaml", 1, ("parallel.sp=1",)),
    ("LoRA, 8 GPUs", "configs/h3_fl2va_lora_a100.yaml", 8, ()),
)


def bench_dims(width: int, layers: int) -> dict[str, Any]:
    """The bench model's constructor kwargs: `REDUCED_DIMS` at hidden size `width`."""
    over = {
        **REDUCED_DIMS,
        "hidden_size": width,
        "num_attention_heads": width // HEAD_DIM,
        "ffn_dim": 2 * width,
        "num_layers": layers,
    }
    return model_kwargs(over)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes `t` holds: a plain tensor's elements, a subclass's inner tensors (`__tensor_flatten__`)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        # A DTensor also names its device mesh; only tensors hold bytes.
        inner = [getattr(t, name) for name in names]
        return sum(tensor_bytes(x) for x in inner if isinstance(x, torch.Tensor))
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def exact_state_bytes(kind: str, params: Sequence[torch.Tensor]) -> int:
    """`lowbit.state_bytes` over `params`; under `adamw_bf16` a float32 parameter keeps float32 moments."""
    total = 0
    for p in params:
        name = "adamw" if kind == "adamw_bf16" and p.dtype != torch.bfloat16 else kind
        total += state_bytes(name, p.numel())
    return total


class StepTimer:
    """Wall time of each `optimizer.step()`, taken by the optimizer's own pre- and post-step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def _progress(message: str) -> None:
    print(f"bench_optim: {message}", file=sys.stderr, flush=True)


def measure(
    width: int,
    layers: int,
    warmup: int,
    steps: int,
    eager: bool,
    lr: float = 1e-3,
    seed: int = 0,
    bases: bool = False,
) -> list[dict[str, Any]]:
    """One row per kind (`KINDS`): bytes, median step times and their ratios to `adamw`, last loss.

    `bases`: one row per LoRA base (`TRAINABLE_BASES`, rank `LORA_RANK` with fused AdamW) instead, the ratios
    to the bfloat16 base's, with the frozen base's bytes (`base_bytes`).
    """
    dims = bench_dims(width, layers)
    labels, reference = (TRAINABLE_BASES, "none") if bases else (KINDS, REFERENCE)
    rows: dict[str, dict[str, Any]] = {}
    eager_step = eager_torch_compile() if eager else nullcontext()
    with tempfile.TemporaryDirectory(prefix="h3train-bench-optim-") as tmp, eager_step:
        trainers = {}
        try:
            for kind in labels:
                # The same config but for optim.name, or lora.base_quant (and the run folder each trainer locks).
                cfg = trainer_config(dims, REDUCED_CLIP, "float32", "none", "native", seed, Path(tmp) / kind)
                if bases:
                    cfg.optim = dataclasses.replace(cfg.optim, lr=lr)
                    cfg.lora = dataclasses.replace(cfg.lora, rank=LORA_RANK, base_quant=kind)
                else:
                    cfg.optim = dataclasses.replace(cfg.optim, lr=lr, name=kind)
                check_values(cfg)
                trainers[kind] = build_trainer(cfg, hooks=[])
            timers = {kind: StepTimer(t.parts.optimizer) for kind, t in trainers.items()}
            first_loss: dict[str, float] = {}
            for kind, trainer in trainers.items():
                started = time.perf_counter()
                for step in range(1, warmup + 1):
                    stats = trainer.train_step(step)
                    first_loss.setdefault(kind, float(stats["loss"]))
                _progress(f"{kind}: {warmup} warm-up step(s) in {time.perf_counter() - started:.1f} s")
            wall: dict[str, list[float]] = {kind: [] for kind in trainers}
            loss: dict[str, float] = {}
            for kind in trainers:
                timers[kind].seconds.clear()
            for step in range(warmup + 1, warmup + steps + 1):
                for kind, trainer in trainers.items():
                    started = time.perf_counter()
                    stats = trainer.train_step(step)
                    wall[kind].append(time.perf_counter() - started)
                    loss[kind] = float(stats["loss"])
            for kind, trainer in trainers.items():
                # Gradients live between a step's two halves (the update frees them): one more
                # backward holds them while the row is measured.
                trainer.forward_backward(warmup + steps + 1)
                rows[kind] = _row(kind, trainer, timers[kind].seconds, wall[kind], loss[kind])
                trainer.parts.optimizer.zero_grad(set_to_none=True)
                rows[kind]["first_loss"] = first_loss[kind]
        finally:
            # One process group serves every trainer; the last close leaves it.
            names = list(trainers)
            for kind in names[:-1]:
                trainers[kind].close(clean=False)
            if names:
                trainers[names[-1]].close()
    ref = rows[reference]
    for row in rows.values():
        row["optimizer_step_ratio"] = row["optimizer_step_s"] / ref["optimizer_step_s"]
        row["train_step_ratio"] = row["train_step_s"] / ref["train_step_s"]
        row["base_bytes_ratio"] = row["base_bytes"] / ref["base_bytes"] if ref["base_bytes"] else None
    return [rows[kind] for kind in labels]


def _row(kind: str, trainer: Any, step_s: list[float], train_s: list[float], loss: float) -> dict[str, Any]:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    held = optimizer_state_bytes(trainer.parts.optimizer)
    weights = sum(tensor_bytes(p.detach()) for p in params)
    grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    by_dtype: dict[str, dict[str, float]] = {}
    for dtype in sorted({p.dtype for p in params}, key=str):
        group = [p for p in params if p.dtype == dtype]
        n = sum(p.numel() for p in group)
        group_bytes = sum(
            tensor_bytes(v) for p in group for v in trainer.parts.optimizer.state[p].values() if torch.is_tensor(v)
        )
        by_dtype[str(dtype).removeprefix("torch.")] = {
            "parameters": n,
            "tensors": len(group),
            "state_bytes": group_bytes,
            "state_bytes_per_param": group_bytes / n,
        }
    optim = trainer.cfg.optim.name
    # The frozen base (a LoRA run's): its parameters' bytes, codes and row scales of a quantized one.
    base = sum(tensor_bytes(p.detach()) for p in trainer.model.parameters() if not p.requires_grad)
    return {
        "kind": kind,
        "base_bytes": base,
        "optimizer": type(trainer.parts.optimizer).__name__,
        "trainable_parameters": count,
        "parameter_tensors": len(params),
        "state_bytes": held,
        "state_bytes_per_param": held / count,
        "exact_state_bytes": exact_state_bytes(optim, params),
        "exact_state_bytes_per_param": exact_state_bytes(optim, params) / count,
        "plan_state_bytes_per_value": state_bytes_per_value(optim),
        "weights_grad_bytes_per_param": (weights + grads) / count,
        "state_by_dtype": by_dtype,
        "optimizer_step_s": statistics.median(step_s),
        "train_step_s": statistics.median(train_s),
        "loss": loss,
    }


def plan_totals(
    kinds: Sequence[str] = KINDS, key: str = "optim.name", setups: Sequence[tuple] = PLAN_SETUPS
) -> list[dict[str, Any]]:
    """Per setup (`PLAN_SETUPS`) and value of `key` (the optimizer kind, or `lora.base_quant` over
    the LoRA setups): the released model's planned bytes per rank, every block recomputed (`auto` would
    spend whatever state a kind saves on less recompute, hiding the difference)."""
    out = []
    for label, config, world, overrides in setups:
        for kind in kinds:
            cfg = load_config(ROOT / config, [*overrides, f"{key}={kind}", "model.activation_checkpointing=full"])
            mesh = ParallelDims.from_config(cfg.parallel, world)
            plan = estimate(planned_model_dims(cfg)[0], mesh, cfg)
            out.append(
                {
                    "setup": label,
                    "config": config,
                    "world_size": world,
                    "overrides": list(overrides),
                    "kind": kind,
                    "key": key,
                    "rows": plan.rows,
                    "rows_source": plan.rows_origin,
                    "sharded_state_bytes": plan.sharded_state_bytes,
                    "optimizer_bytes": plan.optimizer_bytes,
                    "total_bytes": plan.total_bytes,
                    "device_bytes": plan.device_bytes,
                    "fits": plan.fits,
                }
            )
    return out


def format_measured(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    first = rows[0]
    mode = "torchao step eager (--eager)" if args.eager else "torchao step compiled"
    lines = [
        f"model: h3train bench --reduced at width {args.width} ({args.width // HEAD_DIM} heads x {HEAD_DIM}, "
        f"ffn {2 * args.width}), {args.layers} blocks, {first['trainable_parameters']:,} parameters in "
        f"{first['parameter_tensors']} tensors; CPU, one rank, float32 compute",
        f"steps: {args.warmup} warm-up, then median of {args.steps} timed (kinds alternating); {mode}",
        "",
        f"{'':12}{'state B/param':^26}{'weights+grad':>13}{'opt step':>16}{'train step':>17}{'loss':>11}",
        f"{'kind':<12}{'measured':>10}{'exact':>8}{'plan':>8}{'B/param':>13}"
        f"{'ms':>9}{'x adamw':>8}{'ms':>9}{'x adamw':>8}{'':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['kind']:<12}{r['state_bytes_per_param']:>10.3f}{r['exact_state_bytes_per_param']:>8.3f}"
            f"{r['plan_state_bytes_per_value']:>8.3f}{r['weights_grad_bytes_per_param']:>13.3f}"
            f"{1e3 * r['optimizer_step_s']:>9.2f}{r['optimizer_step_ratio']:>8.2f}"
            f"{1e3 * r['train_step_s']:>9.1f}{r['train_step_ratio']:>8.2f}{r['loss']:>11.5f}"
        )
    bf16 = next(r for r in rows if r["kind"] == "adamw_bf16")["state_by_dtype"]
    split = ", ".join(
        f"{d['parameters']:,} {name} parameters {d['state_bytes_per_param']:.3f} B" for name, d in bf16.items()
    )
    lines += [
        "measured: optimizer.state's tensors (subclasses by their inner tensors), step counters included; "
        "exact: lowbit.state_bytes; plan: state_bytes_per_value (every shard quantized)",
        f"adamw_bf16 state by parameter dtype: {split}",
    ]
    return lines


def format_bases(rows: list[dict[str, Any]]) -> list[str]:
    """The LoRA base table: frozen base bytes and step times against the bfloat16 base, last loss."""
    lines = [
        "",
        f"LoRA rank {LORA_RANK} on the same model, by frozen base (lora.base_quant), fused AdamW:",
        f"{'base':<10}{'base bytes':>12}{'x bf16':>8}{'opt step ms':>13}{'train step ms':>15}{'x bf16':>8}{'loss':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['kind']:<10}{r['base_bytes']:>12,}{r['base_bytes_ratio']:>8.3f}{1e3 * r['optimizer_step_s']:>13.2f}"
            f"{1e3 * r['train_step_s']:>15.1f}{r['train_step_ratio']:>8.2f}{r['loss']:>11.5f}"
        )
    return lines


def format_plan_totals(plans: list[dict[str, Any]]) -> list[str]:
    setups = list(dict.fromkeys(p["setup"] for p in plans))
    kinds = list(dict.fromkeys(p["kind"] for p in plans))
    cell = {(p["setup"], p["kind"]): p for p in plans}
    key = plans[0]["key"]
    lines = [
        "",
        f"released model (33 B): planned total per rank, GiB of 80 (h3train check --world-size N CONFIG "
        f"{key}=VALUE; * does not fit)",
    ]
    for s in setups:
        first = cell[(s, kinds[0])]
        lines.append(f"  {s:<17}{' '.join([first['config'], *first['overrides']])}")
    lines.append(f"{'kind':<12}" + "".join(f"{s:>17}" for s in setups))
    for kind in kinds:
        marks = [cell[(s, kind)] for s in setups]
        lines.append(
            f"{kind:<12}" + "".join(f"{p['total_bytes'] / GIB:>16.2f}{' ' if p['fits'] else '*'}" for p in marks)
        )
    sequences = {(p["rows"], p["rows_source"]) for p in plans}
    if len(sequences) == 1:
        ((rows, source),) = sequences
        lines.append(f"sequence: {rows:,} rows in every setup ({source})")
    else:
        lines.append("sequence: " + "; ".join(f"{s} {cell[(s, kinds[0])]['rows']:,} rows" for s in setups))
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128, help="hidden size (a multiple of 16; default 128)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per kind first (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per kind, median (default 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="optim.lr of every kind (default 1e-3)")
    parser.add_argument("--eager", action="store_true", help="torchao's step without torch.compile")
    parser.add_argument("--no-plan", action="store_true", help="leave out the released model's plan")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.width < HEAD_DIM or args.width % HEAD_DIM:
        parser.error(f"--width {args.width}: must be a positive multiple of {HEAD_DIM}")
    for flag, value, least in (("--layers", args.layers, 1), ("--warmup", args.warmup, 1), ("--steps", args.steps, 1)):
        if value < least:
            parser.error(f"{flag} {value}: must be at least {least}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args.width, args.layers, args.warmup, args.steps, args.eager, args.lr)
    base_rows = measure(args.width, args.layers, args.warmup, args.steps, args.eager, args.lr, bases=True)
    plans = [] if args.no_plan else plan_totals()
    lora_setups = [s for s in PLAN_SETUPS if "lora" in s[1]]
    base_plans = [] if args.no_plan else plan_totals(BASES, "lora.base_quant", lora_setups)
    lines = format_measured(rows, args) + format_bases(base_rows)
    if plans:
        lines += format_plan_totals(plans) + format_plan_totals(base_plans)
    print("\n".join(lines), flush=True)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        report = {
            "settings": settings,
            "model": bench_dims(args.width, args.layers),
            "kinds": rows,
            "bases": base_rows,
            "plan": plans,
            "base_plan": base_plans,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
