"""The 3-axis mesh `(dp_replicate, dp_shard, sp)` and every group the trainer reduces over.

- Parameters shard over `dp_shard x sp` (one flattened axis); with `dp_replicate > 1` they are
  replicated across it (HSDP).
- Samples differ across `dp_replicate x dp_shard` (the data-parallel rank); every SP rank of a DP
  group sees the identical sample, noise and timesteps.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ParallelConfig
from ..errors import ConfigError, UsageError
from .averaging import Averaging, check_averaging


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    sp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve `dp_shard = -1` and check that the product is the world size.

        A process started without a launcher (no `WORLD_SIZE`) is one rank: a mesh that needs more
        is told to start under torchrun.
        """
        dp_shard = cfg.dp_shard
        fixed = cfg.dp_replicate * cfg.sp
        needed = fixed * max(dp_shard, 1)
        if world_size == 1 and needed > 1 and "WORLD_SIZE" not in os.environ:
            raise UsageError(
                f"config key 'parallel' (dp_replicate={cfg.dp_replicate}, dp_shard={dp_shard}, sp={cfg.sp}) "
                f"needs {needed} ranks but this process runs alone: launch it with "
                f"'torchrun --nproc_per_node={needed} -m h3train ...' or scripts/launch.sh "
                "('h3train check' takes --world-size)"
            )
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"config key 'parallel.dp_shard' = -1 cannot be inferred: world size {world_size} is not "
                    f"divisible by dp_replicate*sp = {fixed}"
                )
            dp_shard = world_size // fixed
        if cfg.dp_replicate * dp_shard * cfg.sp != world_size:
            raise ConfigError(
                f"config key 'parallel' gives a mesh dp_replicate*dp_shard*sp = {cfg.dp_replicate}*{dp_shard}*"
                f"{cfg.sp} = {cfg.dp_replicate * dp_shard * cfg.sp}, but the world size is {world_size}; "
                "set parallel.dp_shard=-1 or change the launch"
            )
        return cls(cfg.dp_replicate, dp_shard, cfg.sp, world_size)

    @property
    def dp(self) -> int:
        """Number of distinct samples per micro-batch across the job."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is sharded over."""
        return self.dp_shard * self.sp

    def describe(self) -> str:
        return (
            f"mesh (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, sp={self.sp}) = "
            f"{self.world_size} ranks; parameters sharded {self.shard_size}-way"
            + (f", replicated {self.dp_replicate}x (HSDP)" if self.dp_replicate > 1 else "")
            + f"; {self.dp} samples per micro-batch"
        )


class ParallelContext:
    """The built mesh and the groups of this rank."""

    def __init__(self, dims: ParallelDims, device: torch.device) -> None:
        self.dims = dims
        self.device = device
        self.mesh: DeviceMesh = init_device_mesh(
            device.type,
            (dims.dp_replicate, dims.dp_shard, dims.sp),
            mesh_dim_names=("dp_replicate", "dp_shard", "sp"),
        )
        shard = self.mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        self.fsdp_mesh: DeviceMesh = self.mesh["dp_replicate", "dp_shard_sp"] if dims.dp_replicate > 1 else shard
        self.dp_mesh: DeviceMesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.sp_group = self.mesh["sp"].get_group() if dims.sp > 1 else None
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.sp_rank = self.mesh["sp"].get_local_rank()
        self.rank = dist.get_rank()
        # `init_device_mesh` and `_flatten` create their groups with the backend's default timeout
        # (10 min on NCCL, 30 on gloo), and torch 2.8 has no argument to pass another: each group
        # of the mesh gets the default group's, i.e. `parallel.timeout_s` (`init_distributed`).
        timeout = group_timeout()
        for mesh in (self.mesh, shard, self.dp_mesh):
            for group in mesh.get_all_groups():
                for backend in _backends(group):
                    backend._set_default_timeout(timeout)
        # What FSDP2's gradient average really does on these groups (`parallel/averaging.py`).
        groups = {"dp_shard_sp": shard.get_group()}
        if dims.dp_replicate > 1:
            groups["dp_replicate"] = self.mesh["dp_replicate"].get_group()
        self.averaging: Averaging = check_averaging(groups, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def group_timeout(group: ProcessGroup | None = None) -> timedelta | None:
    """The collective timeout of `group` (None: the default group), as its backends hold it (None: no
    backend of it holds one).

    A group with backends for two devices (`cpu:gloo,cuda:nccl`) holds one timeout per backend: the
    shortest is returned, the one a stalled collective meets first.
    """
    group = group if group is not None else dist.group.WORLD
    return min((backend.options._timeout for backend in _backends(group)), default=None)


def _backends(group: ProcessGroup) -> list[dist.Backend]:
    """The backends that run `group`'s collectives and hold a timeout (gloo, NCCL), one per device type.

    Under `TORCH_DISTRIBUTED_DEBUG=DETAIL` each is wrapped in one that checks every collective
    across the ranks first; the timeout is the wrapped backend's. The rehearsal's fake backend
    holds none.
    """
    kinds = tuple(
        getattr(distributed_c10d, name)
        for name in ("ProcessGroupGloo", "ProcessGroupNCCL")
        if hasattr(distributed_c10d, name)
    )
    found = [group._get_backend(device) for device in group._device_types]
    return [inner for backend in found if isinstance(inner := getattr(backend, "wrapped_pg", backend), kinds)]


def new_group(backend: str | None = None, ranks: list[int] | None = None) -> ProcessGroup:
    """A group of `ranks` (None: every rank) on `backend` (None: the default group's), with the
    default group's timeout (`parallel.timeout_s`). Every rank calls it, in the same order.

    `dist.new_group` alone gives the backend's default timeout, not the job's.
    """
    return dist.new_group(ranks=ranks, backend=backend, timeout=group_timeout())


def free_port() -> int:
    """A TCP port of 127.0.0.1 that no process holds at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The rendezvous store of this torchrun attempt, under a prefix of its own.

    After `torchrun --max-restarts` restarts a job, the store can still hold the previous attempt's
    keys, among them the dead ranks' addresses: a restarted rank that reads one of those fails to
    connect. Prefixing every key with the restart count keeps each attempt's keys apart.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and int(os.environ["RANK"]) == 0,
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"h3train/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


# Whether this process joined a process group: its gloo worker threads outlive the group's use
# (`commands.process.exit_after`).
_joined_group = False


def joined_process_group() -> bool:
    """Whether `init_distributed` ran in this process (the group may be destroyed since)."""
    return _joined_group


def init_distributed(backend: str, timeout_s: int, cpu_offload: bool = False) -> tuple[int, torch.device]:
    """Join (or, alone, create) the default process group. Returns `(world_size, device)`.

    Launched alone, a one-rank group is created so that the collectives (the step's all-reduce,
    DCP's planning) run the same way in both cases. With `cpu_offload` on CUDA the group also gets
    a gloo backend for host tensors: offloaded gradients live on the CPU, and the grad norm's
    DTensor reduction runs on them.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("config key 'parallel.backend' is 'nccl' but CUDA is not available; use gloo or auto")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl" and cpu_offload:
        backend = "cpu:gloo,cuda:nccl"
    global _joined_group
    _joined_group = True
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            dist.init_process_group(
                backend,
                store=_attempt_store(timeout),
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
    return dist.get_world_size(), device
