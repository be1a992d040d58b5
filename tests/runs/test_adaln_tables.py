"""The AdaLN tables computed where their weights live train the unsharded reference's gradients.

Step 1 in float64 at dp 2, dp 2 x sp 2 and HSDP 2 x 2 (`parallel.adaln_tables=true`: every block's table
in one exchange a forward), a full fine-tune and a LoRA whose targets include the projection, against one
process accumulating the same micro-batches (dp = N is one process of N micro-batches): every parameter's
full gradient, each sample's loss, the step's loss and grad norm. The mixed dataset gives the ranks of a
step different tasks, so different counts of timesteps (the padded exchange), and CFG runs a negative
forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.data.source import build_source

from helpers.launch import run_env
from helpers.pack_ranks import mixed_overrides, run_on_ranks
from helpers.paths import ROOT
from helpers.reference import relative_l2
from helpers.table_ranks import table_steps

CONFIG = ROOT / "configs" / "tiny_ref2va.yaml"
TOL = 1e-10
# Micro-batches per rank: a step of 2 x dp samples holds several tasks.
ACCUM = 2
PROJECTION = r"transformer_blocks\.\d+\.adaln_proj\.linear"
KINDS = {
    "full": [],
    # The projection adapted (its base layer computes the tables) and an attention projection.
    "lora": [
        "lora.rank=4",
        "lora.alpha=8",
        f"lora.target_modules=['{PROJECTION}','transformer_blocks\\.\\d+\\.attn\\.to_q']",
    ],
}


@dataclass(frozen=True)
class Layout:
    nproc: int
    dp: int
    overrides: tuple[str, ...]


LAYOUTS = {
    "dp2": Layout(2, 2, ("parallel.dp_shard=2",)),
    "dp2_sp2": Layout(4, 2, ("parallel.dp_shard=2", "parallel.sp=2")),
    "hsdp2x2": Layout(4, 4, ("parallel.dp_replicate=2", "parallel.dp_shard=2")),
}


def common(data: Path, log_dir: Path) -> list[str]:
    """Every run's overrides: the mixed dataset, CFG with prompt dropout."""
    return [
        *mixed_overrides(data, log_dir),
        "parallel.adaln_tables=true",
        "cfg.scale=3",
        "cfg.curvature_power=0.5",
        "cfg.text_dropout=0.25",
    ]


class Steps:
    """Each layout's records and the one-process references, forked once whichever test asks first."""

    def __init__(self, data: Path, root: Path) -> None:
        self.data, self.root, self.cache = data, root, {}

    def layout(self, name: str):
        if name not in self.cache:
            layout = LAYOUTS[name]
            runs = {
                kind: [
                    *common(self.data, self.root / name / kind),
                    *layout.overrides,
                    f"train.grad_accum={ACCUM}",
                    *extra,
                ]
                for kind, extra in KINDS.items()
            }
            self.cache[name] = run_on_ranks(table_steps, layout.nproc, str(CONFIG), runs, env=run_env())
        return self.cache[name]

    def reference(self, dp: int):
        key = f"one_process_{dp}"
        if key not in self.cache:
            runs = {
                kind: [*common(self.data, self.root / key / kind), f"train.grad_accum={dp * ACCUM}", *extra]
                for kind, extra in KINDS.items()
            }
            self.cache[key] = run_on_ranks(table_steps, 1, str(CONFIG), runs, env=run_env())
        return self.cache[key]


@pytest.fixture(scope="module")
def steps(mixed_data, tmp_path_factory) -> Steps:
    return Steps(mixed_data, tmp_path_factory.mktemp("table_runs"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tables_where_the_weights_live_train_the_unsharded_gradients(name: str, kind: str, steps: Steps) -> None:
    layout = LAYOUTS[name]
    record, served, unmanaged = steps.layout(name)[kind]
    reference, reference_served, _ = steps.reference(layout.dp)[kind]
    assert served and not reference_served
    # Exactly the projections' weights and biases are in no FSDP2 unit: they are never all-gathered.
    base = ".base_layer" if kind == "lora" else ""
    blocks = {n.split(".")[2] for n in record.grads if n.startswith("transformer.transformer_blocks.")}
    assert unmanaged == {
        f"transformer.transformer_blocks.{b}.adaln_proj.linear{base}.{p}" for b in blocks for p in ("weight", "bias")
    }
    projection = [n for n in record.grads if ".adaln_proj.linear." in n]

    # The step's samples: the same, each rank its own, of different tasks within the step.
    source = build_source(load_config(CONFIG, common(steps.data, steps.root / "index")))
    tasks = {e.sample_id: e.task for e in source.entries}
    per_rank = [{s for m in rank for s in m} for rank in record.micro_batches]
    assert set(record.losses) == set(reference.losses) and len(record.losses) == layout.dp * ACCUM
    assert all(per_rank) and len(set().union(*per_rank)) == layout.dp * ACCUM
    assert len({tasks[s] for s in record.losses}) > 1, record.losses
    assert len({frozenset(tasks[s] for s in rank) for rank in per_rank}) > 1, per_rank

    assert record.grads.keys() == reference.grads.keys()
    trained = {n: g for n, g in reference.grads.items() if g.abs().sum() > 0}
    assert any(n in trained for n in projection)
    worst, param = max((relative_l2(record.grads[n], g), n) for n, g in trained.items())
    print(f"{name} {kind}: worst parameter relative L2 against one process {worst:.2e} ({param})")
    assert worst <= TOL, f"{name} {kind}: gradient of {param} off by relative L2 {worst:.3e}"
    for sample_id, loss in reference.losses.items():
        assert record.losses[sample_id] == pytest.approx(loss, rel=TOL, abs=0), sample_id
    for key in ("loss", "grad_norm"):
        assert record.stats[key] == pytest.approx(reference.stats[key], rel=TOL), key
