"""A checkpoint's save and load plans across every rank, from DCP's own planners, nothing written: what the
rehearsal reports of a save (`plan_save`) and of a resume at another world size (`plan_load`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ...optim.kinds import optimizer_kind
from ...plan import GIB


@dataclass
class SavePlanSummary:
    """DCP's save plan of one checkpoint across every rank: after `DefaultSavePlanner`'s de-duplication
    of replicated items, each rank's items and tensor bytes, and the files FileSystemWriter writes."""

    world_size: int
    items_per_rank: list[int]
    bytes_per_rank: list[int]
    metadata: Metadata
    # Tensors the checkpoint keys (flattened FQNs) and non-tensor entries (pickled by DCP).
    tensors: int = 0
    objects: int = 0
    # (FQN, chunk offsets) -> the rank whose file holds it (`__<rank>_0.distcp`).
    writers: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)

    @property
    def files(self) -> int:
        """`.distcp` files: FileSystemWriter opens one per rank (single_file_per_rank), data or not."""
        return self.world_size

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_rank)


_COORDINATES: dict[int, tuple[Any, dict[int, tuple[int, ...]]]] = {}


def _coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Rank -> its coordinate in `mesh` (a DeviceMesh; its rank layout is a real tensor)."""
    cached = _COORDINATES.get(id(mesh))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    layout = mesh.mesh.tolist()
    out: dict[int, tuple[int, ...]] = {}

    def walk(node: Any, coord: tuple[int, ...]) -> None:
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, (*coord, i))
        else:
            out[int(node)] = coord

    walk(layout, ())
    _COORDINATES[id(mesh)] = (mesh, out)
    return out


def _chunk(shape: torch.Size, mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: Any) -> tuple:
    """(offsets, sizes) of the DTensor chunk at mesh coordinate `coord`: `torch.chunk` along each Shard dim."""
    sizes, offsets = list(shape), [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            d, n = placement.dim, mesh_shape[mesh_dim]
            step = -(-sizes[d] // n)
            begin = min(coord[mesh_dim] * step, sizes[d])
            size = max(0, min(sizes[d], begin + step) - begin)
            offsets[d] += begin
            sizes[d] = size
    return tuple(offsets), tuple(sizes)


def _value_bytes(value: Any, numel: int, optimizer: str) -> int:
    """Bytes DCP writes for `numel` values of `value`'s kind: torchao's quantized states (`OptimState*`,
    one moment) by the optimizer kind's `state_bytes`, which counts both."""
    # The inner tensor itself: `to_local` would dispatch an op per call.
    local = value._local_tensor if isinstance(value, DTensor) else value
    if type(local).__name__.startswith("OptimState"):
        return optimizer_kind(optimizer).state_bytes(numel) // 2
    return numel * local.dtype.itemsize


def _rank_plans(planner: DefaultSavePlanner, local: SavePlan, world: int) -> list[SavePlan]:
    """Every rank's local plan from rank 0's: a DTensor's chunk moved to each rank's coordinate."""
    flat = planner.state_dict
    plans = []
    for rank in range(world):
        items = []
        for item in local.items:
            value = flat.get(item.index.fqn)
            if rank == 0 or item.type != WriteItemType.SHARD or not isinstance(value, DTensor):
                items.append(item)
                continue
            coord = _coordinates(value.device_mesh)[rank]
            offsets, sizes = _chunk(value.shape, tuple(value.device_mesh.shape), coord, value.placements)
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=item.tensor_data.properties,
                size=item.tensor_data.size,
            )
            items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=item.type, tensor_data=data))
        plans.append(dataclasses.replace(local, items=items))
    return plans


