"""The figures docs/cluster.md gives a user moving a dataset to a bucket, recomputed.

Its object-storage table states a released sample's size, the shards and bytes of an epoch of 1 M samples,
and for two cluster configs the GETs and bytes each rank asks per second at `check`'s step estimate. Each is
recomputed here: the sample's size from a released sample written as a run reads it, the step from `check`
on the config at the world size of its `# plan:` line, the samples a rank reads a step from its config.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.data.sample_file import write_sample
from h3train.data.synthetic_dataset import released_sample
from h3train.model.architecture import model_kwargs

from helpers.launch import run_cli
from helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

DOC = (ROOT / "docs" / "cluster.md").read_text()
SECTION = DOC[DOC.index("## 10. Data on object storage") :]
EPOCH = 1_000_000
SHARD_BYTES = 2e9
MIB = 2**20


def _near(stated: float, actual: float, rel: float = 0.02) -> bool:
    return abs(stated - actual) <= rel * actual


@pytest.fixture(scope="module")
def sample_bytes(tmp_path_factory: pytest.TempPathFactory) -> int:
    path = tmp_path_factory.mktemp("released") / "released.safetensors"
    write_sample(path, released_sample("fl2va", 0, seed=0, text_dim=model_kwargs({})["text_dim"]))
    return path.stat().st_size


def test_an_epochs_objects_and_bytes_follow_from_the_released_samples_size(sample_bytes: int) -> None:
    size = re.search(r"about (\d+) MiB a sample", SECTION)
    shards = re.search(r"\| objects \| about ([\d,]+) shards of 2 GB", SECTION)
    total = re.search(r"\| bytes \| about ([\d.]+) TiB x `sp`", SECTION)
    assert size and shards and total, "the object-storage table lost a figure"
    assert _near(float(size[1]), sample_bytes / MIB), (size[0], sample_bytes / MIB)
    assert _near(float(shards[1].replace(",", "")), EPOCH * sample_bytes / SHARD_BYTES), shards[0]
    assert _near(float(total[1]), EPOCH * sample_bytes / 2**40), (total[0], EPOCH * sample_bytes / 2**40)


@pytest.mark.parametrize(("name", "gpus"), [("h3_a100_64gpu", 64), ("h3_a100_16gpu", 16)])
def test_a_ranks_gets_and_bytes_a_second_follow_from_checks_step(
    sample_bytes: int, tmp_path: Path, monkeypatch, capsys, name: str, gpus: int
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = ROOT / "configs" / f"{name}.yaml"
    rc, out, err = run_cli(capsys, ["check", str(config), "--world-size", str(gpus)])
    assert rc == 0, out[-2000:] + err
    step = float(re.search(r"^step time\s+~([\d.]+) s per optimizer step", out, re.M)[1])
    cfg = load_config(config)
    assert not cfg.data.pack, f"{name}: a packed micro-batch reads several samples"
    # Every rank of an SP group reads the group's sample: one a micro-batch.
    per_step = cfg.train.grad_accum
    row = re.search(rf"`{name}` \((\d+) samples? per rank per ~(\d+) s step\): ([\d.]+)", SECTION)
    assert row, f"the table has no GETs figure for {name}"
    assert int(row[1]) == per_step, row[0]
    assert _near(float(row[2]), step, rel=0.01), (row[0], step)
    assert float(row[3]) == round(per_step / step, 3), (row[0], per_step / step)
    rate = re.search(rf"([\d.]+) MiB/s \({gpus} GPUs\)", SECTION)
    assert rate, f"the table has no bytes figure for {gpus} GPUs"
    assert float(rate[1]) == round(per_step / step * sample_bytes / MIB, 1), (rate[0], per_step / step * sample_bytes)
