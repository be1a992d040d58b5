"""Training from object storage: a sharded dataset in a bucket of moto's S3 server (a real HTTP endpoint on
this machine, `helpers/s3.py`), reached through s3fs with the endpoint and credentials in the environment
alone, as a user's job reaches S3.

The same dataset is sharded into a local folder and into the bucket (`h3train shard DIR --out URL`); a run
from each, at dp 2 and at dp 2 x sp 2, trains the same sample ids in the same order with bitwise-equal
losses, and a run from the bucket resumes on another world size. Faults injected by a proxy in front of the
server (a missing shard, a range cut short, an expired credential, throttling) each end in one line naming
the sample and the shard, or are retried and pass; `data.on_error=skip` passes over a damaged shard's sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3train.data.dataset_index import open_index
from h3train.data.shard_files import write_shards
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.data.trained_samples import trained_samples

from helpers.launch import read_metrics, run_cli, run_env, run_forked, tiny_args
from helpers.paths import TINY_FL2VA
from helpers.s3 import Fault, FaultProxy, S3Server, applied_environ, isolated_environ

pytestmark = pytest.mark.slow

SAMPLES = 8
STEPS = 3


@pytest.fixture(scope="module")
def datasets(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same 8 fl2va samples as a sharded local folder and as a sharded dataset in a bucket."""
    root = tmp_path_factory.mktemp("object_storage")
    folder = write_synthetic_dataset(root / "folder", task="fl2va", num_samples=SAMPLES, seed=7, text_dim=16)
    table = open_index(folder)
    size = sum((folder / table[i].file).stat().st_size for i in range(len(table))) // 3
    write_shards(folder, root / "sharded", size)
    url = f"s3://{s3_server.make_bucket()}/fl2va"
    with s3_server.environ():
        write_shards(folder, url, size)
    return {"local": str(root / "sharded"), "s3": url, "root": str(root)}


def _env(server: S3Server | FaultProxy, cache: Path, **extra: str) -> dict[str, str]:
    """A run's environment: the store's endpoint and credentials (nothing else of `AWS_*`), botocore's own
    retries off (h3train's are under test), a cache of its own for the index copy."""
    return run_env(isolated_environ(server.env()), H3TRAIN_CACHE=str(cache), AWS_MAX_ATTEMPTS="1", **extra)


def _train(log_dir: Path, path: str, nproc: int, env: dict[str, str], *extra: str, check: bool = True):
    args = tiny_args(
        log_dir,
        f"train.steps={STEPS}",
        "data.source=cached",
        f"data.path={path}",
        "logging.sample_ids=true",
        "checkpoint.every=1",
        *extra,
    )
    return run_forked(args, nproc=nproc, env=env, check=check)


def _losses(log_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(log_dir) if "loss" in row]


@pytest.mark.parametrize("layout", [("dp2", 2, ()), ("dp2xsp2", 4, ("parallel.sp=2",))], ids=lambda v: v[0])
def test_a_run_from_the_bucket_trains_what_the_run_from_the_folder_does(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path, layout
) -> None:
    _, nproc, extra = layout
    runs = {}
    for name in ("local", "s3"):
        log_dir = tmp_path / name
        _train(log_dir, datasets[name], nproc, _env(s3_server, tmp_path / f"cache_{name}"), *extra)
        runs[name] = (_losses(log_dir), trained_samples(log_dir))
    (local_losses, local_ids), (s3_losses, s3_ids) = runs["local"], runs["s3"]
    assert len(local_losses) == STEPS and local_losses == s3_losses
    assert local_ids == s3_ids and len({i for ids in local_ids.values() for i in ids}) > 2


def test_a_run_from_the_bucket_resumes_on_another_world_size(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path
) -> None:
    env = _env(s3_server, tmp_path / "cache")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, datasets["s3"], 2, env, "train.steps=4")
    _train(resumed, datasets["s3"], 2, env, "train.steps=2")
    # The same micro-batches a step on one rank: twice the config's accumulation.
    proc = _train(resumed, datasets["s3"], 1, env, "train.steps=4", "train.grad_accum=4")
    assert "resumed from" in proc.stdout, proc.stdout[-2000:]
    expected, got = trained_samples(straight), trained_samples(resumed)
    assert list(expected) == list(got) == [1, 2, 3, 4]
    for step, samples in expected.items():
        assert sorted(got[step]) == sorted(samples), f"step {step}"
    # A resume that restarted the order would train step 1's samples again.
    assert sorted(expected[3]) != sorted(expected[1])


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("h3train: error:")]
    assert lines, stderr[-3000:]
    return lines[0]


