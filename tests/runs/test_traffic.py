"""Every byte of a step counted: the collectives a real step issues equal `plan.traffic.step_traffic`'s count.

Four gloo ranks train steps 1 and 2 of the tiny model through `build_trainer` + `Trainer.train_step` with
CFG on (a no-grad negative forward before each micro-batch's), two micro-batches a step and a dataset
of every sample task, so the ranks run different sequence lengths and different counts of timesteps.
Every collective call of the step is recorded (its kind, group and tensor bytes: `count_collectives`) and,
per process group, its bytes sent and received (`wire_bytes`) must equal the function's count for the
forwards the rank ran, exactly; so must the calls and bytes per group and kind. Three layouts, each with a
different recompute policy: dp 4 (none), dp 2 x sp 2 (selective), HSDP 2 x 2 (full); and a LoRA run in
bfloat16 at dp 2 x sp 2 (full), whose block units hold a bfloat16 base and float32 adapters, its AdaLN
projections adapted and its time embedding trained. Each with the AdaLN tables off and on
(`model/adaln_tables.py`: the projections out of the block units, their embeddings gathered, table
slices exchanged), two trainers in one process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.launch import run_env
from helpers.pack_ranks import mixed_overrides, run_on_ranks
from helpers.paths import ROOT
from helpers.traffic_ranks import StepBytes, recorded_steps

CONFIG = ROOT / "configs" / "tiny_ref2va_cfg.yaml"


@dataclass(frozen=True)
class Layout:
    parallel: tuple[str, ...]
    recompute: str


LAYOUTS = {
    "dp4": Layout(("parallel.dp_shard=4",), "none"),
    "dp2_sp2": Layout(("parallel.dp_shard=2", "parallel.sp=2"), "selective"),
    "hsdp2x2": Layout(("parallel.dp_replicate=2", "parallel.dp_shard=2"), "full"),
    # Adapters: a bfloat16 frozen base and float32 adapters in each block's unit, gathered in bfloat16; the
    # AdaLN projection adapted (its frozen base is what the tables serve) and the time embedding trained.
    "lora_bf16_dp2_sp2": Layout(
        (
            "parallel.dp_shard=2",
            "parallel.sp=2",
            "model.dtype=bfloat16",
            "lora.rank=4",
            "lora.target_modules=[video_and_audio,adaln_proj.linear]",
            "lora.train_modules=[time_embedder]",
        ),
        "full",
    ),
}
TABLES = ("false", "true")


def variant_overrides(layout: Layout, data: Path, log_dir: Path, tables: str) -> list[str]:
    return [
        *mixed_overrides(data, log_dir),
        "train.grad_accum=2",
        "cfg.scale=3",
        f"model.activation_checkpointing={layout.recompute}",
        f"parallel.adaln_tables={tables}",
        *layout.parallel,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_sends_what_the_traffic_plan_counts(name: str, mixed_data: Path, tmp_path: Path) -> None:
    layout = LAYOUTS[name]
    variants = {f"tables_{t}": variant_overrides(layout, mixed_data, tmp_path / t, t) for t in TABLES}
    runs = run_on_ranks(recorded_steps, 4, str(CONFIG), variants, env=run_env(), timeout=300)
    for variant, steps in runs.items():
        for step, ranks in enumerate(steps, start=1):
            ranks: list[StepBytes]
            # The ranks ran different rows and timesteps: the counts are each rank's own.
            assert len({tuple(r.forwards) for r in ranks}) > 1, "every rank ran the same forwards"
            assert all(sum(not grad for *_, grad in r.forwards) == 2 for r in ranks), "no CFG negative forward"
            print(
                f"{name} {variant} step {step}: rank 0 sends {ranks[0].recorded} (group, link); "
                f"a block all-gathers {ranks[0].block_gathered} bytes"
            )
            for r in ranks:
                where = f"{name} {variant} step {step} rank {r.rank}"
                assert not r.unplanned, f"{where}: object collectives or barriers in a step: {r.unplanned}"
                detail = f"recorded {r.calls}\ncounted {r.exchanges}"
                assert r.recorded_kinds == r.counted_kinds, f"{where}: calls and bytes by (group, kind)\n{detail}"
                assert r.recorded == r.counted, f"{where}: bytes by (group, link)"
                assert sum(s for s, _ in r.recorded.values()) > 0
