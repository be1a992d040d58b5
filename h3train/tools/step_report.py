"""Step efficiency and memory of h3train on the CPU, every figure a ratio or count from one run.

The model is a random 256-wide, 2-block H3 (4 heads x 64, SwiGLU 1024, 1 refiner block, text_dim
64) and the sample one FL2VA clip of 56 frames at 256x320 with both keyframes (17 latent frames of
8 x 10 rows, 2 keyframes, 2 x 93 stereo audio rows, a 352-row text prefix): 2,058 packed rows. Two
launches of this script by torchrun (gloo) measure it:

- `sp1`, one rank: `Trainer.train_step` against a bare diffusers step (the same model unwrapped,
  `model(**inputs)`, the same loss, `backward()`, `torch.optim.AdamW`; no FSDP, no clipping), both
  timed alternately (median of `--repeats`); saved activations at sp = 1; the data load.
- `sp2`, two ranks at sp = 2: steps timed; one counted stretch of `Trainer.fit` (`--counted` steps
  and everything between them) for collectives and host syncs; saved activations per rank; one
  checkpoint save.

How each figure is taken:

- saved activations: `h3train.tools.bench_memory.saved_activation_bytes`, bytes of every tensor storage
  an operation creates during the forward and loss that is still alive when the forward returns
  (what backward keeps), less the parameters and inputs. Measured with `activation_checkpointing`
  `none` and `full`.
- collectives: `h3train.parallel.collectives.count_collectives`, per step of the counted stretch:
  all-to-alls per transformer block, all-reduces (the grad norm's, which DTensor issues, included),
  FSDP2's all-gathers and reduce-scatters.
- host syncs: a CPU has no device->host sync to observe, so the training thread's calls that would be
  one on a GPU are counted (`h3train.tools.host_syncs.SyncCounter`): `item`, `tolist`, `cpu`, `numpy`,
  `float()`, `int()`, `bool()` of a tensor, except on tensors an earlier counted call already brought
  to the host. On a GPU the whole step runs under `torch.cuda.set_sync_debug_mode("error")` in
  `scripts/gpu_check.sh` instead.
- checkpoint save: what a save costs the training thread, over the median step time: the wall
  time `Trainer.save_checkpoint()` blocks, plus the time the next step waits for the save's copy
  to host memory before its update (`Checkpointer.wait_staged`, where the package has it). The
  process's first save (one-off set-up: threads, buffers, the checkpoint group's connections) and
  a second one are waited for at once (their background time, reported apart); then three saves,
  each followed by a timed step (which shares the cores with the background writes) and its wait
  (the commit): medians. DCP's planning time of each save (`Checkpointer.planning_s`: from the save's
  start to its first write) is reported as the later saves' median over the first's: save-plan
  caching reuses the first save's plan.
- data: a 480p 5 s FL2VA sample (124 frames at 480x864: 37 latent frames of 30 x 54, two keyframes,
  2 x 207 audio latents, a 1,024-token bfloat16 prompt of width 5120), written once, evicted from
  the page cache (`posix_fadvise(DONTNEED)`) before each read, read by `read_sample` (read,
  validation, packing); the sp = 1 step time over the median read. Noising it
  (`micro_batch_inputs`) is timed apart: the trainer does it on the prefetch thread.

Run from the repository: `.venv/bin/python scripts/step_report.py [--out report.json]`. The package
measured, and whose measures take the figures, is the one imported: another checkout's when it is put
first on the path (`PYTHONPATH=/other/checkout python scripts/step_report.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import h3train
from h3train.checkpoint.writer import PLAN_CACHING
from h3train.config import SyntheticDataConfig, load_config
from h3train.model.architecture import model_defaults
from h3train.objective import micro_batch_inputs
from h3train.parallel.collectives import count_collectives
from h3train.parallel.dims import free_port
from h3train.run.assemble import build_trainer
from h3train.tasks.synthetic import clip_data
from h3train.tools.bench_memory import MEMORY_CLIP, MEMORY_DIMS, saved_activation_bytes
from h3train.tools.host_syncs import SyncCounter

# The report's model and sample, `h3train.tools.bench_memory`'s, as config overrides (what differs from the
# defaults). 56 frames at 256x320 -> 17 latent frames of 16x20 (8 x 10 rows), both keyframes, 93
# stereo audio latents, 352 text rows (176 vision tokens): 352 + 19 * 80 + 186 = 2,058 rows.
MODEL = {k: v for k, v in MEMORY_DIMS.items() if model_defaults().get(k) != v}
SAMPLE = {
    k: v
    for k, v in dataclasses.asdict(clip_data(MEMORY_CLIP, num_samples=8)).items()
    if getattr(SyntheticDataConfig(), k) != v
}
PACKED_ROWS = 2058
# The data row's sample: 480p (16:9 at short edge 480 -> 480x864), 124 frames.
DATA_FRAMES, DATA_LATENT_HW, DATA_TEXT, DATA_TEXT_DIM = 124, (30, 54), 1024, 5120


def overrides(run_dir: Path, sp: int, steps: int, tables: bool = True) -> list[str]:
    model = [f"model.config.{k}={v}" for k, v in MODEL.items()]
    data = [f"data.synthetic.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in SAMPLE.items()]
    return [
        *model,
        *data,
        "task.name=fl2va",
        f"parallel.sp={sp}",
        f"parallel.adaln_tables={str(tables).lower()}",
        "train.grad_accum=1",
        f"train.steps={steps}",
        "checkpoint.every=0",
        "checkpoint.async_save=true",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"logging.dir={run_dir}",
        "logging.progress=false",
    ]


# -- measuring ---------------------------------------------------------------------------------


def activation_bytes(trainer, ti: Any) -> dict[str, int]:
    """Saved activations of this rank without and with full checkpointing, on the trainer's model unsharded.

    FSDP2's unsharded parameters would count as created in the forward, so the measured model is the
    same architecture (the trainer's dims, its SP group) without FSDP.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    from h3train.model.sp_forward import SequenceParallelH3
    from h3train.parallel.ulysses import SequenceParallel

    torch.manual_seed(0)
    transformer = MiniMaxH3Transformer3DModel(**trainer.parts.model_config)
    transformer.set_attention_backend("native")
    out: dict[str, int] = {}
    for mode in ("none", "full"):
        forward = SequenceParallelH3(transformer, SequenceParallel(trainer.ctx.sp_group), activation_checkpointing=mode)
        out[mode] = saved_activation_bytes(forward, ti)
    return out


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the two workers -----------------------------------------------------------------------------


def _trainer(run_dir: Path, sp: int, steps: int, tables: bool = True):
    # The checkout's tiny config (`scripts/step_report.py` runs from it).
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_fl2va.yaml"
    return build_trainer(load_config(config, overrides(run_dir, sp, steps, tables)))


def _inputs(trainer, step: int):
    sample = trainer.parts.source[0]
    return sample, micro_batch_inputs(trainer.cfg, sample, step, 0, trainer.parts.shared_negative).to(trainer.device)


def worker_sp1(run_dir: Path, repeats: int) -> dict[str, Any]:
    from diffusers import MiniMaxH3Transformer3DModel

    from h3train.objective import compute_loss

    trainer = _trainer(run_dir, 1, 1000)
    try:
        sample, ti = _inputs(trainer, 1)
        rows = int(ti.model_inputs["position_ids"].shape[0])
        dims = {k: v for k, v in trainer.parts.model_config.items()}
        torch.manual_seed(0)
        bare = MiniMaxH3Transformer3DModel(**dims)
        bare.set_attention_backend("native")
        o = trainer.cfg.optim
        hyper = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        adamw = torch.optim.AdamW(bare.parameters(), **hyper)
        # The same bare step with torch's fused AdamW kernel (h3train's default `optim.implementation`):
        # the ratio against it leaves out what the kernel alone gains.
        fused = torch.optim.AdamW(bare.parameters(), **hyper, fused=True)

        def bare_step(optimizer: torch.optim.Optimizer = adamw) -> None:
            optimizer.zero_grad(set_to_none=True)
            compute_loss(lambda **kw: bare(**kw, return_dict=False), ti).loss.backward()
            optimizer.step()

        step = [1]

        def h3_step() -> None:
            trainer.train_step(step[0])
            step[0] += 1

        assert rows == PACKED_ROWS, rows
        h3_step()
        bare_step()  # warm-up of all three
        bare_step(fused)
        # Alternated, and the ratio of each pair: load from other processes hits both alike.
        h3_times, bare_times, fused_times = [], [], []
        for _ in range(repeats):
            h3_times.append(_median_time(h3_step, 1))
            bare_times.append(_median_time(bare_step, 1))
            fused_times.append(_median_time(lambda: bare_step(fused), 1))
        h3, plain = statistics.median(h3_times), statistics.median(bare_times)
        ratio = statistics.median(a / b for a, b in zip(h3_times, bare_times))
        ratio_fused = statistics.median(a / b for a, b in zip(h3_times, fused_times))
        activations = activation_bytes(trainer, ti)
        load, noise = data_load_times(run_dir, trainer.cfg)
    finally:
        trainer.close()
    return {
        "rows": rows,
        "step_s": h3,
        "bare_step_s": plain,
        "step_ratio": ratio,
        "step_ratio_fused_bare": ratio_fused,
        "activation_bytes": activations["none"],
        "activation_bytes_checkpointed": activations["full"],
        "activations": activations,
        "load_s": load,
        "noise_s": noise,
    }


def worker_sp2(run_dir: Path, repeats: int, counted: int, tables: bool = True) -> dict[str, Any]:
    trainer = _trainer(run_dir, 2, 1000, tables)
    rank = dist.get_rank()
    try:
        _, ti = _inputs(trainer, 1)

        def h3_step() -> None:
            trainer.train_step(trainer.step + 1)
            trainer.step += 1

        h3_step()  # warm-up
        step_s = _median_time(h3_step, repeats)
        activations = activation_bytes(trainer, ti)

        # One counted stretch of the loop, as `fit` runs it.
        first = trainer.step
        trainer.cfg.train.steps = first + counted
        syncs = SyncCounter()
        try:
            with count_collectives(functional=True) as counts:
                syncs.active = True
                trainer.fit()
        finally:
            syncs.active = False
            syncs.restore()
        fsdp = counts.fsdp()
        collectives = {
            "all_to_all": counts.kind("all_to_all"),
            "all_reduce": counts.kind("all_reduce"),
            "all_gather": counts.kind("all_gather"),
            "fsdp_all_gather": fsdp["all_gather"],
            "fsdp_reduce_scatter": fsdp["reduce_scatter"],
            "by_entry": dict(counts),
        }
        assert trainer.step == first + counted, (trainer.step, first, counted)

        # Saves as the module docstring describes them; each at a step of its own.
        ckpt = trainer.parts.checkpointer
        waiter = next((getattr(ckpt, n) for n in ("wait", "finish", "join") if hasattr(ckpt, n)), None)
        waiter = waiter if callable(waiter) else (lambda: None)
        staged_waits: list[float] = []
        if hasattr(ckpt, "wait_staged"):
            wait_staged = ckpt.wait_staged

            def timed_wait_staged() -> None:
                start = time.perf_counter()
                wait_staged()
                staged_waits.append(time.perf_counter() - start)

            ckpt.wait_staged = timed_wait_staged

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        dist.barrier()
        first_blocking = timed(trainer.save_checkpoint)
        first_background = timed(waiter)
        h3_step()
        dist.barrier()
        timed(trainer.save_checkpoint)
        background = timed(waiter)
        saves: list[tuple[float, float, float, float]] = []
        for _ in range(3):
            h3_step()
            dist.barrier()
            blocking = timed(trainer.save_checkpoint)
            staged_waits.clear()
            after = timed(h3_step)
            saves.append((blocking, sum(staged_waits), after, timed(waiter)))
        blocking, staged_wait, step_after_save, commit = (statistics.median(col) for col in zip(*saves))
    finally:
        trainer.close()
    return {
        "rank": rank,
        "step_s": step_s,
        "activation_bytes": activations["none"],
        "activation_bytes_checkpointed": activations["full"],
        "activations": activations,
        "counted_steps": counted,
        "collectives": collectives,
        "syncs": dict(syncs.calls),
        "save_blocking_s": blocking,
        "save_staged_wait_s": staged_wait,
        "step_after_save_s": step_after_save,
        "save_commit_s": commit,
        "save_background_s": background,
        "save_first_blocking_s": first_blocking,
        "save_first_background_s": first_background,
        "save_planning_s": list(getattr(ckpt, "planning_s", [])),
        "blocks": MODEL["num_layers"],
        "tables": tables,
    }


def _planning_rows(sp2: dict) -> list[tuple[str, str, str, str]]:
    """DCP's planning time of the report's later saves against the process's first (save-plan caching)."""
    planning = sp2.get("save_planning_s") or []
    if len(planning) < 2:
        return []
    first, later = planning[0], statistics.median(planning[1:])
    return [
        (
            "  DCP planning, later saves / the first",
            f"{later / first:.3f}",
            "< 1",
            f"{later * 1e3:.1f} / {first * 1e3:.1f} ms (median of {len(planning) - 1} later saves), sp=2, save-plan "
            f"caching {'on' if PLAN_CACHING else 'not in this torch'}",
        )
    ]


def data_load_times(run_dir: Path, cfg) -> tuple[float, float]:
    """Median cold-cache `read_sample` of the 480p 5 s sample, and the median time to noise it."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    from h3train.data.sample_file import CachedSample, read_sample, write_sample

    g = torch.Generator().manual_seed(0)
    frames = video_latent_num_frames(DATA_FRAMES, 17, 5)
    h, w = DATA_LATENT_HW
    audio = audio_latent_num_frames(DATA_FRAMES)
    tags = torch.ones(DATA_TEXT, dtype=torch.long)
    tags[8 : 8 + 2 * 400] = 0  # the two keyframes' vision blocks
    sample = CachedSample(
        sample_id="480p_5s",
        task="fl2va",
        num_frames=DATA_FRAMES,
        video_latents=torch.randn(24, frames, h, w, generator=g),
        audio_latents=torch.randn(2, 32, audio, generator=g),
        prompt_embeds=torch.randn(DATA_TEXT, DATA_TEXT_DIM, generator=g).bfloat16(),
        text_token_tags=tags,
        negative_prompt_embeds=torch.randn(3, DATA_TEXT_DIM, generator=g).bfloat16(),
        negative_text_token_tags=torch.ones(3, dtype=torch.long),
        keyframe_anchors=("first", "last"),
        keyframes=tuple(torch.randn(24, 1, h, w, generator=g) for _ in range(2)),
    )
    path = run_dir / "data" / "480p_5s.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_sample(path, sample)
    loads, packed = [], None
    for _ in range(5):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        start = time.perf_counter()
        packed = read_sample(path)
        loads.append(time.perf_counter() - start)
    noise = _median_time(lambda: micro_batch_inputs(cfg, packed, 1, 0), 5)
    return statistics.median(loads), noise


# -- the report ----------------------------------------------------------------------------------


def _launch(part: str, nproc: int, tmp: Path, args: argparse.Namespace, tables: str = "true") -> dict[str, Any]:
    out = tmp / f"{part}_{tables}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", "-m", "h3train.tools.step_report", "--worker", part, "--part-out", str(out),
        "--repeats", str(args.repeats), "--counted", str(args.counted), "--run-dir", str(tmp / f"{part}_{tables}"),
        "--tables", tables,
    ]  # fmt: skip
    # The workers import the package this process measures, wherever it was found.
    package = str(Path(h3train.__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"step_report: the {part} run failed (exit {done.returncode})")
    return json.loads(out.read_text())


def _per_step(sp2: dict[str, Any]) -> tuple[dict[str, float], float, str]:
    """The counted stretch's collectives per step, its host syncs per step and their detail."""
    n = sp2["counted_steps"]
    coll = {k: v / n for k, v in sp2["collectives"].items() if k != "by_entry"}
    syncs = sum(sp2["syncs"].values()) / n
    detail = ", ".join(f"{k} x{v / n:g}" for k, v in sorted(sp2["syncs"].items())) or "none"
    return coll, syncs, detail


def build_rows(
    sp1: dict[str, Any], sp2: dict[str, Any], sp2_off: dict[str, Any] | None = None
) -> list[tuple[str, str, str, str]]:
    """(measure, value, goal, detail) per row of the report; `sp2` with the AdaLN tables served, `sp2_off`
    (when given) the same run with `parallel.adaln_tables=false`."""
    n = sp2["counted_steps"]
    coll = {k: v / n for k, v in sp2["collectives"].items() if k != "by_entry"}
    syncs = sum(sp2["syncs"].values()) / n
    sync_detail = ", ".join(f"{k} x{v / n:g}" for k, v in sorted(sp2["syncs"].items())) or "none"
    fsdp = coll["fsdp_all_gather"] + coll["fsdp_reduce_scatter"]
    act = sp2["activation_bytes"] / sp1["activation_bytes"]
    act_ck = sp2["activation_bytes_checkpointed"] / sp1["activation_bytes_checkpointed"]
    save = (sp2["save_blocking_s"] + sp2["save_staged_wait_s"]) / sp2["step_s"]
    mib = 2**20
    return [
        (
            "step / bare diffusers forward+backward+AdamW, sp=1",
            f"{sp1['step_ratio']:.3f}",
            "<= 1.03",
            f"median of paired ratios; medians {sp1['step_s'] * 1e3:.0f} / {sp1['bare_step_s'] * 1e3:.0f} ms, "
            f"{sp1['rows']:,} rows, 1 rank",
        ),
        (
            "  the same, the bare step with fused AdamW",
            f"{sp1['step_ratio_fused_bare']:.3f}" if "step_ratio_fused_bare" in sp1 else "-",
            "",
            "torch.optim.AdamW(fused=True) in the bare step too: what is left besides the optimizer kernel",
        ),
        (
            "saved activations per rank, sp=2 / sp=1",
            f"{act:.3f}",
            "<= 0.54",
            f"{sp2['activation_bytes'] / mib:.1f} / {sp1['activation_bytes'] / mib:.1f} MiB",
        ),
        (
            "  with gradient checkpointing (full)",
            f"{act_ck:.3f}",
            "<= 0.58",
            f"{sp2['activation_bytes_checkpointed'] / mib:.1f} / {sp1['activation_bytes_checkpointed'] / mib:.1f} MiB",
        ),
        *_table_rows(sp2, sp2_off),
        (
            "device->host syncs per step, tables on",
            f"{syncs:g}",
            "1",
            f"CPU stand-in (calls that sync on a GPU): {sync_detail}",
        ),
        (
            "extra all-reduces per step",
            f"{coll['all_reduce']:g}",
            "2 (grad norm + 1)",
            "all-reduces in the loop, the grad norm's included; FSDP2 reduces gradients by reduce-scatter",
        ),
        (
            "checkpoint save blocking / step",
            f"{save:.3f}",
            "<= 0.05",
            f"{sp2['save_blocking_s'] * 1e3:.0f} ms blocking + {sp2['save_staged_wait_s'] * 1e3:.0f} ms waiting "
            f"for the copy before the next update / {sp2['step_s'] * 1e3:.0f} ms step, sp=2; the step after a save "
            f"{sp2['step_after_save_s'] * 1e3:.0f} ms, the commit after it {sp2['save_commit_s'] * 1e3:.0f} ms; "
            f"+{sp2['save_background_s'] * 1e3:.0f} ms in the background; the process's first save "
            f"{sp2['save_first_blocking_s'] * 1e3:.0f} ms blocking, +{sp2['save_first_background_s'] * 1e3:.0f} ms",
        ),
        *_planning_rows(sp2),
        (
            "FSDP2 collectives per step",
            f"{fsdp:g}",
            "about half of 26",
            f"{coll['fsdp_all_gather']:g} all-gathers + {coll['fsdp_reduce_scatter']:g} reduce-scatters, 2 ranks "
            f"(the SP output gather apart: {coll['all_gather'] - coll['fsdp_all_gather']:g})",
        ),
        (
            "data: step / load of a 480p 5 s sample, cold cache",
            f"{sp1['step_s'] / sp1['load_s']:.1f}",
            ">= 20",
            f"{sp1['step_s'] * 1e3:.0f} ms sp=1 step / {sp1['load_s'] * 1e3:.1f} ms read_sample; noising it "
            f"{sp1['noise_s'] * 1e3:.1f} ms",
        ),
    ]


def _table_rows(sp2: dict[str, Any], sp2_off: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """The all-to-alls per block per step with the tables on (and off), and the syncs with them off."""
    coll, _, _ = _per_step(sp2)
    blocks = sp2["blocks"]
    rows = [
        (
            "all-to-alls per block per step, tables on",
            f"{coll['all_to_all'] / blocks:g}",
            "4 + 2 / blocks",
            f"{coll['all_to_all']:g} per step over {blocks} blocks, sp=2: Ulysses' 4 a block and the tables' 2 a "
            "step (one exchange each way for every block)",
        )
    ]
    if sp2_off is not None:
        off, syncs, detail = _per_step(sp2_off)
        rows += [
            (
                "all-to-alls per block per step, tables off",
                f"{off['all_to_all'] / blocks:g}",
                "<= 4",
                f"{off['all_to_all']:g} per step over {blocks} blocks, sp=2",
            ),
            ("device->host syncs per step, tables off", f"{syncs:g}", "1", f"CPU stand-in: {detail}"),
        ]
    return rows


def format_rows(rows: list[tuple[str, str, str, str]], package: str) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"h3train step report (package {package})", f"{'measure':<{width}}  {'value':>8}  {'goal':<18} detail"]
    lines += [f"{m:<{width}}  {v:>8}  {g:<18} {d}" for m, v, g, d in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps (median)")
    parser.add_argument("--counted", type=int, default=2, help="steps of the counted fit stretch")
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument("--worker", choices=("sp1", "sp2"), help=argparse.SUPPRESS)
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--tables", default="true", choices=("true", "false"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_dir = Path(args.run_dir)
        part = (
            worker_sp1(run_dir, args.repeats)
            if args.worker == "sp1"
            else worker_sp2(run_dir, args.repeats, args.counted, args.tables == "true")
        )
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.part_out).write_text(json.dumps(part))
        return 0

    package = str(Path(h3train.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as tmp:
        sp1 = _launch("sp1", 1, Path(tmp), args)
        sp2 = _launch("sp2", 2, Path(tmp), args)
        sp2_off = _launch("sp2", 2, Path(tmp), args, tables="false")
    rows = build_rows(sp1, sp2, sp2_off)
    print(format_rows(rows, package), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"package": package, "sp1": sp1, "sp2": sp2, "sp2_tables_off": sp2_off, "rows": rows}, indent=2)
            + "\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
