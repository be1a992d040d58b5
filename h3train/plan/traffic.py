"""The bytes one optimizer step sends and receives per rank, per process group and link class.

Counted per collective call as a ring moves it (`wire_bytes`): what one rank puts on the wire and
takes off it. A group's link is `intra_node` when all its ranks share a node (ranks are numbered
node by node, `ranks_per_node` each), else `inter_node`.

What a step issues (`step_traffic`), per rank, with S = dp_shard x sp ranks in the shard group and
R = dp_replicate:

- FSDP2 (`model/fsdp.py`): every unit (each refiner and transformer block, the float32 islands, the
  root) all-gathers its parameters in each forward; in a forward with gradients the blocks that
  resharded after it (all but the last; none on a mesh of one rank) gather again in backward; each unit
  with trainable parameters reduce-scatters their gradients in float32 after each backward and, under
  HSDP, all-reduces the scattered shard over `dp_replicate` once a step (the last micro-batch). A
  unit's all-gather carries each parameter's shard padded to `ceil(dim0 / S)` rows in the unit's
  gather dtype (the compute dtype, float32 for the islands; a non-float parameter its own). A forward
  without gradients (the CFG negative) reshards every unit after it. Nothing on a shard group of one rank.
- Ulysses (sp > 1): per transformer block and forward one all-to-all of q, k, v
  (`3 x ceil(rows / sp) x heads x head_dim` elements) and one of the attention output back (a third
  of that); the same two in backward, and again in backward where the block is recomputed (`full`,
  `selective`); per forward one all-gather of the output heads' rows (float32) over `sp`.
- The AdaLN tables (`model/adaln_tables.py`, where `parallel.adaln_tables` serves them): per forward,
  before the block loop, one all-gather of the `[R, D]` embeddings (R = `table_rows`: 4 per sample of the
  step's largest micro-batch) and one all-to-all of `S x R x L x ceil(N / S)` table elements for the L
  served blocks; a recomputed block re-issues neither. Per backward, after the last block's, the table
  gradients' all-to-all and, when the time embedding trains, the embeddings' reduce-scatter; under HSDP,
  once a step, one all-reduce of each projection's accumulated local weight gradient and one of its bias's
  when it trains. Their weights leave the blocks' units.
- The step: the gradient norm's all-reduce over the shard group (one sum of squares, float32) and the
  step's one all-reduce of its sums (`STEP_VALUES` float64) over every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import Config
from ..parallel.collectives import wire_bytes
from ..parallel.dims import ParallelDims

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
LINKS = ("intra_node", "inter_node")
PHASES = ("forward", "backward", "step")

# Values of the step's one all-reduce (`train.reduction.StepTotals.names()`, float64 each); the loop
# sits above the plan, so the count is held here and a test holds it to the loop's.
STEP_VALUES = 12
# The output heads compute in float32 (an island).
_FP32 = 4

__all__ = [
    "KINDS",
    "LINKS",
    "PHASES",
    "STEP_VALUES",
    "Exchange",
    "ForwardShape",
    "StepTraffic",
    "TableShape",
    "UnitTraffic",
    "fsdp_units",
    "served_projections",
    "group_link",
    "planned_forwards",
    "planned_transformer",
    "step_traffic",
    "wire_bytes",
]


@dataclass(frozen=True)
class Exchange:
    """`calls` identical collectives of one rank in one step.

    what: what they carry ("fsdp all-gather", "ulysses all-to-all", "table all-to-all", ...).
    kind: one of `KINDS`. group: the mesh group ("dp_shard_sp", "dp_replicate", "sp", "dp", "world").
    sent / received: bytes over all `calls` (`wire_bytes` of each). hidden: whether FSDP2's prefetch
    can run it behind compute (the all-gathers and reduce-scatters of the block units).
    """

    what: str
    kind: str
    group: str
    group_size: int
    link: str
    phase: str
    calls: int
    sent: int
    received: int
    hidden: bool


@dataclass(frozen=True)
class ForwardShape:
    """One forward of a step on this rank: its packed rows (before the sp padding), the rows its AdaLN
    tables' exchange carries (`model.adaln_tables.table_rows`: the same on every rank of the step) and
    whether a backward follows."""

    rows: int
    table_rows: int
    grad: bool


@dataclass(frozen=True)
class UnitTraffic:
    """One FSDP2 unit as one rank moves it.

    gathered: bytes of the rank's all-gather input (its padded shard of every parameter of the unit, in
    the gather dtype); the unit's all-gathered (unsharded, padded) bytes are `S x gathered`.
    reduced: bytes of the rank's reduce-scatter output (the padded shards of the trainable parameters in
    the reduce dtype), 0 when nothing in it trains. reshards: gathered again in backward.
    """

    name: str
    block: bool
    gathered: int
    reduced: int
    reshards: bool


@dataclass(frozen=True)
class TableShape:
    """One transformer block's AdaLN projection as the table exchanges serve it (`model/adaln_tables.py`).

    rows N and in_features D of `adaln_proj.linear`; `local_rows` this rank's `torch.chunk` rows of N;
    `weight_trains` / `weight_bytes` (per element, as stored) of the projection, `embedding_trains`: the
    time embedding has trainable parameters (its gradient goes back through the exchange).
    """

    rows: int
    in_features: int
    local_rows: int
    weight_trains: bool
    weight_bytes: int
    embedding_trains: bool


@dataclass(frozen=True)
class StepTraffic:
    """Every collective of one optimizer step of one rank (`exchanges`), and the FSDP2 units they move.

    `units`: the FSDP2 units in plan order (refiner blocks, transformer blocks, islands, root); `shard_size`
    S; `tables`: whether the AdaLN tables are served (their projections out of the block units).
    """

    exchanges: tuple[Exchange, ...]
    units: tuple[UnitTraffic, ...] = ()
    shard_size: int = 1
    tables: bool = False

    def per_link(self) -> dict[str, tuple[int, int]]:
        """`(sent, received)` bytes per link class."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.exchanges:
            sent, received = out.get(e.link, (0, 0))
            out[e.link] = (sent + e.sent, received + e.received)
        return out

    def per_group(self) -> dict[tuple[str, str], tuple[int, int]]:
        """`(sent, received)` bytes per `(group, link)`."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for e in self.exchanges:
            sent, received = out.get((e.group, e.link), (0, 0))
            out[(e.group, e.link)] = (sent + e.sent, received + e.received)
        return out

    def per_group_kind(self) -> dict[tuple[str, str], tuple[int, int]]:
        """`(calls, sent bytes)` per `(group, kind)`."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for e in self.exchanges:
            calls, sent = out.get((e.group, e.kind), (0, 0))
            out[(e.group, e.kind)] = (calls + e.calls, sent + e.sent)
        return out

    @property
    def sent(self) -> int:
        return sum(e.sent for e in self.exchanges)

    @property
    def received(self) -> int:
        return sum(e.received for e in self.exchanges)

    def block_all_gather_bytes(self) -> int:
        """Bytes one transformer block's FSDP2 unit all-gathers: its unsharded parameters in the gather
        dtype, each padded to a multiple of S rows (the all-gather's output, `S x gathered`)."""
        blocks = [u for u in self.units if u.name.startswith("transformer_blocks.")]
        return self.shard_size * blocks[0].gathered if blocks else 0


