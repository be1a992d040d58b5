"""`h3train check` prints the step-time estimate beside the memory plan, its bytes those `step_traffic`
counts, and with `--layouts` every layout of the ranks that fits, the fastest first, each with its limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3train.config import load_config
from h3train.plan.step_time import LINK_WORDS
from h3train.plan.tables import with_tables
from h3train.plan.traffic import step_traffic

from helpers.launch import run_cli
from helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

CONFIG = ROOT / "configs" / "h3_a100_16gpu.yaml"
STEP = re.compile(r"^step time     ~([\d,.]+) s per optimizer step .* limit: (compute|intra-node|inter-node) ", re.M)
LAYOUT = re.compile(
    r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)%\s+([\d,.]+)\s+([\d.e+-]+)\s+([\d.]+)%\s+"
    r"(compute|intra-node|inter-node)$",
    re.M,
)


def _seconds(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture
def away(tmp_path: Path, monkeypatch) -> Path:
    """Plan away from the model and the data, 8 GPUs a node whatever the environment says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return tmp_path


def test_check_prints_the_step_its_parts_and_its_limit(away: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, ["check", str(CONFIG), "--world-size", "16"])
    assert rc == 0, out[-2000:] + err
    step = STEP.search(out)
    assert step, out[-3000:]
    compute = re.search(r"^  compute\s+([\d,.]+) s .* at ([\d.]+) TFLOP/s \(ASSUMED: ", out, re.M)
    intra = re.search(r"^  intra-node\s+([\d,.]+) s  .* \(ASSUMED: .*critical path.*$", out, re.M)
    inter = re.search(r"^  inter-node\s+([\d,.]+) s  .* \(ASSUMED: .*FSDP2's prefetch hides.*$", out, re.M)
    total = re.search(
        r"^  step        max\(compute ([\d,.]+) s, hideable ([\d,.]+) s\) \+ critical path ([\d,.]+) s", out, re.M
    )
    assert compute and intra and inter and total, out[-3000:]
    # The A100's rate is the H200's measured MFU of 312 TFLOP/s; the whole sums as printed.
    assert float(compute[2]) == pytest.approx(0.4564 * 312, abs=0.1)
    parts = [_seconds(total[i]) for i in (1, 2, 3)]
    assert _seconds(step[1]) == pytest.approx(max(parts[0], parts[1]) + parts[2], abs=0.11)
    # 16 ranks, one shard group over both nodes: its all-gathers cross InfiniBand, Ulysses stays on NVLink.
    assert "ulysses" in intra[0] and "ulysses" not in inter[0]
    assert step[2] == "compute"


def test_the_printed_bytes_are_those_step_traffic_counts(away: Path, capsys) -> None:
    from h3train.parallel.dims import ParallelDims
    from h3train.plan.step_time import decimal_bytes

    rc, out, _ = run_cli(capsys, ["check", str(CONFIG), "--world-size", "16"])
    assert rc == 0
    cfg = load_config(CONFIG, [])
    dims = ParallelDims.from_config(cfg.parallel, 16)
    # What check plans is the tables setting `auto` takes, which it prints.
    served = re.search(r"^AdaLN tables: (on|off) ", out, re.M)
    assert served
    cfg = with_tables(cfg, served[1] == "on")
    traffic = step_traffic(cfg, dims, ranks_per_node=8).per_link()
    assert set(traffic) == set(LINK_WORDS)
    for link, (sent, received) in traffic.items():
        assert sent > 0
        line = re.search(rf"^  {LINK_WORDS[link]} .*$", out, re.M)
        assert line and f"{decimal_bytes(sent)} sent, {decimal_bytes(received)} received per rank" in line[0]


def test_measured_rates_replace_the_assumed_ones_and_a_slow_link_becomes_the_limit(away: Path, capsys) -> None:
    args = ["check", str(CONFIG), "--world-size", "16", "--tflops", "150", "--inter-node-gbps", "1.5"]
    rc, out, _ = run_cli(capsys, args)
    assert rc == 0
    assert "at 150.0 TFLOP/s (given: --tflops)" in out
    assert "(given: --inter-node-gbps)" in out and "more than the compute" in out
    assert STEP.search(out)[2] == "inter-node"
    rc, out, _ = run_cli(capsys, ["check", str(CONFIG), "--world-size", "16", "--device", "h200"])
    assert rc == 0
    assert "of 139.8 GiB" in out and "(measured: one H200" in out


def test_layouts_lists_those_that_fit_fastest_first(away: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, ["check", str(CONFIG), "--world-size", "16", "--layouts"])
    assert rc == 0, out[-2000:] + err
    rows = LAYOUT.findall(out)
    assert len(rows) >= 2, out[-3000:]
    per_second = [float(r[7]) for r in rows]
    assert per_second == sorted(per_second, reverse=True)
    for sp, dp_shard, dp_replicate, accum, peak, *_ in rows:
        sp, dp_shard, dp_replicate, accum = int(sp), int(dp_shard), int(dp_replicate), int(accum)
        assert sp * dp_shard * dp_replicate == 16 and 56 % sp == 0 and 8 % sp == 0
        assert float(peak) <= 80
        # The config's 16 samples per step in every layout.
        assert dp_shard * dp_replicate * accum == 16
    # The config's own layout is among them, with the estimate check prints for it.
    own = next(r for r in rows if (r[0], r[1], r[2]) == ("8", "2", "1"))
    assert _seconds(own[6]) == pytest.approx(_seconds(STEP.search(out)[1]), abs=0.11)
    assert "do not fit: sp=1 dp_shard=16 dp_replicate=1" in out
