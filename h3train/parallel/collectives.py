"""Counting the collectives a step issues, and how many the FSDP2 plan should issue.

`count_collectives()` wraps the `torch.distributed` entry points and the functional collectives'
module functions (FSDP2 and DTensor call them through their modules, so wrapping the module
attributes sees every call) and, optionally, the `torch.ops._c10d_functional` ops (which Ulysses'
autograd all-to-all issues) through a dispatch mode. Each call is counted once, at its outermost
entry point (`all_gather_single` may call `all_gather_into_tensor`: only the outer call counts).

Counted per process (one rank); a collective is issued by every rank of its group, so the count of
one rank is the count per step.

Each call is also recorded (`CollectiveCounts.calls`, a `CollectiveCall`): its kind, its process group by
name (`mesh_groups` names a run's groups after their mesh dims) and size, and the bytes of the tensor
that sizes it, hence the bytes one rank sends and receives for it (`wire_bytes`).
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from .dims import ParallelContext

# torch.distributed function -> the kind it is counted as.
DIST_KINDS: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
    "all_gather_object": "object",
    "broadcast_object_list": "object",
    "barrier": "barrier",
}
# The functional collectives DTensor calls through its module (`funcol.all_reduce(...)`): a grad
# norm over DTensors, `.full_tensor()`.
FUNCOL_KINDS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
# `_c10d_functional` ops (without overload) -> kind: what Ulysses' autograd all-to-all issues.
OP_KINDS: dict[str, str] = {
    "all_to_all_single": "all_to_all",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
}
# The `torch.distributed` entry points FSDP2 issues its unit collectives through.
FSDP_ENTRIES = {
    "all_gather": ("dist.all_gather_single", "dist.all_gather_into_tensor", "dist._all_gather_base"),
    "reduce_scatter": ("dist.reduce_scatter_single", "dist.reduce_scatter_tensor", "dist._reduce_scatter_base"),
}


def wire_bytes(kind: str, group_size: int, tensor_bytes: int) -> tuple[int, int]:
    """`(sent, received)` bytes of one rank in one collective call of `group_size` ranks, as a ring moves it.

    `tensor_bytes` b is, per kind: `all_gather` the rank's input (its share), `reduce_scatter` the rank's
    output (its share), `all_reduce` the reduced tensor, `all_to_all` the rank's whole send buffer,
    `broadcast` the broadcast tensor. With n ranks: all-gather and reduce-scatter (n - 1) b each way
    (n - 1 steps of one share); all-to-all (n - 1) b / n (all but the rank's own chunk); all-reduce a
    reduce-scatter then an all-gather of b / n chunks, 2 (n - 1) b / n; broadcast pipelined over a chain,
    (n - 1) b over n ranks, (n - 1) b / n per rank on average (the root only sends, the last rank only
    receives). Integer division, floor. A group of one rank moves nothing.
    """
    n, b = group_size, tensor_bytes
    if n <= 1:
        return 0, 0
    if kind in ("all_gather", "reduce_scatter"):
        moved = (n - 1) * b
    elif kind in ("all_to_all", "broadcast"):
        moved = (n - 1) * b // n
    elif kind == "all_reduce":
        moved = 2 * (n - 1) * b // n
    else:
        raise ValueError(f"no wire bytes for a collective of kind {kind!r}")
    return moved, moved


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call of this rank: its `entry` (as `CollectiveCounts` keys it), `kind`, process
    `group` (a name of `mesh_groups`, else the group's own name) of `group_size` ranks and the bytes of
    the tensor `wire_bytes` is sized by (`tensor_bytes`; 0 for object collectives and barriers)."""

    entry: str
    kind: str
    group: str
    group_size: int
    tensor_bytes: int

    @property
    def wire(self) -> tuple[int, int]:
        """`(sent, received)` bytes of this call (`wire_bytes`); none for object collectives and barriers."""
        if self.kind in ("object", "barrier"):
            return 0, 0
        return wire_bytes(self.kind, self.group_size, self.tensor_bytes)


class CollectiveCounts(Counter):
    """Calls by entry point: `dist.<fn>` (torch.distributed), `funcol.<fn>` (functional collectives
    called through their module, as DTensor does) and `op.<name>` (`_c10d_functional` ops).

    `calls`: every call in order (`CollectiveCall`), with its group and bytes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[CollectiveCall] = []

    def per_group(self) -> dict[str, tuple[int, int]]:
        """`(sent, received)` bytes of this rank by process group, over every recorded call."""
        out: dict[str, tuple[int, int]] = {}
        for call in self.calls:
            sent, received = out.get(call.group, (0, 0))
            wire = call.wire
            out[call.group] = (sent + wire[0], received + wire[1])
        return out

    def per_group_kind(self) -> dict[tuple[str, str], tuple[int, int]]:
        """`(calls, sent bytes)` of this rank by `(group, kind)`."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for call in self.calls:
            calls, sent = out.get((call.group, call.kind), (0, 0))
            out[(call.group, call.kind)] = (calls + 1, sent + call.wire[0])
        return out

    def kind(self, kind: str) -> int:
        """Calls of one kind (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`, ...) by any entry."""
        tables = {"dist": DIST_KINDS, "funcol": FUNCOL_KINDS, "op": OP_KINDS}
        return sum(n for key, n in self.items() if tables[key.split(".")[0]].get(key.split(".", 1)[1]) == kind)

    def fsdp(self) -> dict[str, int]:
        """FSDP2's all-gathers and reduce-scatters (the tensor APIs of `torch.distributed`)."""
        return {kind: sum(self[e] for e in entries) for kind, entries in FSDP_ENTRIES.items()}


# torch.distributed function -> the argument holding the tensor whose bytes size the call (`wire_bytes`).
_DIST_SIZING: dict[str, str] = {
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "all_gather": "tensor",
    "_all_gather_base": "input_tensor",
    "reduce_scatter_tensor": "output",
    "reduce_scatter_single": "output",
    "reduce_scatter": "output",
    "_reduce_scatter_base": "output",
    "all_reduce": "tensor",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "broadcast": "tensor",
}


def _nbytes(t: torch.Tensor | list[torch.Tensor]) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def process_group(group: object) -> ProcessGroup:
    """The `ProcessGroup` a collective's `group` argument names: None (the default group), a group, a
    group name (`_c10d_functional` ops), a `(mesh, dim)` pair or a 1-D mesh (functional collectives)."""
    if group is None:
        return dist.distributed_c10d._get_default_group()
    if isinstance(group, ProcessGroup):
        return group
    return dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))


