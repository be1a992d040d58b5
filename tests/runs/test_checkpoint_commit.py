"""A checkpoint's commit at four ranks: who reads which bytes, and where the staged copy lives.

Four gloo ranks save a small sharded state (a DTensor, one shard per rank, plus a replicated
tensor) with the `Checkpointer` itself: two background saves, one blocking save, then a background
save that one rank cannot read back. Rank 0 counts every read of a file under the checkpoint
folder while each save runs and commits (its `open` wrapped); every rank records where the writer
found the tensors it wrote (the storage of each tensor DCP's planner hands to the file writer).
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from h3train.checkpoint import file_digest_problem, read_trainer_state
from h3train.checkpoint.writer import PLAN_CACHING
from h3train.infra.digest import digest_file

from helpers.launch import checkpoint_tensors
from helpers.ranks import run_ranks

WORLD = 4
# Elements of each rank's shard (float32): 256 KiB, so a shard dwarfs DCP's framing and `.metadata`.
SHARD = 64 * 1024


class _Counted:
    """A file opened for reading whose reads add their bytes to `tally[name]`."""

    def __init__(self, handle: Any, name: str, tally: dict[str, int]) -> None:
        self._handle, self._name, self._tally = handle, name, tally
        tally.setdefault(name, 0)

    def read(self, *args: Any) -> bytes:
        data = self._handle.read(*args)
        self._tally[self._name] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._handle.readinto(buffer)
        self._tally[self._name] += n or 0
        return n

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _counting_reads(root: Path, tally: dict[str, int]) -> tuple[Any, Any]:
    """Wrap this process's `open` so that reads of files under `root` are tallied; returns the originals."""
    real = builtins.open
    root_text = os.path.realpath(root)

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and "r" in mode and "+" not in mode:
            path = os.path.realpath(file)
            if path.startswith(root_text + os.sep):
                return _Counted(handle, os.path.basename(path), tally)
        return handle

    originals = builtins.open, io.open
    builtins.open = io.open = counting_open
    return originals