# -- the model's units ----------------------------------------------------------------------------------


def planned_transformer(cfg: Config) -> nn.Module:
    """The transformer `cfg` trains, on the meta device, made as the builder makes it before sharding
    (`model.build.apply_transforms`) on the planned dims (`planned_model_dims`)."""
    from ..lora.transforms import model_transforms
    from ..model.architecture import planned_model_dims
    from ..model.build import apply_transforms, meta_transformer
    from ..optim.kinds import weights_dtype

    return apply_transforms(
        meta_transformer(planned_model_dims(cfg)[0]), cfg, model_transforms(cfg), weights_dtype(cfg.optim)
    )


def served_projections(cfg: Config, dims: ParallelDims, transformer: nn.Module) -> list[nn.Module | None]:
    """Per transformer block, the module whose weights the AdaLN tables serve, None where FSDP2 gathers them:
    where `model.fsdp.serves_tables` (the key, a shard group of more than one rank, no CPU offload), the
    projections `model.adaln_tables.table_projections` serves (not a DoRA-adapted one)."""
    from ..model.adaln_tables import table_projections
    from ..model.fsdp import serves_tables

    blocks = transformer.transformer_blocks
    S = dims.shard_size
    if not serves_tables(dims.dp_replicate * S, S, cfg.parallel.adaln_tables, cfg.parallel.cpu_offload):
        return [None] * len(blocks)
    served = {id(modulation): layer for modulation, layer in table_projections(transformer)}
    return [served.get(id(block.adaln_proj)) for block in blocks]