def mesh_groups(ctx: ParallelContext) -> dict[str, ProcessGroup]:
    """A run's process groups by the names the traffic count gives them (`plan.traffic`), the first name of
    a group several names share first: `sp`, `dp_shard_sp` (the FSDP2 shard group), `dp_replicate`,
    `dp` and `world` (the default group)."""
    dims = ctx.dims
    groups: dict[str, ProcessGroup] = {}
    if dims.sp > 1:
        groups["sp"] = ctx.mesh["sp"].get_group()
    groups["dp_shard_sp"] = ctx.fsdp_mesh.get_group(ctx.fsdp_mesh.ndim - 1)
    if dims.dp_replicate > 1:
        groups["dp_replicate"] = ctx.mesh["dp_replicate"].get_group()
    groups["dp"] = ctx.dp_mesh.get_group()
    groups["world"] = dist.distributed_c10d._get_default_group()
    return groups


class GroupNames:
    """Names process groups by `groups` (`mesh_groups`): the first name held by the very group object,
    else the first whose group has its name, else the first whose group has its ranks (a group of another
    mesh over the same ranks: DTensor may redistribute over the mesh of an earlier, equal one); else
    `world` for the default group, or the group's own name."""

    def __init__(self, groups: Mapping[str, ProcessGroup] | None = None) -> None:
        self.groups = dict(groups or {})

    def __call__(self, group: ProcessGroup) -> str:
        for name, known in self.groups.items():
            if known is group:
                return name
        for name, known in self.groups.items():
            if known.group_name == group.group_name:
                return name
        ranks = dist.get_process_group_ranks(group)
        for name, known in self.groups.items():
            if dist.get_process_group_ranks(known) == ranks:
                return name
        if group is dist.distributed_c10d._get_default_group():
            return "world"
        return str(group.group_name)


