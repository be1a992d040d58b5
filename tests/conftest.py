import os
from collections.abc import Iterator

import pytest

from helpers.ranks import collective_checks
from helpers.runs import TrainedRuns
from helpers.s3 import S3Server

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# Every process group of the suite, in this process and in every rank it starts (spawned, forked or
# under torchrun), checks each collective's op, shapes and dtypes across its ranks: a step that is
# not the same collective sequence on every rank fails where it diverges. Set before torch is imported.
for _name, _value in collective_checks().items():
    os.environ.setdefault(_name, _value)


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker gets its share of the machine's cores for torch's intra-op threads, and so
    do the processes it starts (`OMP_NUM_THREADS`, unless set already). Two workers of a thread per core
    each, on those same cores, spin in each other's way: the in-process runs take several times as long."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The image lane (`H3TRAIN_TEST_LANE=image`, `make test`'s second run) leaves out the tests marked
    `one_lane`: what they check is the same under every version of torch, diffusers and peft, and the
    main lane has checked it."""
    if os.environ.get("H3TRAIN_TEST_LANE") != "image":
        return
    left = [item for item in items if item.get_closest_marker("one_lane")]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not item.get_closest_marker("one_lane")]


@pytest.fixture(autouse=True)
def _restore_diffusers_attention_backend():
    """`ModelMixin.set_attention_backend` also changes diffusers' process-wide default backend."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """An in-process run that fails leaves its process group as a failed rank does (`Trainer.close`):
    the next test starts without it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory: pytest.TempPathFactory) -> TrainedRuns:
    """The runs the tests of this process share, each trained once (`helpers.runs`)."""
    return TrainedRuns(tmp_path_factory.mktemp("trained_runs"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server of this test process (`helpers.s3`), started when a test first asks for it and
    stopped at the end of the session; its buckets are shared, so each test makes its own."""
    with S3Server() as server:
        yield server