def plan_save(state: dict[str, Any], optimizer: str) -> SavePlanSummary:
    """DCP's save plan of `state` on every rank of the default group (no file written).

    Rank 0's local plan is DCP's own (`DefaultSavePlanner.create_local_plan`); the others' are its items
    with each DTensor chunk at that rank's mesh coordinate; `create_global_plan` then de-duplicates
    the replicated items and validates that the chunks tile every tensor, as a real save does.
    """
    world = dist.get_world_size()
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
    local = planner.create_local_plan()
    # Rank 0's arithmetic must reproduce DCP's own chunk for it.
    for item in local.items:
        value = planner.state_dict.get(item.index.fqn)
        if item.type == WriteItemType.SHARD and isinstance(value, DTensor):
            coord = _coordinates(value.device_mesh)[0]
            offsets, sizes = _chunk(value.shape, tuple(value.device_mesh.shape), coord, value.placements)
            if tuple(item.tensor_data.chunk.sizes) != sizes or tuple(item.tensor_data.chunk.offsets) != offsets:
                raise RuntimeError(f"chunk arithmetic disagrees with DCP for {item.index.fqn}")
    global_plans, metadata = planner.create_global_plan(_rank_plans(planner, local, world))
    items, nbytes, writers = [], [], {}
    for rank, plan in enumerate(global_plans):
        items.append(len(plan.items))
        total = 0
        for item in plan.items:
            writers[(item.index.fqn, tuple(item.index.offset or ()))] = rank
            if item.tensor_data is not None:
                numel = math.prod(item.tensor_data.chunk.sizes)
                total += _value_bytes(planner.state_dict[item.index.fqn], numel, optimizer)
        nbytes.append(total)
    tensors = sum(1 for v in planner.state_dict.values() if isinstance(v, torch.Tensor))
    return SavePlanSummary(world, items, nbytes, metadata, tensors, len(planner.state_dict) - tensors, writers)


@dataclass
class LoadPlanSummary:
    """DCP's load plan on every rank of a run resuming a checkpoint saved at another world size."""

    saved_world_size: int
    world_size: int
    reads_per_rank: list[int]
    bytes_per_rank: list[int]
    files_per_rank: list[int]
    # Keys of the loading run's state found in the checkpoint, and those missing from it.
    keys: int
    missing: list[str]
    # Tensor bytes the checkpoint holds (its save plan's, all ranks together).
    saved_bytes: int = 0


def format_load_plan(p: LoadPlanSummary) -> str:
    """One line per fact of a resume's load plan."""
    return "\n".join(
        [
            f"resume        a checkpoint saved by {p.saved_world_size} ranks ({p.saved_bytes / GIB:.2f} GiB), "
            f"loaded by {p.world_size}: {p.keys:,} keys found, {len(p.missing)} missing",
            f"              per rank {min(p.reads_per_rank):,}-{max(p.reads_per_rank):,} reads from "
            f"{min(p.files_per_rank)}-{max(p.files_per_rank)} files, {min(p.bytes_per_rank) / GIB:.2f}-"
            f"{max(p.bytes_per_rank) / GIB:.2f} GiB; {sum(p.bytes_per_rank) / GIB:.2f} GiB in all",
        ]
    )


def plan_load(state: dict[str, Any], save: SavePlanSummary, optimizer: str) -> LoadPlanSummary:
    """DCP's load plan of `state` from the checkpoint `save` plans, on every rank of the default group.

    Rank 0's plan is `DefaultLoadPlanner.create_local_plan`'s; each other rank's reads come from DCP's
    `create_read_items_for_chunk_list` for its DTensor chunks. Every rank's chunk of every tensor
    must be covered exactly by the saved chunks it reads (else `RuntimeError` naming the key). Files:
    the saving ranks' whose chunks a rank reads.
    """
    world, metadata = dist.get_world_size(), save.metadata
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=True)
    planner.create_local_plan()  # DCP's own plan for rank 0: raises on a key the checkpoint lacks
    flat = planner.state_dict
    missing = sorted(k for k in flat if k not in metadata.state_dict_metadata)
    reads, nbytes, files = [], [], []
    for rank in range(world):
        count = total = 0
        touched: set[int] = set()
        for fqn, value in flat.items():
            md = metadata.state_dict_metadata.get(fqn)
            if md is None or not isinstance(value, torch.Tensor):
                if md is not None:
                    count += 1
                    touched.add(save.writers.get((fqn, ()), 0))
                continue
            if isinstance(value, DTensor):
                coord = _coordinates(value.device_mesh)[rank]
                offsets, sizes = _chunk(value.shape, tuple(value.device_mesh.shape), coord, value.placements)
            else:
                offsets, sizes = (0,) * value.dim(), tuple(value.shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items = create_read_items_for_chunk_list(fqn, md, [chunk]) if math.prod(sizes) else []
            covered = sum(math.prod(item.lengths) for item in items)
            if covered != math.prod(sizes):
                raise RuntimeError(
                    f"rank {rank}: the checkpoint covers {covered} of {math.prod(sizes)} values of {fqn}"
                )
            count += len(items)
            total += _value_bytes(value, covered, optimizer)
            for item in items:
                index = item.storage_index
                touched.add(save.writers[(index.fqn, tuple(index.offset or ()))])
        reads.append(count)
        nbytes.append(total)
        files.append(len(touched))
    return LoadPlanSummary(save.world_size, world, reads, nbytes, files, len(flat) - len(missing), missing)