def _call(entry: str, kind: str, group: object, tensor_bytes: int, names: GroupNames, scatter: bool) -> CollectiveCall:
    """The `CollectiveCall` of one call; `scatter`: `tensor_bytes` is the whole input of a reduce-scatter,
    of which each rank's share sizes the call."""
    pg = process_group(group)
    size = pg.size()
    return CollectiveCall(entry, kind, names(pg), size, tensor_bytes // size if scatter else tensor_bytes)


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts, depth: threading.local, names: GroupNames) -> None:
        super().__init__()
        self.counts, self.depth, self.names = counts, depth, names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in OP_KINDS and not getattr(self.depth, "value", 0):
            self.counts[f"op.{name}"] += 1
            # Every one of these ops takes its input first and its group's name last.
            kind = OP_KINDS[name]
            call = _call(f"op.{name}", kind, args[-1], _nbytes(args[0]), self.names, kind == "reduce_scatter")
            self.counts.calls.append(call)
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collectives(
    functional: bool = False, groups: Mapping[str, ProcessGroup] | None = None
) -> Iterator[CollectiveCounts]:
    """Count and record the collectives issued inside the block (`CollectiveCounts`, its `calls`).

    `functional=True` also counts `torch.ops._c10d_functional` collectives issued outside the
    wrapped entry points (Ulysses' all-to-alls, in forward and in backward) with a dispatch mode on
    this thread, which slows every op a little. A call is counted once, at its outermost entry.
    `groups` names the process groups the calls are recorded under (`mesh_groups`, `GroupNames`).
    """
    counts = CollectiveCounts()
    depth = threading.local()
    names = GroupNames(groups)

    def record(fn, key: str, args: tuple, kwargs: dict) -> CollectiveCall:
        prefix, name = key.split(".", 1)
        if prefix == "funcol":
            bound = inspect.signature(fn).bind(*args, **kwargs)
            kind = FUNCOL_KINDS[name]
            tensor = bound.arguments["self"]
            return _call(key, kind, bound.arguments["group"], _nbytes(tensor), names, kind == "reduce_scatter")
        kind = DIST_KINDS[name]
        bound = inspect.signature(fn).bind(*args, **kwargs)
        group = bound.arguments.get("group")
        sizing = _DIST_SIZING.get(name)
        return _call(key, kind, group, _nbytes(bound.arguments[sizing]) if sizing else 0, names, False)

    def wrap(fn, key: str):
        @wraps(fn)
        def counted(*args, **kwargs):
            outer = not getattr(depth, "value", 0)
            depth.value = getattr(depth, "value", 0) + 1
            try:
                if outer:
                    counts[key] += 1
                    counts.calls.append(record(fn, key, args, kwargs))
                return fn(*args, **kwargs)
            finally:
                depth.value -= 1

        return counted

    patched = [(dist, name, "dist") for name in DIST_KINDS if hasattr(dist, name)]
    patched += [(funcol, name, "funcol") for name in FUNCOL_KINDS if hasattr(funcol, name)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, prefix in patched:
            setattr(module, name, wrap(getattr(module, name), f"{prefix}.{name}"))
        with ExitStack() as stack:
            if functional:
                stack.enter_context(_OpCounter(counts, depth, names))
            yield counts
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def fsdp_units(num_layers: int, num_refiner_layers: int) -> int:
    """FSDP2 units of `model/fsdp.py`'s plan: every block, one for the float32 islands, the root."""
    return num_layers + num_refiner_layers + 2


def fsdp_collectives_per_step(num_layers: int, num_refiner_layers: int, shard_size: int) -> dict[str, int]:
    """All-gathers and reduce-scatters of one micro-batch's forward and backward under the plan.

    On a mesh of `shard_size` 1 torch issues none. Otherwise every unit gathers in forward; in
    backward only the blocks that resharded after forward gather again (all but the last block);
    every unit reduce-scatters its gradients.
    """
    if shard_size == 1:
        return {"all_gather": 0, "reduce_scatter": 0}
    units = fsdp_units(num_layers, num_refiner_layers)
    return {"all_gather": units + num_layers + num_refiner_layers - 1, "reduce_scatter": units}


def functional_all_to_alls_per_step(num_layers: int, sp: int) -> int:
    """Ulysses all-to-alls of one micro-batch: per block one q/k/v and one back, forward and backward."""
    return 0 if sp == 1 else 4 * num_layers
