"""What `h3train bench` prints and writes, and its exit status."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ...infra.atomic import atomic_write_text
from ...tasks.synthetic import Clip
from .case_setup import FULL_CLIP, REDUCED_CLIP
from .cases import DEFAULT_REPEATS, GIB, BenchReport, run_bench
from .parity import REFERENCE_BACKEND


def _fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def format_report(report: BenchReport) -> str:
    """The readable table `h3train bench` prints."""
    lay = report.layout
    setup = report.step_setup
    lines = [
        f"h3train bench: {report.device}, {report.mode} width, {report.model['num_layers']} blocks "
        f"(+{report.model['num_refiner_layers']} refiner), {report.parameters:,} parameters",
        f"step          {setup.get('what', 'Trainer.forward_backward + Trainer.update')}",
        f"timing        {setup.get('timing', 'n/a')}",
        f"precision     {report.precision}",
        f"checkpointing {report.gradient_checkpointing}",
        f"layout        fl2va {lay['height']}x{lay['width']} x {lay['frames']} frames -> {lay['seq_len']:,} rows = "
        f"{lay['text']:,} text + {lay['keyframe']:,} keyframe + {lay['audio']:,} audio + "
        f"{lay['target_video']:,} video; {lay['timesteps']} distinct timesteps",
        f"model FLOPs   {report.flops['total']:.4g} per step (fwd + bwd, matmuls; see h3train/tools/bench/flops.py)",
        f"peak          {_fmt(report.peak_tflops, '.0f')} TFLOP/s bf16 ({report.peak_tflops_source})",
        f"plan memory   {report.plan_memory_bytes / GIB:.2f} GiB at the step's peak "
        f"({report.plan.get('peak_phase', '')}; weights, gradients, AdamW state, activations; no reserve) "
        f"of {report.plan.get('device_memory_gib', 0):.1f} GiB",
        "",
        f"{'backend':<8} {'kernel':<14} {'fwd+bwd s':>9} {'update s':>9} {'step s':>9} {'tokens/s':>11} "
        f"{'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'loss':>10}  sync (read-back syncs)",
    ]
    for b in report.backends:
        if b.status != "ok":
            lines.append(f"{b.name:<8} {b.backend:<14} {b.status}: {b.error}")
            continue
        mem = None if b.peak_memory_bytes is None else b.peak_memory_bytes / GIB
        mfu = "n/a" if b.mfu is None else f"{100 * b.mfu:.1f}%"
        back = "" if b.read_back_syncs is None else f" ({b.read_back_syncs})"
        lines.append(
            f"{b.name:<8} {b.backend:<14} {_fmt(b.forward_backward_s, '9.4f'):>9} {_fmt(b.update_s, '9.4f'):>9} "
            f"{b.step_time_s:>9.4f} {b.tokens_per_s:>11,.0f} {b.achieved_tflops:>9.2f} {mfu:>7} "
            f"{_fmt(mem, '.2f'):>9} {b.loss:>10.5f}  {b.sync_check}{back}"
        )
        if b.sync_error:
            lines.append(f"  host-device sync during {b.sync_error.phase}: {b.sync_error.message}")
            lines.extend(f"    at {frame}" for frame in b.sync_error.frames)
    if report.parity:
        m = report.parity_model
        lines.append("")
        lines.append(
            f"gradient parity on hidden {m['hidden_size']}, {m['heads']} x {m['head_dim']} heads, "
            f"{m['blocks']} blocks, {m['rows']:,} rows, {m['dtype']} ({m['why']}): each backend's error "
            f"against the {m['reference']}, in units of {REFERENCE_BACKEND}'s, max over parameters"
        )
        for p in report.parity:
            verdict = "ok" if p.ok else "FAILED"
            if p.error:
                lines.append(f"  {p.backend:<8} {p.error}: {verdict}")
                continue
            lines.append(
                f"  {p.backend:<8} ratio {p.ratio:.3f} ({p.worst_parameter}), gate {p.gate:g}: {verdict}; "
                f"max relative L2 {p.max_rel_l2:.2e} ({p.max_rel_l2_parameter}), all {p.global_rel_l2:.2e}"
            )
    for note in report.notes:
        lines.append(f"note: {note}")
    if not report.backends and "fits" in report.plan:
        lines.append(f"result: plan only; {'fits' if report.plan['fits'] else 'does NOT fit'}")
    else:
        lines.append(f"result: {'ok' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def report_from_args(args: argparse.Namespace) -> BenchReport:
    """`run_bench` with the options of `h3train bench`."""
    base = REDUCED_CLIP if args.reduced or not (torch.cuda.is_available() or args.plan_only) else FULL_CLIP
    text_len = args.text_len or base.text_len
    clip = Clip(
        frames=args.frames or base.frames,
        height=args.height or base.height,
        width=args.width or base.width,
        text_len=text_len,
        vision_tokens=text_len // 2,
    )
    return run_bench(
        reduced=args.reduced,
        layers=args.layers,
        backends=args.backends,
        peak_tflops=args.peak_tflops,
        gradient_checkpointing=args.gradient_checkpointing,
        device_memory_gib=args.device_memory_gib,
        plan_only=args.plan_only,
        parity_tolerance=args.parity_tol,
        clip=clip,
        seed=args.seed,
        repeats=DEFAULT_REPEATS if args.repeats is None else args.repeats,
    )


def write_json(out: Path, data: dict[str, Any]) -> None:
    """`data` as the bench's JSON file at `out` (atomically), and the line that says where."""
    atomic_write_text(out, json.dumps(data, indent=2, allow_nan=True) + "\n")
    print(f"wrote {out}")


def bench_command(args: argparse.Namespace) -> int:
    """`h3train bench`: 0 when every backend ran without a sync and parity holds, 1 otherwise."""
    report = report_from_args(args)
    print(format_report(report), flush=True)
    if args.out:
        write_json(Path(args.out), report.to_json())
    if args.plan_only:
        return 0 if report.plan.get("fits") else 1
    return 0 if report.ok else 1
