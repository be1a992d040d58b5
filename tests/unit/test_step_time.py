"""The step-time estimate: the compute of a step's forwards, each link's time at its bandwidth, what FSDP2's
prefetch hides, the step, its MFU and its limit, the rates per device kind, and the layouts of a world."""

from __future__ import annotations

import inspect

import pytest
from diffusers import MiniMaxH3Transformer3DModel

from h3train.plan.activations import forward_flops, recompute_share, refiner_forward_flops
from h3train.plan.step_time import (
    DEVICE_KINDS,
    H200_MEASURED_MFU,
    H200_MEASURED_TFLOPS,
    ComputeFlops,
    device_rates,
    estimate_step,
    format_step,
    layouts,
    rank_forward_flops,
    step_compute,
)
from h3train.plan.traffic import Exchange, ForwardShape, StepTraffic

ROWS, TEXT = 41_774, 2_048


@pytest.fixture(scope="module")
def dims() -> dict:
    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    return {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def _exchange(what: str, link: str, sent: int, hidden: bool, received: int | None = None) -> Exchange:
    received = sent if received is None else received
    return Exchange(what, "all_gather", "dp_shard_sp", 16, link, "forward", 1, sent, received, hidden)


def test_a_forward_splits_over_the_sp_ranks_but_the_refiner(dims: dict) -> None:
    linear, attention, other = forward_flops(dims, ROWS, TEXT)
    refiner = refiner_forward_flops(dims, TEXT)
    whole = dims["num_layers"] * (linear + attention) + other
    assert rank_forward_flops(dims, ROWS, TEXT, 1) == (whole, whole)
    # 41,774 rows pad to 41,776 at sp 8: the padded rows are computed too.
    per_rank, padded_whole = rank_forward_flops(dims, ROWS, TEXT, 8)
    assert padded_whole > whole
    assert per_rank == pytest.approx((padded_whole - refiner) / 8 + refiner)


def test_a_step_counts_each_backward_twice_its_forward_the_recompute_and_the_negative(dims: dict) -> None:
    layers = dims["num_layers"]
    forward = rank_forward_flops(dims, ROWS, TEXT, 1)[0]
    none = ("none",) * layers
    plain = step_compute(dims, [ForwardShape(ROWS, 3, True)] * 4, none, TEXT, 1)
    assert (plain.model, plain.recompute, plain.negative) == (pytest.approx(12 * forward), 0.0, 0.0)
    assert (plain.forwards, plain.backwards) == (4, 4)

    full = ("full",) * layers
    kept = step_compute(dims, [ForwardShape(ROWS, 3, True)], full, TEXT, 1)
    assert kept.recompute == pytest.approx(recompute_share(dims, ROWS, full, TEXT) * forward)
    # Everything but the output heads runs again.
    heads = forward_flops(dims, ROWS, TEXT)[2] - refiner_forward_flops(dims, TEXT)
    assert kept.recompute == pytest.approx(forward - heads)
    assert kept.work == pytest.approx(kept.model + kept.recompute)

    cfg = step_compute(dims, [ForwardShape(ROWS, 3, False), ForwardShape(ROWS, 3, True)] * 2, none, TEXT, 1)
    assert cfg.negative == pytest.approx(2 * forward)
    assert cfg.model == pytest.approx(8 * forward)
    assert (cfg.forwards, cfg.backwards) == (4, 2)


def test_an_h200_is_measured_and_the_others_assumed_unless_given() -> None:
    h200 = device_rates("h200", 989.0)
    assert h200.tflops.value == H200_MEASURED_TFLOPS and h200.tflops.origin == "measured"
    assert abs(H200_MEASURED_TFLOPS / 989.0 - H200_MEASURED_MFU) < 1e-4
    a100 = device_rates("a100", 312.0)
    assert a100.tflops.origin == "assumed" and a100.tflops.value == pytest.approx(H200_MEASURED_MFU * 312.0)
    assert "ASSUMED" in a100.tflops.said()
    assert all(f.origin == "assumed" for f in a100.links.values())
    given = device_rates("a100", 312.0, tflops=120.0, inter_node_gbps=11.0)
    assert (given.tflops.value, given.tflops.origin) == (120.0, "given")
    assert given.links["inter_node"].value == 11.0 and given.links["inter_node"].source == "--inter-node-gbps"
    assert given.links["intra_node"].origin == "assumed"
    assert DEVICE_KINDS["h200"].memory_gib > DEVICE_KINDS["a100"].memory_gib


def test_prefetch_hides_block_traffic_behind_compute_and_the_rest_waits() -> None:
    rates = device_rates("a100", 312.0, tflops=100.0, intra_node_gbps=100.0, inter_node_gbps=10.0)
    flops = ComputeFlops(model=800e12, recompute=200e12, negative=0.0, forwards=1, backwards=1)  # 10 s
    traffic = StepTraffic(
        (
            _exchange("fsdp all-gather", "inter_node", 50e9, True),  # 5 s, hideable
            _exchange("ulysses q/k/v all-to-all", "intra_node", 100e9, False, received=200e9),  # 2 s, critical
            _exchange("table all-to-all", "inter_node", 10e9, False),  # 1 s, critical
        )
    )
    step = estimate_step(rates, traffic, flops, samples=4)
    intra, inter = step.links
    assert (intra.link, inter.link) == ("intra_node", "inter_node")
    # A collective moves the larger of what it sends and receives.
    assert (intra.hideable_s, intra.critical_s) == (0.0, pytest.approx(2.0))
    assert (inter.hideable_s, inter.critical_s) == (pytest.approx(5.0), pytest.approx(1.0))
    assert (inter.sent, inter.received) == (60e9, 60e9)
    assert step.compute_s == pytest.approx(10.0)
    assert step.step_s == pytest.approx(10.0 + 3.0)
    assert step.samples_per_s == pytest.approx(4 / 13.0)
    assert step.mfu == pytest.approx(800e12 / (13.0 * 312e12))
    assert step.limit == "compute"
    out = format_step(step)
    assert "limit: compute" in out and "given: --inter-node-gbps" in out and "given: --tflops" in out
    assert "= 13.0 s" in out

    # Slower InfiniBand: the all-gathers outgrow the compute, and the step waits for the link.
    slow = estimate_step(device_rates("a100", 312.0, tflops=100.0, inter_node_gbps=2.0), traffic, flops, 4)
    assert slow.links[1].hideable_s == pytest.approx(25.0)
    assert slow.step_s == pytest.approx(25.0 + slow.critical_s)
    assert slow.limit == "inter-node"
    assert "more than the compute" in format_step(slow)


def test_the_links_run_side_by_side_behind_one_compute() -> None:
    rates = device_rates("h100", 989.0, tflops=100.0, intra_node_gbps=10.0, inter_node_gbps=10.0)
    flops = ComputeFlops(model=100e12, recompute=0.0, negative=0.0, forwards=1, backwards=1)  # 1 s
    traffic = StepTraffic(
        (_exchange("fsdp all-gather", "intra_node", 30e9, True), _exchange("hsdp all-reduce", "inter_node", 20e9, True))
    )
    step = estimate_step(rates, traffic, flops, 1)
    assert step.hideable_s == pytest.approx(3.0)
    assert step.step_s == pytest.approx(3.0)
    assert step.limit == "intra-node"


def test_layouts_keep_sp_within_a_node_and_a_divisor_of_the_heads() -> None:
    found = layouts(16, 56, 8)
    assert {sp for _, _, sp in found} == {1, 2, 4, 8}
    assert all(r * s * sp == 16 for r, s, sp in found)
    assert len(found) == 5 + 4 + 3 + 2
    assert (1, 2, 8) in found and (2, 1, 8) in found
    # sp 7 divides the 56 heads and 56 ranks but not the 8 GPUs of a node.
    assert all(sp != 7 for _, _, sp in layouts(56, 56, 8))
    assert {sp for _, _, sp in layouts(56, 56, 14)} >= {7, 14}