class _State:
    """One component: this rank's shard of `w` (a DTensor over all ranks) and a replicated `b`."""

    def __init__(self, mesh: Any, rank: int) -> None:
        from torch.distributed.tensor import DTensor, Shard

        local = torch.arange(SHARD, dtype=torch.float32) + rank * SHARD
        self.w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        self.b = torch.full((16,), 7.0)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def _staged_storages(calls: list[list[int]]) -> Any:
    """Wrap DCP's file writer so each save records the storages of the tensors it is about to write."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter
    from torch.distributed.tensor import DTensor

    real = _FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in planner.state_dict.values()]
        calls.append(sorted(t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)))
        return real(self, plan, planner)

    _FileSystemWriter.write_data = write_data


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two background saves (the state changed between them), one blocking save, then a background save
    whose rank 2 cannot read its file back; what rank 0 read, where the writer found the tensors."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    from h3train.checkpoint import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    state = _State(mesh, rank)
    components = {"model": state}
    staged: list[list[int]] = []
    _staged_storages(staged)
    reads: list[dict[str, int]] = []
    info = {"model_config": {}}
    background = Checkpointer(Path(root) / "background", keep_last=0, is_main=rank == 0, async_save=True)
    blocking = Checkpointer(Path(root) / "blocking", keep_last=0, is_main=rank == 0)
    # The coordinator's cached global plan after each save (DCP's save-plan caching): the same object
    # when a save reused the plan before it.
    plans: list[int | None] = []
    for checkpointer, step in ((background, 1), (background, 2), (blocking, 3)):
        tally: dict[str, int] = {}
        originals = _counting_reads(checkpointer.root, tally) if rank == 0 else None
        try:
            checkpointer.save(components, info, step)
            checkpointer.wait_staged()
            # After the copy, the live state may change: the next save must hold the new values.
            state.w.to_local().add_(1000.0)
            checkpointer.wait()
        finally:
            if originals is not None:
                builtins.open, io.open = originals
        reads.append(tally)
        cached = SavePlanner._cached_global_plan.get(checkpointer.plans_key)
        plans.append(None if cached is None else id(cached))
    planning = [list(background.planning_s), list(blocking.planning_s)]
    # Rank 2 cannot read back its own shard: every rank's wait raises, and nothing is committed.
    if rank == 2:
        from h3train.checkpoint import writer

        def unreadable(path: Any) -> str:
            raise OSError(f"Input/output error: '{path}'")

        writer.digest_file = unreadable
    background.save(components, info, 4)
    try:
        background.wait()
        failure = None
    except OSError as exc:
        failure = str(exc)
    background.close()
    blocking.close()
    forgotten = all(c.plans_key not in SavePlanner._cached_global_plan for c in (background, blocking))
    dist.barrier()
    live = sorted({state.w.to_local().untyped_storage().data_ptr(), state.b.untyped_storage().data_ptr()})
    return {
        "reads": reads,
        "staged": staged[:3],
        "live": live,
        "failure": failure,
        "plans": plans,
        "planning": planning,
        "forgotten": forgotten,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("commit")
    return root, run_ranks(_worker, WORLD, str(root))


def _read_by_rank_0(saved: tuple[Path, list[dict[str, Any]]], save: int) -> dict[str, int]:
    return saved[1][0]["reads"][save]


@pytest.mark.parametrize(("save", "folder"), [(0, "background/step_00000001"), (2, "blocking/step_00000003")])
def test_rank_0_reads_only_the_files_it_wrote_at_commit(saved, save: int, folder: str) -> None:
    root, _ = saved
    ckpt = root / folder
    own = {".metadata", "__0_0.distcp"}
    read = _read_by_rank_0(saved, save)
    sizes = {name: (ckpt / name).stat().st_size for name in own}
    # Each of its own files read once, whole; no byte of another rank's shard.
    assert read == sizes, f"rank 0 read {read}; its own files are {sizes}"
    # Every rank's files are recorded all the same, with digests of what is on disk.
    files = read_trainer_state(ckpt)["digests"]["files"]
    assert set(files) == own | {f"__{r}_0.distcp" for r in range(1, WORLD)}
    assert all(digest_file(ckpt / name) == digest for name, digest in files.items())
    assert file_digest_problem(ckpt) is None


def test_a_shard_changed_after_the_commit_is_found(saved, tmp_path) -> None:
    root, _ = saved
    ckpt = Path(shutil.copytree(root / "background/step_00000002", tmp_path / "step_00000002"))
    raw = bytearray((ckpt / "__3_0.distcp").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (ckpt / "__3_0.distcp").write_bytes(bytes(raw))
    problem = file_digest_problem(ckpt)
    assert problem is not None and "__3_0.distcp does not match the digest" in problem


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_background_saves_copy_into_the_same_host_buffers(saved) -> None:
    root, results = saved
    for rank, result in enumerate(results):
        first, second, blocking = result["staged"]
        # The two background saves wrote from one set of host buffers, not from the live tensors.
        assert first == second, f"rank {rank}: the second background save staged into new memory"
        assert not set(first) & set(result["live"]), f"rank {rank}: a background save wrote the live tensors"
        assert blocking == result["live"], f"rank {rank}: a blocking save writes the live tensors"
    # The reused buffers held each save's own values.
    expected = torch.arange(WORLD * SHARD, dtype=torch.float32)
    for step, added in ((1, 0.0), (2, 1000.0), (3, 2000.0)):
        folder = "blocking" if step == 3 else "background"
        w = checkpoint_tensors(root / folder / f"step_{step:08d}", "model.")["w"]
        torch.testing.assert_close(w, expected + added, rtol=0, atol=0)


@pytest.mark.skipif(not PLAN_CACHING, reason="this torch's DCP has no save-plan caching")
def test_the_second_save_reuses_the_first_saves_plan(saved) -> None:
    _, results = saved
    first, second, blocking = results[0]["plans"]
    # Rank 0 coordinates: the second background save took the first one's global plan as it was.
    assert first is not None and first == second
    # The blocking checkpointer planned under a key of its own.
    assert blocking is not None and blocking != first
    for rank, result in enumerate(results):
        background, blocked = result["planning"]
        assert len(background) == 2 and len(blocked) == 1, f"rank {rank}: {result['planning']}"
        assert all(s > 0 for s in background + blocked)
        assert result["forgotten"], f"rank {rank}: a closed checkpointer's plans stay cached"


def test_a_rank_that_cannot_read_its_file_back_fails_the_save_on_every_rank(saved) -> None:
    root, results = saved
    failures = [result["failure"] for result in results]
    assert all(f is not None and f.startswith("rank 2 could not read back") for f in failures), failures
    assert len(set(failures)) == 1
    assert not (root / "background" / "step_00000004").exists()