def _gather_dtype(param: torch.Tensor, policy: torch.dtype) -> torch.dtype:
    # FSDP2 casts a floating parameter to the policy's param_dtype; any other keeps its own.
    return policy if param.dtype.is_floating_point else param.dtype


def _padded_shard_numel(param: torch.Tensor, shard_size: int) -> int:
    """Elements of one rank's shard of `param`, dim 0 padded to a multiple of the shard size (FSDP2's)."""
    shape = tuple(param.shape) or (1,)
    return -(-shape[0] // shard_size) * math.prod(shape[1:])


def _unit(name: str, block: bool, params: Iterable[torch.Tensor], policy: torch.dtype, shard_size: int, reshards: bool):
    gathered = reduced = 0
    for p in params:
        numel = _padded_shard_numel(p, shard_size)
        dtype = _gather_dtype(p, policy)
        gathered += numel * dtype.itemsize
        if p.requires_grad:
            # The policy's float32 reduce dtype, unless it is the param dtype itself: then the gradient's own.
            reduced += numel * (_FP32 if policy != torch.float32 else dtype.itemsize)
    return UnitTraffic(name, block, gathered, reduced, reshards)


def fsdp_units(
    transformer: nn.Module,
    compute_dtype: torch.dtype,
    shard_size: int,
    mesh_size: int,
    served: Sequence[nn.Module | None] = (),
) -> tuple[UnitTraffic, ...]:
    """The FSDP2 units of `model/fsdp.py`'s plan over `transformer` (the diffusers model, real or meta):
    each refiner block, each transformer block (less the projection the tables serve, `served`: one per
    block or none, `served_projections`), the float32 islands, the root (the rest). `mesh_size`: ranks of
    the FSDP2 mesh (R x S); on one, no unit reshards after forward."""
    from ..model.build import fp32_island_names

    one_rank = mesh_size == 1
    ignored = {id(p) for layer in served if layer is not None for p in layer.parameters(recurse=False)}
    blocks = [
        *((f"refiner_blocks.{i}", b) for i, b in enumerate(transformer.token_refiner.refiner_blocks)),
        *((f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)),
    ]
    units, taken = [], set(ignored)
    for i, (name, block) in enumerate(blocks):
        last = i == len(blocks) - 1
        params = [p for p in block.parameters() if id(p) not in ignored]
        taken.update(id(p) for p in params)
        units.append(_unit(name, True, params, compute_dtype, shard_size, not (last or one_rank)))
    islands = [p for n in fp32_island_names(transformer) for p in getattr(transformer, n).parameters()]
    taken.update(id(p) for p in islands)
    units.append(_unit("islands", False, islands, torch.float32, shard_size, False))
    rest = [p for p in transformer.parameters() if id(p) not in taken]
    units.append(_unit("root", False, rest, compute_dtype, shard_size, False))
    return tuple(units)


def table_shape(layer: nn.Module, transformer: nn.Module, shard_size: int, shard_rank: int) -> TableShape:
    """The served projection `layer` of a block of `transformer`, as rank `shard_rank` of the shard group holds it."""
    rows, in_features = layer.out_features, layer.in_features
    c = -(-rows // shard_size)
    local = max(0, min(c, rows - shard_rank * c))
    weight = getattr(layer, "weight", None) if isinstance(layer, nn.Linear) else None
    trains = weight is not None and weight.requires_grad
    embedding = any(p.requires_grad for p in transformer.time_embedder.parameters())
    return TableShape(rows, in_features, local, trains, weight.dtype.itemsize if trains else 0, embedding)


def grad_norm_bytes(transformer: nn.Module) -> int:
    """Bytes of the gradient norm's all-reduce (`parallel.shards.global_norm`): the sum of the squares of this
    rank's shards, one value, float64 where a trainable parameter is float64, else float32."""
    wide = any(p.dtype == torch.float64 for p in transformer.parameters() if p.requires_grad)
    return 8 if wide else 4


# -- the groups and their links -------------------------------------------------------------------------

_GROUP_DIMS = {
    "sp": ("sp",),
    "dp_shard_sp": ("dp_shard", "sp"),
    "dp_replicate": ("dp_replicate",),
    "dp": ("dp_replicate", "dp_shard"),
    "world": ("dp_replicate", "dp_shard", "sp"),
}


def group_size(group: str, dims: ParallelDims) -> int:
    sizes = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "sp": dims.sp}
    return math.prod(sizes[d] for d in _GROUP_DIMS[group])


def group_link(group: str, dims: ParallelDims, ranks_per_node: int) -> str:
    """`intra_node` when every group of this name on the mesh `(dp_replicate, dp_shard, sp)` (ranks laid
    out row-major, node by node) lies within one node, else `inter_node`."""
    shape = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "sp": dims.sp}
    mesh = torch.arange(dims.world_size).view(dims.dp_replicate, dims.dp_shard, dims.sp)
    varying = [i for i, d in enumerate(shape) if d in _GROUP_DIMS[group]]
    fixed = [i for i in range(3) if i not in varying]
    groups = mesh.permute(*fixed, *varying).reshape(-1, math.prod(mesh.shape[i] for i in varying))
    nodes = groups // max(1, ranks_per_node)
    return "intra_node" if bool((nodes == nodes[:, :1]).all()) else "inter_node"


