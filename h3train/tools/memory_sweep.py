"""Measure training steps on a GPU beside the memory plan, in the calibration table's format.

`python -m h3train.tools.memory_sweep --out FILE` (`scripts/gpu_check.sh` runs it after the bench): for each
case of `CASES` (blocks, clip, what each block recomputes, compile) it builds the bench's trainer (one
rank, the full-width model, bfloat16, native attention), runs a warm-up step and `--repeats` timed steps,
and writes one line per case: a `plan.calibration.CudaPoint` (measured `torch.cuda.max_memory_allocated`
over the timed steps) with the plan's bytes for it (`bench_plan`, the same function the trainer's `auto`
uses), their ratio, the step time and MFU. Appending the lines' points to `plan/calibration.jsonl`
extends the table the suite holds the plan to. It also names the kernel SDPA runs for each attention
backend (`sdpa_kernels`). Cases that do not fit the device are skipped with the plan's reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import LossWeights, TimestepConfig
from ..model.architecture import model_kwargs
from ..objective import make_training_inputs
from ..plan.calibration import CudaPoint
from ..tasks.synthetic import Clip, clip_sample
from .bench import rows_of
from .bench.cases import CHECKPOINTING, BackendResult, _clear_cuda, bench_plan, run_case, trainer_config
from .bench.flops import peak_tflops_for, step_flops

# (blocks, frames, `--gradient-checkpointing`, compile): the policies and lengths the plan chooses between.
CASES: tuple[tuple[int, int, str, bool], ...] = (
    (4, 124, "auto", False),
    (4, 124, "selective", False),
    (4, 124, "on", True),
    (2, 192, "off", False),
)


class _AttentionOps(TorchDispatchMode):
    """Names the aten attention ops a call dispatches to."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if "attention" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def sdpa_kernels(device: torch.device, rows: int = 4096, heads: int = 8) -> dict[str, str]:
    """The aten op each attention backend of the trainer runs, forward and backward, at head dim 128 in bf16."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from ..ops.attention import ATTENTION_BACKENDS, unavailable

    found: dict[str, str] = {}
    for name, backend in ATTENTION_BACKENDS.items():
        why = unavailable(name, device.type, "bfloat16")
        if why:
            found[name] = f"unavailable: {why}"
            continue
        q, k, v = (
            torch.randn(1, rows, heads, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        ops = _AttentionOps()
        try:
            with ops:
                out = dispatch_attention_fn(q, k, v, backend=backend.diffusers)
                out.float().sum().backward()
            found[name] = ", ".join(dict.fromkeys(ops.ops)) or "no aten attention op"
        except Exception as exc:  # a backend that cannot run here is named, not fatal
            found[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return found


def measure(case: tuple[int, int, str, bool], device: torch.device, repeats: int) -> dict[str, Any]:
    """One case's point, plan and step figures (module docstring)."""
    layers, frames, checkpointing, compiled = case
    dims = model_kwargs({"num_layers": layers})
    clip = Clip(frames=frames, height=768, width=1344, text_len=2048, vision_tokens=1024)
    sample = clip_sample(clip, int(dims["text_dim"]), 0)
    rows = rows_of(make_training_inputs(sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights()))
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 1024**3
    policy = CHECKPOINTING[checkpointing]
    plan = bench_plan(dims, clip, "bfloat16", policy, 0, memory_gib, "cuda")
    line: dict[str, Any] = {
        "case": {"layers": layers, "frames": frames, "checkpointing": checkpointing, "compile": compiled},
        "rows": rows.seq_len,
        "plan_memory_bytes": plan.peak_bytes - plan.reserve_bytes,
        "plan_policies": list(plan.policies),
        "plan_recompute_share": plan.recompute_share,
        "plan_fits": plan.fits,
    }
    if not plan.fits:
        line["skipped"] = "the plan does not fit this device"
        return line
    flops = step_flops(dims, rows)
    res = BackendResult(name="native", backend="native")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="h3train-sweep-") as tmp:
        cfg = trainer_config(dims, clip, "bfloat16", policy, "native", 0, Path(tmp), compile_blocks=compiled)
        try:
            run_case(
                cfg, res, device, repeats, rows.seq_len, flops.total, peak_tflops_for(torch.cuda.get_device_name())
            )
        except torch.cuda.OutOfMemoryError as exc:
            res.status, res.error = "error", f"out of memory: {str(exc).splitlines()[0]}"
        finally:
            _clear_cuda(device)
    line["wall_s"] = time.perf_counter() - start
    line["step"] = asdict(res)
    if res.peak_memory_bytes:
        point = CudaPoint(
            device=torch.cuda.get_device_name(device),
            torch=torch.__version__,
            layers=layers,
            rows=rows.seq_len,
            checkpointing=checkpointing if checkpointing != "auto" else _uniform(plan.policies),
            backend="native",
            compile=compiled,
            measured_peak_bytes=res.peak_memory_bytes,
            frames=frames,
            source="scripts/gpu_check.sh (h3train.tools.memory_sweep)",
        )
        line["point"] = json.loads(point.line())
        line["measured_over_plan"] = res.peak_memory_bytes / line["plan_memory_bytes"]
    return line


def _uniform(policies: tuple[str, ...]) -> str:
    """The bench's name of a uniform policy (on, selective, off); a mix has no point of its own."""
    names = {"full": "on", "selective": "selective", "none": "off"}
    return names[policies[0]] if len(set(policies)) == 1 else "mixed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3train.tools.memory_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines: one per case, then the SDPA kernels")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per case after a warm-up step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_sweep: no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    with open(args.out, "w") as out:
        out.write(json.dumps({"sdpa_kernels": sdpa_kernels(device)}) + "\n")
        out.flush()
        for case in CASES:
            line = measure(case, device, args.repeats)
            out.write(json.dumps(line) + "\n")
            out.flush()
            ratio = line.get("measured_over_plan")
            said = f"measured/plan {ratio:.3f}" if ratio else line.get("skipped") or line["step"].get("error")
            print(f"memory_sweep: {line['case']} rows {line['rows']:,}: {said}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
