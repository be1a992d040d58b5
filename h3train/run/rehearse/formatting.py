"""The rehearsal as `h3train check --rehearse` prints it: each tracked category beside its plan row."""

from __future__ import annotations

from ...plan import GIB, MemoryPlan
from ...plan.printout import origin_words
from . import BATCH, CATEGORIES, EMA, GRADS, OPTIM, OTHER, UNSHARDED, WEIGHTS, Rehearsal, plan_rows
from .memtrack import TRANSIENT

_PLAN_ROW = {
    WEIGHTS: "master weights (LoRA: frozen base + trainable)",
    GRADS: "gradients",
    OPTIM: "AdamW moments",
    EMA: "EMA shadows",
    UNSHARDED: "2 unsharded blocks",
    TRANSIENT: "activations + unsharded block grad",
    BATCH: "(not planned)",
    OTHER: "(not planned)",
}


# Below this many parameters (the stand-in has thousands, the released model billions) a step's memory is a
# few MiB, where what the plan leaves out (allocator blocks, kernel workspaces, small buffers) is no
# longer small beside what it counts: a verdict off by more than `TOLERANCE` there says little of a real run.
TINY_MODEL_PARAMS = 100_000_000


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def format_rehearsal(r: Rehearsal) -> str:
    """The rehearsal's table beside the plan's rows, its notes, its wall time and a one-line verdict."""
    m = r.mesh
    planned = plan_rows(r.plan)
    lines = [
        f"rehearsal     {r.world_size} ranks on a fake process group (rank 0's share), FakeTensorMode; "
        f"mesh dp_replicate={m.dp_replicate} dp_shard={m.dp_shard} sp={m.sp}",
        f"              {r.num_layers} blocks; {r.rows:,} rows ({r.text_rows:,} text; {origin_words(r.rows_origin)}); "
        f"{r.micro_batches} of the step's {r.grad_accum} micro-batches rehearsed",
        "  per rank                                  plan   rehearsed peak    at the step's peak   plan row",
    ]
    for c in CATEGORIES:
        if not (planned[c] or r.category_peaks[c] or r.at_peak[c]):
            continue
        lines.append(
            f"  {c:<30} {_gib(planned[c])}     {_gib(r.category_peaks[c])}     {_gib(r.at_peak[c])}   {_PLAN_ROW[c]}"
        )
    lines.append(
        f"  {'total (reserve aside)':<30} {_gib(r.planned_bytes)}     {_gib(r.device_peak_bytes)}"
        f"{'':24}peak during: {r.peak_phase}"
    )
    if r.save is not None:
        s = r.save
        lines.append(
            f"checkpoint    DCP save plan over {s.world_size} ranks (DefaultSavePlanner, nothing written): "
            f"{s.files} .distcp files + .metadata; {s.tensors:,} tensors, {s.objects} other entries; per rank "
            f"{min(s.items_per_rank):,}-{max(s.items_per_rank):,} items, {_gib(min(s.bytes_per_rank)).strip()}-"
            f"{_gib(max(s.bytes_per_rank)).strip()}; {_gib(s.total_bytes).strip()} in all "
            f"(plan {_gib(r.plan.checkpoint_bytes).strip()})"
        )
    lines += [f"not run as on a GPU: {note}" for note in r.notes]
    lines.append(
        f"rehearsal     {r.wall_s:.1f} s wall (" + ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items()) + ")"
    )
    err = r.plan_error * 100
    device = r.device_peak_bytes + r.plan.reserve_bytes
    fits = device <= r.plan.device_bytes
    lines.append(
        f"verdict: {'fits' if fits else 'does NOT fit'}: the step peaks at {r.device_peak_bytes / GIB:.2f} GiB "
        "per rank, "
        f"{device / GIB:.2f} GiB with the {r.plan.reserve_bytes / GIB:.0f} GiB reserve, of "
        f"{r.plan.device_gib} GiB; the plan is {err:+.1f} % of it "
        + ("(within 10 %)" if r.agrees else "(OFF by more than 10 %)" + tiny_model_note(r.plan))
    )
    return "\n".join(lines)


def tiny_model_note(plan: MemoryPlan) -> str:
    """Why a disagreement on a tiny model (under `TINY_MODEL_PARAMS`) is no verdict on the plan; empty otherwise."""
    total = plan.params.total
    if total >= TINY_MODEL_PARAMS:
        return ""
    return (
        f"; a model of {total:,} parameters is tiny: fixed overheads the plan leaves out (allocator blocks, "
        "workspaces, small buffers) dominate its few MiB, so rehearse a real size to judge the plan"
    )