# -- the forwards of a step -----------------------------------------------------------------------------


def planned_forwards(cfg: Config, dims: ParallelDims) -> tuple[ForwardShape, ...]:
    """The forwards of one step as planned from `cfg`: `train.grad_accum` micro-batches of the longest
    planned rows (`config_sample_rows`), each after its CFG negative (no gradient, the same rows: its
    prompt " " is not longer) when `cfg.scale` (or a modality's) is not 1. Table rows: `table_rows` of one
    sample, or under `data.pack` of the samples a pack holds on average (`train.global_batch` over the
    step's micro-batches)."""
    from ..model.adaln_tables import table_rows
    from ..objective import cfg_enabled
    from .inputs import config_sample_rows

    rows = config_sample_rows(cfg)[0]
    accum = cfg.train.grad_accum
    samples = 1
    if cfg.data.pack and cfg.train.global_batch:
        samples = max(1, -(-cfg.train.global_batch // (dims.dp * accum)))
    exchanged = table_rows(samples)
    negative = (ForwardShape(rows, exchanged, False),) if cfg_enabled(cfg.cfg) else ()
    return (*negative, ForwardShape(rows, exchanged, True)) * accum


def planned_policies(cfg: Config, dims: ParallelDims, num_layers: int) -> tuple[str, ...]:
    """The blocks' policies as the run on CUDA takes them (`run.blueprint.draw`): the
    configured one, or under `auto` the memory plan's choice."""
    mode = cfg.model.activation_checkpointing
    if mode != "auto":
        return (mode,) * num_layers
    from ..model.architecture import planned_model_dims
    from .inputs import estimate

    return tuple(estimate(planned_model_dims(cfg)[0], dims, cfg, device="cuda").policies)


# -- the step -------------------------------------------------------------------------------------------


@dataclass
class _Tally:
    """Exchanges being summed, one per (what, kind, group, phase, hidden)."""

    dims: ParallelDims
    ranks_per_node: int
    found: dict[tuple[str, str, str, str, bool], list[int]] = field(default_factory=dict)

    def add(
        self, what: str, kind: str, group: str, phase: str, tensor_bytes: int, calls: int = 1, hidden: bool = False
    ):
        if calls <= 0:
            return
        sent, received = wire_bytes(kind, group_size(group, self.dims), tensor_bytes)
        entry = self.found.setdefault((what, kind, group, phase, hidden), [0, 0, 0])
        entry[0] += calls
        entry[1] += calls * sent
        entry[2] += calls * received

    def exchanges(self) -> tuple[Exchange, ...]:
        return tuple(
            Exchange(
                what,
                kind,
                group,
                group_size(group, self.dims),
                group_link(group, self.dims, self.ranks_per_node),
                phase,
                calls,
                sent,
                received,
                hidden,
            )
            for (what, kind, group, phase, hidden), (calls, sent, received) in self.found.items()
        )


def _table_exchanges(tally: _Tally, tables: Sequence[TableShape], f: ForwardShape, shard_size: int, b: int) -> None:
    """The served blocks' table exchanges in forward `f`, all blocks in one (`b` bytes per element of the
    compute dtype)."""
    if not tables:
        return
    rows, d = f.table_rows, tables[0].in_features
    c = -(-tables[0].rows // shard_size)
    embeddings, exchanged = rows * d * b, shard_size * rows * len(tables) * c * b
    tally.add("table embeddings all-gather", "all_gather", "dp_shard_sp", "forward", embeddings)
    tally.add("table all-to-all", "all_to_all", "dp_shard_sp", "forward", exchanged)
    if not f.grad or not any(t.weight_trains or t.embedding_trains for t in tables):
        return
    # Backward: the table gradients back; the embeddings' gradients when the time embedding trains.
    tally.add("table gradient all-to-all", "all_to_all", "dp_shard_sp", "backward", exchanged)
    calls = int(tables[0].embedding_trains)
    tally.add("table embeddings reduce-scatter", "reduce_scatter", "dp_shard_sp", "backward", embeddings, calls)


def _table_replica_reductions(tally: _Tally, table: TableShape) -> None:
    """One served block's HSDP all-reduces, once a step: its weight's and its bias's accumulated local
    gradients (float32 at least)."""
    wide = max(table.weight_bytes, _FP32)
    d = table.in_features
    tally.add("table weight all-reduce", "all_reduce", "dp_replicate", "backward", table.local_rows * d * wide)
    tally.add("table bias all-reduce", "all_reduce", "dp_replicate", "backward", table.local_rows * wide)


def step_traffic(
    cfg: Config,
    dims: ParallelDims,
    *,
    ranks_per_node: int,
    forwards: Sequence[ForwardShape] | None = None,
    policies: Sequence[str] | None = None,
    shard_rank: int = 0,
    transformer: nn.Module | None = None,
) -> StepTraffic:
    """Every collective one rank issues in one optimizer step of `cfg` on the mesh `dims` (module docstring).

    `forwards`: the rank's forwards in the step, in order (None: `planned_forwards`); `policies`: each
    transformer block's recompute policy (None: `planned_policies`); `shard_rank`: the rank's index in its
    shard group (its rows of the AdaLN projections: the last ranks may hold fewer); `transformer`: the
    model as built (None: `planned_transformer`, on the meta device).
    """
    transformer = planned_transformer(cfg) if transformer is None else transformer
    forwards = planned_forwards(cfg, dims) if forwards is None else tuple(forwards)
    layers = len(transformer.transformer_blocks)
    policies = planned_policies(cfg, dims, layers) if policies is None else tuple(policies)
    if len(policies) != layers:
        raise ValueError(f"{len(policies)} block policies for {layers} transformer blocks")
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    b = compute.itemsize
    S, R, sp = dims.shard_size, dims.dp_replicate, dims.sp
    mesh_size = R * S
    served = served_projections(cfg, dims, transformer)
    tables = any(layer is not None for layer in served)
    units = fsdp_units(transformer, compute, S, mesh_size, served)
    tally = _Tally(dims, ranks_per_node)
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    out_width = transformer.proj_out.out_features + transformer.audio_proj_out.out_features
    recomputed = sum(p != "none" for p in policies)
    served_tables = [table_shape(layer, transformer, S, shard_rank) for layer in served if layer is not None]

    backwards = 0
    for f in forwards:
        # FSDP2: every unit gathers; after a backward every unit with gradients reduce-scatters.
        if S > 1:
            for u in units:
                tally.add("fsdp all-gather", "all_gather", "dp_shard_sp", "forward", u.gathered, hidden=u.block)
                if f.grad:
                    tally.add(
                        "fsdp all-gather", "all_gather", "dp_shard_sp", "backward", u.gathered, int(u.reshards), u.block
                    )
                    tally.add(
                        "fsdp reduce-scatter",
                        "reduce_scatter",
                        "dp_shard_sp",
                        "backward",
                        u.reduced,
                        int(u.reduced > 0),
                        u.block,
                    )
        backwards += f.grad
        if sp > 1:
            local = -(-f.rows // sp)
            qkv, out = 3 * local * width * b, local * width * b
            for phase, calls in (("forward", layers), ("backward", (layers + recomputed) if f.grad else 0)):
                tally.add("ulysses q/k/v all-to-all", "all_to_all", "sp", phase, qkv, calls)
                tally.add("ulysses output all-to-all", "all_to_all", "sp", phase, out, calls)
            tally.add("sp output rows all-gather", "all_gather", "sp", "forward", local * out_width * _FP32)
        _table_exchanges(tally, served_tables, f, S, b)
    if R > 1 and backwards:
        for table in served_tables:
            if table.weight_trains:
                _table_replica_reductions(tally, table)
        for u in units:
            # Once a step: FSDP2 all-reduces across replicas only on the last micro-batch.
            tally.add(
                "hsdp all-reduce", "all_reduce", "dp_replicate", "backward", u.reduced, int(u.reduced > 0), u.block
            )
    if mesh_size > 1:
        tally.add("grad-norm all-reduce", "all_reduce", "dp_shard_sp", "step", grad_norm_bytes(transformer))
    tally.add("step all-reduce", "all_reduce", "world", "step", STEP_VALUES * 8)
    return StepTraffic(tally.exchanges(), units, S, tables)
