"""Counting the collectives a step issues, and how many the FSDP2 plan should issue.

`count_collectives()` wraps the `torch.distributed` entry points and the functional collectives'
module functions (FSDP2 and DTensor call them through their modules, so wrapping the module
attributes sees every call) and, optionally, the `torch.ops._c10d_functional` ops (which Ulysses'
autograd all-to-all issues) through a dispatch mode. Each call is counted once, at its outermost
entry point (`all_gather_single` may call `all_gather_into_tensor`: only the outer call counts).

Counted per process (one rank); a collective is issued by every rank of its group, so the count of
one rank is the count per step.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import wraps

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

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


class CollectiveCounts(Counter):
    """Calls by entry point: `dist.<fn>` (torch.distributed), `funcol.<fn>` (functional collectives
    called through their module, as DTensor does) and `op.<name>` (`_c10d_functional` ops)."""

    def kind(self, kind: str) -> int:
        """Calls of one kind (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`, ...) by any entry."""
        tables = {"dist": DIST_KINDS, "funcol": FUNCOL_KINDS, "op": OP_KINDS}
        return sum(n for key, n in self.items() if tables[key.split(".")[0]].get(key.split(".", 1)[1]) == kind)

    def fsdp(self) -> dict[str, int]:
        """FSDP2's all-gathers and reduce-scatters (the tensor APIs of `torch.distributed`)."""
        return {kind: sum(self[e] for e in entries) for kind, entries in FSDP_ENTRIES.items()}


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts, depth: threading.local) -> None:
        super().__init__()
        self.counts, self.depth = counts, depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in OP_KINDS and not getattr(self.depth, "value", 0):
            self.counts[f"op.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collectives(functional: bool = False) -> Iterator[CollectiveCounts]:
    """Count the collectives issued inside the block (`CollectiveCounts`).

    `functional=True` also counts `torch.ops._c10d_functional` collectives issued outside the
    wrapped entry points (Ulysses' all-to-alls, in forward and in backward) with a dispatch mode on
    this thread, which slows every op a little. A call is counted once, at its outermost entry.
    """
    counts = CollectiveCounts()
    depth = threading.local()

    def wrap(fn, key: str):
        @wraps(fn)
        def counted(*args, **kwargs):
            outer = not getattr(depth, "value", 0)
            depth.value = getattr(depth, "value", 0) + 1
            try:
                if outer:
                    counts[key] += 1
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
                stack.enter_context(_OpCounter(counts, depth))
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
