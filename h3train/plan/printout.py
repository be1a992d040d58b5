"""The plan as `h3train check` prints it: one line per memory term, the verdict, and the notes that go with it."""

from __future__ import annotations

from .arithmetic import GIB, MemoryPlan


def _gib(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size / 10:
            return f"{n / size:8.2f} {unit}"
    return f"{n:8d} B  "


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _block_grad_note(plan: MemoryPlan) -> str:
    """What the unsharded block gradient's line holds: which parameters, and FSDP2's float32 copy of it."""
    notes = ["trainable only"] if plan.lora else ["no AdaLN projection"] if plan.local_adaln else []
    if plan.reduce_buffer_bytes:
        notes.append(f"with its float32 reduce-scatter buffer, {_gib(plan.reduce_buffer_bytes).strip()}")
    return f"  ({'; '.join(notes)})" if notes else ""


def _refiner_note(plan: MemoryPlan) -> str:
    """The activation line's note on the text refiner's share (`refiner_activation_bytes`), or why there is
    little to keep when only the output projections train."""
    if plan.lora is not None and plan.lora.heads_only:
        return "  (only the output projections train: no gradient reaches the blocks or the text refiner)"
    if not plan.text_rows:
        return ""
    if not plan.refiner_activation_bytes:
        return f"  (text refiner over {plan.text_rows:,} text rows: keeps nothing, no gradient reaches it)"
    return (
        f"  (text refiner {_gib(plan.refiner_activation_bytes).strip()} of it: {plan.text_rows:,} text rows "
        "on every SP rank)"
    )


def _grads_note(plan: MemoryPlan) -> str:
    """The gradient line's note when the total counts only part of them (`MemoryPlan.peak_grads_bytes`)."""
    if plan.peak_grads_bytes is None or plan.cpu_offload:
        return ""
    return f"  (grad_accum 1: {_gib(plan.peak_grads_bytes).strip()} of them in the total, beside the backward's peak)"


def policy_counts(policies: tuple[str, ...]) -> str:
    """`4 blocks none` or `2 blocks full, 3 selective, 45 none`: how many blocks take each policy."""
    parts = [(p, policies.count(p)) for p in ("full", "selective", "none") if policies.count(p)]
    if not parts:
        return "no blocks"
    head, *rest = parts
    noun = "block" if head[1] == 1 else "blocks"
    return ", ".join([f"{head[1]} {noun} {head[0]}", *(f"{n} {p}" for p, n in rest)])


def checkpointing_line(plan: MemoryPlan) -> str:
    """What the blocks recompute and what it costs: `auto: 12 blocks full, 38 none (recomputes 19.4 % of the
    forward's FLOPs)`."""
    how = "auto: " if plan.auto else ""
    return f"{how}{policy_counts(plan.policies)} (recomputes {100 * plan.recompute_share:.1f} % of the forward's FLOPs)"


def fixes(plan: MemoryPlan) -> str:
    """What makes a plan that does not fit fit, the cheapest first: a bound on the rows when one fits.

    Only what the run does not do already: no recompute advice when every block recomputes (`full`, or
    `auto` that chose it for every block), no offload advice when offloaded. A pack budget is advised only
    when it holds the longest sample (`MemoryPlan.longest_sample_rows`); a smaller one would refuse it.
    """
    bound = ""
    if plan.longest_fit and not plan.packed:
        bound = f"set data.max_rows={plan.longest_fit} (drops longer samples)"
    elif plan.longest_fit and plan.longest_fit >= plan.longest_sample_rows:
        unknown = " if no sample packs to more" if not plan.longest_sample_rows else ""
        bound = f"set data.pack={plan.longest_fit} (rows per micro-batch){unknown}"
    elif plan.longest_fit:
        # No pack that fits holds the longest sample: only dropping it (and what is as long) makes one.
        bound = (
            f"set data.max_rows={plan.longest_fit} (drops the samples over it: the longest packs to "
            f"{plan.longest_sample_rows:,} rows, more than fits) with data.pack={plan.longest_fit}"
        )
    others = ["shard over more ranks (dp_shard)", "raise sp"]
    if not all(p == "full" for p in plan.policies) or not plan.policies:
        others.append("set model.activation_checkpointing=full")
    if not plan.cpu_offload:
        others.append("set parallel.cpu_offload=true")
    return ", ".join([*([bound] if bound else []), *others]) + ", or shorten the clips"


def refused_sample(plan: MemoryPlan) -> str:
    """The note that a packed plan's longest sample is longer than a pack (`data.pack_oversize=refuse`: the
    plan is of the budget, and the run refuses that sample before training); empty otherwise."""
    if not plan.packed or plan.longest_sample_rows <= plan.rows:
        return ""
    return (
        f"; but the longest sample packs to {plan.longest_sample_rows:,} rows, more than data.pack={plan.rows}: "
        f"the run refuses it (raise data.pack to {plan.longest_sample_rows}, bound the samples with data.max_rows, "
        "or set data.pack_oversize=alone)"
    )


def verdict(plan: MemoryPlan) -> str:
    """`fits: yes, ...` or `fits: NO, ...` with the fixes, over the run's peak (`MemoryPlan.peak_bytes`)."""
    if plan.fits:
        return f"fits: yes, {plan.headroom_bytes / GIB:.1f} GiB headroom{refused_sample(plan)}"
    return f"fits: NO, {-plan.headroom_bytes / GIB:.1f} GiB over: {fixes(plan)}{refused_sample(plan)}"


def origin_words(origin: str) -> str:
    """`rows_origin` as printed: a pack budget's note ("...; longest sample: <where>") names the longest
    sample once when `<where>` says it already ("longest sample in the dataset index", "longest released
    clip")."""
    head, said, where = origin.partition("longest sample: ")
    return head + where if said and where.startswith("longest ") else origin


def summary(plan: MemoryPlan) -> str:
    """The plan in one line: the verdict word, the peak of the device, what the peak is."""
    at = "validation / rendering" if plan.evaluation_bytes > plan.total_bytes else "training step"
    word = "yes" if plan.fits else "NO"
    return (
        f"fits: {word}, {plan.peak_bytes / GIB:.2f} GiB of {plan.device_gib} GiB per rank at the "
        f"{at}, {plan.rows:,} rows; recompute {checkpointing_line(plan)}"
    )


def _evaluation_line(plan: MemoryPlan) -> str:
    e = plan.evaluation
    assert e is not None
    vaes = f", VAEs {_gib(e.components_bytes).strip()} on it to decode" if e.components_bytes else ""
    peak = "the peak; " if plan.evaluation_bytes > plan.total_bytes else ""
    return (
        f"  between steps (no gradients)  {_gib(plan.evaluation_bytes)}  ({peak}{e.what}: no-grad forward over "
        f"{e.rows:,} rows, {e.local_rows:,} per rank, {_gib(e.activation_bytes).strip()}{vaes})"
    )


def _host_lines(plan: MemoryPlan) -> list[str]:
    """Host memory per rank (offloaded state, checkpoint staging, the VAEs) and per node."""
    if plan.staging_bytes:
        staging = f"checkpoint staging {_gib(plan.staging_bytes).strip()} (checkpoint.async_save: the rank's shards)"
    else:
        staging = "checkpoint staging none (checkpoint.async_save off: saves copy tensor by tensor)"
    parts = [staging]
    if plan.cpu_offload:
        parts.append(f"offloaded state {_gib(plan.host_bytes).strip()} (parallel.cpu_offload)")
    if plan.render_host_bytes:
        parts.append(f"VAEs {_gib(plan.render_host_bytes).strip()} (validation.samples)")
    lines = [f"host          {_gib(plan.host_per_rank_bytes).strip()} per rank: {', '.join(parts)}"]
    if plan.ranks_per_node:
        lines.append(
            f"              {_gib(plan.host_per_rank_bytes * plan.ranks_per_node).strip()} per node of "
            f"{plan.ranks_per_node} ranks, beside the processes, the OS, the page cache and data loading"
        )
    return lines


def format_plan(plan: MemoryPlan) -> str:
    """A readable multi-line table of `plan`, one memory line per term, ending in the verdict."""
    p = plan.params
    shard = plan.shard_size
    ckpt = checkpointing_line(plan)
    where = "  (host: cpu_offload)" if plan.cpu_offload else ""
    lines = [
        f"mesh          dp_replicate={plan.dp_replicate} dp_shard={plan.dp_shard} sp={plan.sp} "
        f"({plan.world_size} ranks, parameters sharded {shard}-way)",
        f"parameters    {p.total:,} total ({_count(p.total)}); {plan.params_per_rank:,} per rank",
        f"              {p.num_layers} blocks x {p.block:,} (AdaLN {p.block_adaln:,}), "
        f"{p.num_refiner_layers} refiner x {p.refiner_block:,}, other {p.other:,}",
        f"sequence      {plan.rows:,} rows{f' ({origin_words(plan.rows_origin)})' if plan.rows_origin else ''}, "
        f"{plan.local_rows:,} per rank",
        f"batch         {plan.global_batch:,} {'packs' if plan.packed else 'samples'} per optimizer step "
        f"(dp {plan.dp_replicate * plan.dp_shard} x grad_accum {plan.grad_accum}), "
        f"{plan.dp_replicate * plan.dp_shard} per micro-batch"
        + (f"; each pack up to {plan.rows:,} rows of samples (data.pack)" if plan.packed else ""),
        f"compute       {plan.dtype}, {'fused' if plan.fused_norm else 'composite'} RMSNorm",
        f"recompute     {ckpt}",
    ]
    lora = plan.lora
    wdt = "bf16" if plan.optimizer == "adamw_bf16" else "fp32"
    moments = {"adamw": "fp32", "adamw8bit": "8-bit", "adamw4bit": "4-bit", "adamw_bf16": "bf16"}[plan.optimizer]
    base = "bf16 (fp32 isl.)" if plan.base_quant == "none" else f"{plan.base_quant} (fp32 isl.)"
    per_weight = "2 B/param" if plan.base_quant == "none" else "matrices 1 B/param, vectors 2 B"
    if lora is None:
        isl = "  (fp32 islands 4 B)" if wdt == "bf16" else ""
        lines += [
            "memory per rank",
            f"  master weights {wdt}           {_gib(plan.master_weights_bytes)}{isl}{where}",
            f"  gradients {wdt}                {_gib(plan.grads_bytes)}{isl}{where}{_grads_note(plan)}",
            f"  AdamW moments {moments:<5}           {_gib(plan.optimizer_bytes)}  ({plan.optimizer}){where}",
        ]
    else:
        trainable_weights = plan.grads_bytes
        lines += [
            f"{lora.kind:<14}rank {lora.rank} on {lora.adapted_layers} Linear layers: {lora.adapters:,} adapter "
            f"parameters ({_count(lora.adapters)}), {lora.train_modules:,} in train_modules; base frozen",
            "memory per rank",
            f"  frozen base {base:<18}{_gib(plan.master_weights_bytes - trainable_weights)}  "
            f"({per_weight}, {lora.frozen_fp32:,} island params 4 B){where}",
            f"  trainable weights {wdt}        {_gib(trainable_weights)}  (adapters + train_modules){where}",
            f"  trainable gradients {wdt}      {_gib(plan.grads_bytes)}{where}{_grads_note(plan)}",
            f"  AdamW of the trainable        {_gib(plan.optimizer_bytes)}  ({plan.optimizer}, {moments}){where}",
        ]
    if plan.ema_bytes:
        lines.append(f"  EMA shadows fp32              {_gib(plan.ema_bytes)}{where}")
    lines += [
        f"  2 unsharded blocks {plan.dtype:<11}{_gib(plan.unsharded_params_bytes)}  (running + prefetched"
        + ("; AdaLN projections stay sharded: parallel.adaln_tables)" if plan.local_adaln else ")"),
        f"  unsharded block grad {plan.dtype:<9}{_gib(plan.unsharded_grads_bytes)}" + _block_grad_note(plan),
        f"  activations                   {_gib(plan.activation_bytes)}" + _refiner_note(plan),
        f"  reserve (CUDA, NCCL, frag.)   {_gib(plan.reserve_bytes)}",
        f"  total                         {_gib(plan.total_bytes)} of {plan.device_gib} GiB"
        + (f" on the device; {_gib(plan.host_bytes).strip()} in host memory" if plan.cpu_offload else ""),
    ]
    if plan.evaluation is not None:
        lines.append(_evaluation_line(plan))
    if plan.render_line:
        lines.append(plan.render_line)
    lines.append(verdict(plan))
    lines += _host_lines(plan)
    if plan.checkpoint_bytes:
        lines.append(
            f"checkpoint    {_gib(plan.checkpoint_bytes).strip()} on disk each, all ranks together ({wdt} weights, "
            f"{moments} AdamW moments, any EMA); checkpoint.dir holds keep_last + 1 while a save commits"
        )
    if plan.retention_line:
        lines.append(plan.retention_line)
    if plan.fit_lines:
        lines.append(f"longest packed sequence that fits ({plan.device_gib} GiB devices, this LoRA):")
        lines.extend(plan.fit_lines)
    return "\n".join(lines)
