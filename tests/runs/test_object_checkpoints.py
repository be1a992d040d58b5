"""Checkpoints on object storage: `checkpoint.dir` as a bucket's URL on moto's S3 server (`helpers/s3.py`),
written and read through DCP's fsspec writer and reader, with the endpoint and credentials in the
environment alone.

A 2-rank run saving to the bucket is killed (SIGKILL, every rank) in its second save, once the shards are
written and before the commit: the bucket holds that save's shards, never listed as a checkpoint, and the
run resumes from the first. The resumed run ends where a run that was never killed ends, bitwise; the
leftover goes, the pruned checkpoint goes, the records' digests are those of the objects; an export from
the bucket equals the export of the same checkpoint in a folder.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from h3train.checkpoint import complete_checkpoints, read_trainer_state
from h3train.infra.digest import digest_file
from h3train.infra.objects import RemoteDir
from h3train.infra.runlock import OWNER_NAME

from helpers.launch import read_metrics, run_cli, run_env, run_forked, tiny_args
from helpers.s3 import S3Server, applied_environ, isolated_environ

pytestmark = pytest.mark.slow

STEPS = 3


def _args(log_dir: Path, checkpoints: str, *extra: str) -> list[str]:
    return tiny_args(log_dir, f"train.steps={STEPS}", "checkpoint.every=1", f"checkpoint.dir={checkpoints}", *extra)


def _curve(log_dir: Path) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(log_dir) if "loss" in m]


@pytest.fixture(scope="module")
def runs(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A straight 2-rank run into a folder; a run into a bucket killed in its second save, once every shard and
    the metadata are written (the save that looks most complete without its commit), then resumed with
    background saves."""
    root = tmp_path_factory.mktemp("object_checkpoints")
    url = f"s3://{s3_server.make_bucket()}/checkpoints"
    env = run_env(isolated_environ(s3_server.env()), AWS_MAX_ATTEMPTS="1")
    run_forked(_args(root / "straight", str(root / "straight_checkpoints")), nproc=2, env=env)
    killed = run_forked(
        _args(root / "bucket", url, "debug.fault=[kill_in_save@2]"),
        nproc=2,
        env=env,
        check=False,
    )
    with s3_server.environ():
        after_kill = {p.name: sorted(c.name for c in p.iterdir()) for p in RemoteDir(url).iterdir()}
        committed_after_kill = [p.name for p in complete_checkpoints(RemoteDir(url))]
    resumed = run_forked(_args(root / "bucket", url, "checkpoint.async_save=true"), nproc=2, env=env)
    return {
        "root": root,
        "url": url,
        "killed": killed,
        "after_kill": after_kill,
        "committed_after_kill": committed_after_kill,
        "resumed": resumed,
    }


def test_a_save_killed_before_its_commit_is_never_listed_and_the_run_resumes_the_one_before(runs) -> None:
    assert runs["killed"].returncode == -signal.SIGKILL, runs["killed"].stderr[-3000:]
    # The second save wrote its shards and metadata under its final name, and no record: not a checkpoint.
    second = runs["after_kill"]["step_00000002"]
    assert ".metadata" in second and any(n.endswith(".distcp") for n in second), second
    assert "trainer_state.json" not in second and OWNER_NAME in second
    assert runs["committed_after_kill"] == ["step_00000001"]
    out = runs["resumed"].stdout
    assert f"resumed from {runs['url']}/step_00000001 at step 1" in out, out[-2000:]


def test_the_resumed_run_ends_where_the_run_never_killed_ends(runs) -> None:
    straight, resumed = _curve(runs["root"] / "straight"), _curve(runs["root"] / "bucket")
    assert [s for s, _, _ in straight] == [1, 2, 3] and [s for s, _, _ in resumed] == [1, 2, 3]
    assert resumed == straight


def test_the_bucket_holds_the_newest_checkpoints_whole_and_nothing_else(runs, s3_server: S3Server) -> None:
    with s3_server.environ():
        root = RemoteDir(runs["url"])
        # keep_last=2 pruned step 1; the leftover of the killed save was replaced by the save of step 2.
        assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
        assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
        for checkpoint in complete_checkpoints(root):
            recorded = read_trainer_state(checkpoint)["digests"]["files"]
            present = {p.name for p in checkpoint.iterdir()} - {"trainer_state.json", OWNER_NAME}
            assert set(recorded) == present, checkpoint
            assert all(digest_file(checkpoint / name) == digest for name, digest in recorded.items())
        assert read_trainer_state(root / "step_00000003")["commit"] == 3


def test_an_export_from_the_bucket_equals_the_export_from_the_folder(runs, s3_server: S3Server, capsys) -> None:
    root: Path = runs["root"]
    local = root / "straight_checkpoints" / "step_00000003"
    with s3_server.environ():
        rc, _, err = run_cli(capsys, ["export", runs["url"], "--out", str(root / "from_bucket")])
        assert rc == 0, err
    rc, _, err = run_cli(capsys, ["export", str(local), "--out", str(root / "from_folder")])
    assert rc == 0, err
    files = sorted(p.name for p in (root / "from_folder").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (root / "from_bucket").glob("*.safetensors"))
    for name in files:
        a, b = load_file(root / "from_folder" / name), load_file(root / "from_bucket" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_bucket_that_cannot_be_written_is_one_line_before_any_work(s3_server: S3Server, tmp_path, capsys) -> None:
    missing = "s3://no-such-bucket-here/checkpoints"
    with applied_environ({**s3_server.env(), "AWS_MAX_ATTEMPTS": "1"}):
        rc, _, err = run_cli(capsys, _args(tmp_path / "run", missing))
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("h3train: error:")]
    assert len(lines) == 1 and f"config key 'checkpoint.dir': cannot write to '{missing}'" in lines[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