def _copy_to_a_bucket(datasets: dict[str, str], s3_server: S3Server, name: str) -> tuple[str, dict]:
    """The local dataset copied to a new bucket's folder `name`: its URL and its index's first line."""
    url = f"s3://{s3_server.make_bucket()}/{name}"
    key = url.removeprefix("s3://")
    with s3_server.environ():
        fs = s3_server.fs()
        fs.put(datasets["local"] + "/", key + "/", recursive=True)
        first = json.loads(fs.cat_file(key + "/index.jsonl").decode().splitlines()[0])
    return url, first


def test_a_missing_shard_names_the_sample_and_the_shard(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path
) -> None:
    url, first = _copy_to_a_bucket(datasets, s3_server, "copy")
    gone = first["file"]
    with s3_server.environ():
        s3_server.fs().rm_file(f"{url.removeprefix('s3://')}/{gone}")
    proc = _train(tmp_path / "run", url, 1, _env(s3_server, tmp_path / "cache"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # Found before any step: the start lists the shards (one listing), not the samples.
    assert f"dataset '{url}' (data.path): " in _error_line(proc.stderr)
    assert f"sample '{first['id']}': its file '{gone}' does not exist" in proc.stderr


@pytest.mark.parametrize(
    "fault, says",
    [("short", "truncated"), ("expired", "access refused"), ("slowdown", None)],
)
def test_faults_of_the_store_are_named_or_retried(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path, fault: str, says: str | None
) -> None:
    with FaultProxy(s3_server) as proxy:
        env = _env(proxy, tmp_path / "cache")
        # A fault on every read of a shard's range for a short while: past the index, the first sample read.
        times = 2 if fault == "slowdown" else 100
        proxy.set_rules(Fault(fault, method="GET", key="/shards/", times=times))
        proc = _train(tmp_path / "run", datasets["s3"], 1, env, "train.steps=1", check=False)
        seen = proxy.counts()[0]
    if says is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert seen.injected == times and len(_losses(tmp_path / "run")) == 1
        return
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    assert says in line and "/shards/shard-" in line and datasets["s3"] in line


def test_on_error_skip_passes_over_a_damaged_sample_in_the_bucket(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path
) -> None:
    url, first = _copy_to_a_bucket(datasets, s3_server, "damaged")
    key = url.removeprefix("s3://")
    with s3_server.environ():
        fs = s3_server.fs()
        data = bytearray(fs.cat_file(f"{key}/{first['file']}"))
        data[first["offset"] + first["length"] - 2] ^= 0xFF
        fs.pipe_file(f"{key}/{first['file']}", bytes(data))
    env = _env(s3_server, tmp_path / "cache")
    proc = _train(tmp_path / "raise", url, 1, env, "train.steps=8", check=False)
    assert proc.returncode != 0 and first["file"] in _error_line(proc.stderr)
    _train(tmp_path / "skip", url, 1, env, "train.steps=8", "data.on_error=skip")
    trained = {i for ids in trained_samples(tmp_path / "skip").values() for i in ids}
    assert first["id"] not in trained and len(trained) == SAMPLES - 1


def test_check_plans_a_dataset_in_the_bucket_from_its_index_alone(
    datasets: dict[str, str], s3_server: S3Server, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("H3TRAIN_CACHE", str(tmp_path / "cache"))
    with applied_environ(s3_server.env()):
        args = ["check", str(TINY_FL2VA), "data.source=cached", f"data.path={datasets['s3']}", "--strict"]
        rc, out, err = run_cli(capsys, args)
    assert rc == 0, out[-2000:] + err
    assert f"per epoch of {SAMPLES} samples" in out
    # The index's copy, and nothing of the shards, is what the start keeps here.
    kept = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert kept == [".h3train.index", "index.jsonl", "remote.json"], kept
