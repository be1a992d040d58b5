"""The time of one optimizer step, as `h3train check` prints it beside the memory plan.

Per rank and step:

- compute: the model FLOPs of every forward of the step (`traffic.planned_forwards`: `train.grad_accum`
  micro-batches, each after its no-grad CFG negative when `cfg.scale` is not 1), a backward at twice its
  forward, and the forward FLOPs the backward runs again under the blocks' policies (`recompute_share`),
  at a sustained rate per device kind (`Rates.tflops`). The work splits evenly over the SP ranks but for
  the text refiner, which every SP rank runs over every text row (`forward_flops`: matmuls only).
- communication: the bytes of every collective of the step (`traffic.step_traffic`), per link class, at
  that link's bus bandwidth (`Rates.links`, in the nccl-tests sense `h3train.tools.nccl_bandwidth`
  measures: what one rank moves per second). A collective moves `max(sent, received)` at it.
- overlap: what `Exchange.hidden` marks (the block units' all-gathers and reduce-scatters) FSDP2's
  prefetch runs behind the blocks' compute, the links side by side; the rest (Ulysses all-to-alls, the
  AdaLN table exchanges, the step's all-reduces) waits on the critical path:

      step = max(compute, hideable intra-node, hideable inter-node) + critical intra-node + critical inter-node

The limit is the largest of compute and each link's whole time (hideable + critical): the resource a
faster step has to come from. Seconds are wall time; FLOPs are multiply-adds counted twice; GB are
10^9 bytes; TFLOP/s 10^12 FLOP/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .activations import forward_flops, recompute_share, refiner_forward_flops, refiner_recomputed
from .arithmetic import A100_MEMORY_GIB, H100_MEMORY_GIB, MemoryPlan
from .traffic import LINKS, ForwardShape, StepTraffic

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config
    from ..parallel.dims import ParallelDims

# The one sustained rate measured so far: one H200 (139.8 GiB, torch 2.11) trained the bench's full-width
# blocks (hidden 5376, 56 x 128 heads; 3 blocks, the most that fit without recompute) on the 5 s FL2VA
# layout (41,774 rows), native attention, at 451.4 TFLOP/s of model FLOPs: 45.6 % of its 989 TFLOP/s
# dense bf16 peak (`h3train bench`; shared/gpu/measured/h200_bench_3blocks_no_checkpointing.json and the
# README beside it). Without recompute the model FLOPs are all the work the GPU does, so this is the
# rate of work, recompute included, that the estimate divides by.
H200_MEASURED_TFLOPS = 451.4
H200_MEASURED_MFU = 0.4564
H200_MEASURED_SOURCE = "shared/gpu/measured/h200_bench_3blocks_no_checkpointing.json"
# The H200's memory as torch reports it on that machine (GiB).
H200_MEMORY_GIB = 139.8

LINK_WORDS = {"intra_node": "intra-node", "inter_node": "inter-node"}

# Dense bf16 tensor-core peak in TFLOP/s, first substring match of `torch.cuda.get_device_name()`.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak of a known device (`PEAK_BF16_TFLOPS`), None when the name matches no entry."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


@dataclass(frozen=True)
class DeviceKind:
    """A GPU the estimate knows: `key` the `--device` name, `name` what `torch.cuda.get_device_name()`
    holds (the bench's peak table is matched against it), its memory in GiB, the bus bandwidth per GPU of
    each link class in GB/s with what it assumes, and a sustained TFLOP/s where one was measured (None:
    assumed at the H200's measured MFU of this card's peak)."""

    key: str
    name: str
    memory_gib: float
    intra_node_gbps: float
    intra_node_source: str
    inter_node_gbps: float
    inter_node_source: str
    measured_tflops: float | None = None
    measured_source: str = ""


# Link defaults: nccl-tests' usual bus bandwidth over an 8-GPU node's NVSwitch and over one InfiniBand NIC
# per GPU, about 75-90 % of the rating. None of them was measured on a cluster of this project.
_NVLINK3 = "NVLink 3 (300 GB/s each way) at a typical nccl-tests bus bandwidth"
_NVLINK4 = "NVLink 4 (450 GB/s each way) at a typical nccl-tests bus bandwidth"
_HDR = "one HDR 200 Gb/s NIC per GPU (25 GB/s) at a typical nccl-tests bus bandwidth"
_NDR = "one NDR 400 Gb/s NIC per GPU (50 GB/s) at a typical nccl-tests bus bandwidth"
DEVICE_KINDS: dict[str, DeviceKind] = {
    "a100": DeviceKind("a100", "A100-SXM4-80GB", A100_MEMORY_GIB, 230.0, _NVLINK3, 22.0, _HDR),
    "h100": DeviceKind("h100", "H100 80GB HBM3", H100_MEMORY_GIB, 360.0, _NVLINK4, 45.0, _NDR),
    "h200": DeviceKind(
        "h200",
        "H200",
        H200_MEMORY_GIB,
        360.0,
        _NVLINK4,
        45.0,
        _NDR,
        H200_MEASURED_TFLOPS,
        f"one H200, full-width blocks without recompute, {H200_MEASURED_SOURCE}",
    ),
}
# The plan's card when none is named: the cluster configs' 80 GB A100 (`A100_MEMORY_GIB` as torch reports it).
DEFAULT_DEVICE = "a100"


def device_kind_of(device_name: str) -> str:
    """The `DEVICE_KINDS` key of a GPU named `device_name` (`torch.cuda.get_device_name()`): the kind whose
    name it contains, the longest such first; `DEFAULT_DEVICE` where none matches."""
    found = [k for k, d in DEVICE_KINDS.items() if d.name.lower() in device_name.lower()]
    return max(found, key=lambda k: len(DEVICE_KINDS[k].name)) if found else DEFAULT_DEVICE


def rates_of_kind(key: str) -> Rates:
    """The rates of device kind `key` with nothing given: its measured or assumed figures, its bf16 peak."""
    peak = peak_tflops_for(DEVICE_KINDS[key].name)
    assert peak is not None, f"no bf16 peak for {DEVICE_KINDS[key].name}"
    return device_rates(key, peak)


@dataclass(frozen=True)
class Figure:
    """A rate the estimate divides by, and where it comes from: `origin` is `measured` (a figure of this
    project's, in the code), `given` (a flag of the command: what the user measured) or `assumed`."""

    value: float
    origin: str
    source: str

    def said(self) -> str:
        word = "ASSUMED" if self.origin == "assumed" else self.origin
        return f"{word}: {self.source}"


@dataclass(frozen=True)
class Rates:
    """What the estimate divides by: the device, its dense bf16 peak (TFLOP/s, for the MFU), the sustained
    TFLOP/s of the model's work and the bus bandwidth of each link class in GB/s (`LINKS` keys)."""

    device: DeviceKind
    peak_tflops: float
    tflops: Figure
    links: Mapping[str, Figure]


def device_rates(
    key: str,
    peak_tflops: float,
    *,
    tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
) -> Rates:
    """The rates of device `key` (`DEVICE_KINDS`) with dense bf16 peak `peak_tflops`; a figure given here
    (a measurement of the user's) replaces the device's measured or assumed default."""
    device = DEVICE_KINDS[key]
    if tflops is not None:
        sustained = Figure(tflops, "given", "--tflops")
    elif device.measured_tflops is not None:
        sustained = Figure(device.measured_tflops, "measured", device.measured_source)
    else:
        sustained = Figure(
            H200_MEASURED_MFU * peak_tflops,
            "assumed",
            f"the H200's measured {100 * H200_MEASURED_MFU:.1f} % MFU of this card's {peak_tflops:g} TFLOP/s bf16 peak",
        )
    links = {}
    for link, given, default in (
        ("intra_node", intra_node_gbps, Figure(device.intra_node_gbps, "assumed", device.intra_node_source)),
        ("inter_node", inter_node_gbps, Figure(device.inter_node_gbps, "assumed", device.inter_node_source)),
    ):
        links[link] = Figure(given, "given", f"--{LINK_WORDS[link]}-gbps") if given is not None else default
    return Rates(device, peak_tflops, sustained, links)


@dataclass(frozen=True)
class ComputeFlops:
    """Model FLOPs of one rank in one optimizer step. `model`: every forward and each backward at twice
    its forward, the CFG negatives' forwards (`negative`) among them; `recompute`: what the backwards run
    again. `forwards` / `backwards`: how many of each."""

    model: float
    recompute: float
    negative: float
    forwards: int
    backwards: int

    @property
    def work(self) -> float:
        """What the GPU computes: the model FLOPs and the recompute."""
        return self.model + self.recompute


def rank_forward_flops(dims: Mapping[str, Any], rows: int, text_rows: int, sp: int) -> tuple[float, float]:
    """(one forward's model FLOPs on one SP rank, the whole sequence's forward FLOPs): the blocks and heads
    over `rows` padded to a multiple of `sp` split over the SP ranks, the refiner whole on each."""
    padded = -(-rows // sp) * sp
    linear, attention, other = forward_flops(dims, padded, text_rows)
    refiner = refiner_forward_flops(dims, text_rows)
    whole = int(dims["num_layers"]) * (linear + attention) + other
    return (whole - refiner) / sp + refiner, float(whole)


def step_compute(
    dims: Mapping[str, Any], forwards: Sequence[ForwardShape], policies: Sequence[str], text_rows: int, sp: int
) -> ComputeFlops:
    """The compute of one rank's step: `forwards` as `traffic.planned_forwards` lists them, the blocks'
    `policies` (`BLOCK_POLICIES`), the text rows the refiner runs over."""
    policies = tuple(policies)
    model = recompute = negative = 0.0
    for f in forwards:
        forward, whole = rank_forward_flops(dims, f.rows, text_rows, sp)
        if not f.grad:
            model += forward
            negative += forward
            continue
        model += 3 * forward
        padded = -(-f.rows // sp) * sp
        again = recompute_share(dims, padded, policies, text_rows) * whole
        refiner = refiner_forward_flops(dims, text_rows) if refiner_recomputed(policies) else 0
        recompute += (again - refiner) / sp + refiner
    backwards = sum(f.grad for f in forwards)
    return ComputeFlops(model, recompute, negative, len(forwards), backwards)


@dataclass(frozen=True)
class LinkTime:
    """One link class's traffic in a step: bytes one rank sends and receives, and the seconds of the
    exchanges FSDP2's prefetch can hide (`hideable_s`) and of those on the critical path (`critical_s`,
    by what they carry in `critical_parts`, the longest first)."""

    link: str
    gbps: Figure
    sent: int
    received: int
    hideable_s: float
    critical_s: float
    critical_parts: tuple[tuple[str, float], ...] = ()

    @property
    def seconds(self) -> float:
        return self.hideable_s + self.critical_s


def link_times(traffic: StepTraffic, links: Mapping[str, Figure]) -> tuple[LinkTime, ...]:
    """Each link class's time (`LINKS` order) at `links`' GB/s: a collective's `max(sent, received)` bytes."""
    out = []
    for link in LINKS:
        rate = links[link].value * 1e9
        sent = received = 0
        hideable = 0.0
        parts: dict[str, float] = {}
        for e in traffic.exchanges:
            if e.link != link:
                continue
            sent, received = sent + e.sent, received + e.received
            seconds = max(e.sent, e.received) / rate
            if e.hidden:
                hideable += seconds
            else:
                parts[e.what] = parts.get(e.what, 0.0) + seconds
        ordered = tuple(sorted(parts.items(), key=lambda kv: -kv[1]))
        out.append(LinkTime(link, links[link], sent, received, hideable, sum(parts.values()), ordered))
    return tuple(out)


@dataclass(frozen=True)
class StepEstimate:
    """The estimated optimizer step of one rank (module docstring). `samples`: samples (or packs) per step."""

    rates: Rates
    flops: ComputeFlops
    links: tuple[LinkTime, ...]
    samples: int
    policies: tuple[str, ...] = ()

    @property
    def compute_s(self) -> float:
        return self.flops.work / (self.rates.tflops.value * 1e12)

    @property
    def hideable_s(self) -> float:
        """The longest link's hideable traffic: the links run side by side, each behind the same compute."""
        return max((link.hideable_s for link in self.links), default=0.0)

    @property
    def critical_s(self) -> float:
        return sum(link.critical_s for link in self.links)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.hideable_s) + self.critical_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) over the step's time at the device's dense bf16 peak."""
        return self.flops.model / (self.step_s * self.rates.peak_tflops * 1e12) if self.step_s else 0.0

    @property
    def limit(self) -> str:
        """`compute`, `intra-node` or `inter-node`: the largest of compute and each link's whole time."""
        times = [("compute", self.compute_s), *((LINK_WORDS[link.link], link.seconds) for link in self.links)]
        return max(times, key=lambda kv: kv[1])[0]


def estimate_step(
    rates: Rates, traffic: StepTraffic, flops: ComputeFlops, samples: int, policies: Sequence[str] = ()
) -> StepEstimate:
    """The step of `flops` and `traffic` at `rates` (module docstring)."""
    return StepEstimate(rates, flops, link_times(traffic, rates.links), samples, tuple(policies))


def planned_step(
    cfg: Config,
    dims: ParallelDims,
    plan: MemoryPlan,
    model_dims: Mapping[str, Any],
    rates: Rates,
    *,
    ranks_per_node: int,
    transformer: nn.Module | None = None,
) -> StepEstimate:
    """The step of `cfg` on the mesh `dims` whose memory plan is `plan` (its blocks' policies): its forwards
    (`planned_forwards`) and its bytes (`step_traffic`), both counted in `plan/traffic.py`.
    `transformer`: the meta model `step_traffic` reads (None: built from `cfg`; pass one to plan many
    layouts of one config)."""
    from .traffic import planned_forwards, step_traffic

    forwards = planned_forwards(cfg, dims)
    traffic = step_traffic(
        cfg, dims, ranks_per_node=ranks_per_node, forwards=forwards, policies=plan.policies, transformer=transformer
    )
    flops = step_compute(model_dims, forwards, plan.policies, plan.text_rows, dims.sp)
    return estimate_step(rates, traffic, flops, plan.global_batch, plan.policies)


def decimal_bytes(n: int) -> str:
    """`823.47 GB`: bytes in powers of 1000, as link bandwidths are rated."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _sci(x: float) -> str:
    """`7.21e16`: three figures and a bare exponent."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _parts(parts: Sequence[tuple[str, float]], most: int = 3) -> str:
    shown = [f"{what} {seconds:.1f} s" for what, seconds in parts[:most] if seconds >= 0.05]
    return ", ".join(shown) if shown else "none"


def format_step(estimate: StepEstimate, packed: bool = False) -> str:
    """The estimate as `h3train check` prints it: the step, then compute, each link class, and the sum."""
    e, r, f = estimate, estimate.rates, estimate.flops
    what = "packs" if packed else "samples"
    device = r.device
    lines = [
        f"step time     ~{e.step_s:,.1f} s per optimizer step (estimate), {e.samples_per_s:.3g} {what}/s, "
        f"MFU {100 * e.mfu:.1f} % of the {r.peak_tflops:g} TFLOP/s peak; limit: {e.limit} "
        f"({device.key}: {device.name}, {_counted(f.forwards, 'forward')}, {_counted(f.backwards, 'backward')} "
        "per rank)",
    ]
    negative = f", CFG negative forwards {_sci(f.negative)} of it" if f.negative else ", no CFG negative"
    lines.append(
        f"  compute     {e.compute_s:10,.1f} s  {_sci(f.work)} FLOPs per rank (counted): model {_sci(f.model)} "
        f"(forward + backward at 2x{negative}), recompute {_sci(f.recompute)}; at {r.tflops.value:.1f} TFLOP/s "
        f"({r.tflops.said()})"
    )
    for link in e.links:
        if not (link.sent or link.received):
            lines.append(
                f"  {LINK_WORDS[link.link]:<11} {0.0:10,.1f} s  nothing on this link (at {link.gbps.value:g} GB/s: "
                f"{link.gbps.said()})"
            )
            continue
        hidden = min(link.hideable_s, e.compute_s)
        if link.hideable_s:
            prefetch = f"FSDP2's prefetch hides {hidden:,.1f} s of it behind compute"
            if hidden < link.hideable_s:
                prefetch += f" ({link.hideable_s - hidden:,.1f} s more than the compute)"
        else:
            prefetch = "nothing for FSDP2's prefetch to hide"
        sent, received = decimal_bytes(link.sent), decimal_bytes(link.received)
        lines.append(
            f"  {LINK_WORDS[link.link]:<11} {link.seconds:10,.1f} s  {sent} sent, {received} "
            f"received per rank (counted) at {link.gbps.value:g} GB/s ({link.gbps.said()}); {prefetch}; "
            f"{link.critical_s:,.1f} s on the critical path ({_parts(link.critical_parts)})"
        )
    lines.append(
        f"  step        max(compute {e.compute_s:,.1f} s, hideable {e.hideable_s:,.1f} s) + critical path "
        f"{e.critical_s:,.1f} s = {e.step_s:,.1f} s"
    )
    return "\n".join(lines)


# -- layouts --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout of the world's ranks: its plan, its estimate (None: it does not fit) and its grad_accum."""

    dp_replicate: int
    dp_shard: int
    sp: int
    grad_accum: int
    plan: MemoryPlan
    step: StepEstimate | None


def layouts(world_size: int, heads: int, ranks_per_node: int) -> list[tuple[int, int, int]]:
    """Every `(dp_replicate, dp_shard, sp)` of `world_size` ranks whose sp divides the heads and the GPUs of
    a node (Ulysses' all-to-alls stay on NVLink) and whose dp_replicate divides what sp leaves."""
    found = []
    for sp in range(1, world_size + 1):
        if world_size % sp or heads % sp or ranks_per_node % sp:
            continue
        rest = world_size // sp
        found += [(r, rest // r, sp) for r in range(1, rest + 1) if rest % r == 0]
    return found


def layout_estimates(
    cfg: Config,
    world_size: int,
    model_dims: Mapping[str, Any],
    rates: Rates,
    *,
    ranks_per_node: int,
    plan_of: Callable[[Config, ParallelDims], MemoryPlan],
) -> list[LayoutEstimate]:
    """Every layout of `world_size` ranks (`layouts`) keeping the samples per step of `cfg`'s own mesh (each
    takes `grad_accum = ceil(samples / dp)`), with its memory plan (`plan_of(cfg, dims) -> MemoryPlan`) and,
    where that fits, its estimate; the fitting ones first, the most samples per second first."""
    from ..parallel.dims import ParallelDims
    from .traffic import planned_transformer

    own = ParallelDims.from_config(cfg.parallel, world_size)
    samples = own.dp * cfg.train.grad_accum
    heads = int(model_dims["num_attention_heads"])
    transformer = None
    out = []
    for dp_replicate, dp_shard, sp in layouts(world_size, heads, ranks_per_node):
        accum = math.ceil(samples / (dp_replicate * dp_shard))
        parallel = replace(cfg.parallel, dp_replicate=dp_replicate, dp_shard=dp_shard, sp=sp)
        layout_cfg = replace(cfg, parallel=parallel, train=replace(cfg.train, grad_accum=accum))
        dims = ParallelDims(dp_replicate, dp_shard, sp, world_size)
        plan = plan_of(layout_cfg, dims)
        step = None
        if plan.fits:
            transformer = planned_transformer(cfg) if transformer is None else transformer
            step = planned_step(
                layout_cfg, dims, plan, model_dims, rates, ranks_per_node=ranks_per_node, transformer=transformer
            )
        out.append(LayoutEstimate(dp_replicate, dp_shard, sp, accum, plan, step))
    return sorted(out, key=lambda x: (x.step is None, -(x.step.samples_per_s if x.step else 0.0)))


def format_layouts(found: Sequence[LayoutEstimate], world_size: int, rates: Rates, ranks_per_node: int) -> str:
    """The layouts as `h3train check --layouts` prints them: one line each that fits, fastest first, and
    those that do not."""
    fit = [x for x in found if x.step is not None]
    unfit = [x for x in found if x.step is None]
    memory = rates.device.memory_gib
    lines = [
        f"layouts of {world_size} ranks that fit {memory:g} GiB ({rates.device.key}), fastest first "
        f"(sp divides the heads and the {ranks_per_node} GPUs of a node; the same samples per step):",
        f"  {'sp':>3} {'dp_shard':>8} {'dp_replicate':>12} {'grad_accum':>10} {'peak GiB':>9} {'recompute':>9} "
        f"{'step s':>9} {'samples/s':>9} {'MFU':>6}  limit",
    ]
    for x in fit:
        s = x.step
        assert s is not None
        lines.append(
            f"  {x.sp:>3} {x.dp_shard:>8} {x.dp_replicate:>12} {x.grad_accum:>10} {x.plan.peak_bytes / 2**30:>9.2f} "
            f"{100 * x.plan.recompute_share:>8.1f}% {s.step_s:>9,.1f} {s.samples_per_s:>9.3g} "
            f"{100 * s.mfu:>5.1f}%  {s.limit}"
        )
    if not fit:
        lines.append("  none: shard over more ranks, shorten the clips or set data.max_rows (the plan above says how)")
    if unfit:
        said = ", ".join(
            f"sp={x.sp} dp_shard={x.dp_shard} dp_replicate={x.dp_replicate} ({x.plan.peak_bytes / 2**30:.1f} GiB)"
            for x in unfit
        )
        lines.append(f"  do not fit: {said}")
    if fit:
        r = rates
        lines.append(
            f"  rates: {r.tflops.value:.1f} TFLOP/s ({r.tflops.origin}), intra-node {r.links['intra_node'].value:g} "
            f"GB/s ({r.links['intra_node'].origin}), inter-node {r.links['inter_node'].value:g} GB/s "
            f"({r.links['inter_node'].origin})"
        )
    return "\n".join(lines)
