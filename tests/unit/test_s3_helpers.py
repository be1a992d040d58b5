"""Object storage as the trainer meets it: moto's S3 server reached from the environment alone, and what
s3fs does, on its own, with each fault a store produces (`helpers.s3`). The exception types asserted
here are the ones h3train's error handling is built on: a change of s3fs, aiobotocore or botocore that
changes one fails here first."""

from __future__ import annotations

import errno
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import botocore.exceptions
import pytest

from helpers.s3 import Fault, FaultProxy, RuleCount, S3Server, isolated_environ, write_rules

DATA = bytes(range(256)) * 4  # 1 KiB whose every slice is recognisable


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    name = s3_server.make_bucket()
    s3_server.fs().pipe_file(f"{name}/shards/a.bin", DATA)
    return name


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as p:
        yield p


def _gets(proxy: FaultProxy) -> list[int]:
    return [status for method, _, status in proxy.log if method == "GET"]


def test_write_list_and_read_a_range_from_the_environment_alone(s3_server: S3Server, bucket: str) -> None:
    fs = s3_server.fs()
    fs.pipe_file(f"{bucket}/shards/b.bin", b"second")
    assert sorted(fs.find(bucket)) == [f"{bucket}/shards/a.bin", f"{bucket}/shards/b.bin"]
    assert fs.ls(bucket, detail=False) == [f"{bucket}/shards"]
    # The version id is cat_file's second parameter: a range is given by name.
    assert fs.cat_file(f"{bucket}/shards/a.bin", start=10, end=20) == DATA[10:20]
    assert fs.info(f"{bucket}/shards/a.bin")["size"] == len(DATA)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{bucket}/shards/missing.bin")


def test_a_process_reaches_the_server_through_the_aws_variables(s3_server: S3Server, bucket: str) -> None:
    """What a rank sees: `AWS_ENDPOINT_URL` and the credentials, no argument in code."""
    code = f"import s3fs; print(s3fs.S3FileSystem().cat_file('{bucket}/shards/a.bin', start=0, end=4).hex())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=isolated_environ(s3_server.env()),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == DATA[:4].hex()


def test_a_throttled_get_succeeds_on_botocores_own_retry(proxy: FaultProxy, bucket: str) -> None:
    proxy.set_rules(Fault("slowdown", "GET", "a.bin", times=1))
    assert proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100) == DATA[:100]
    assert _gets(proxy) == [503, 206]
    assert proxy.counts() == [RuleCount(seen=2, injected=1)]


def test_throttling_that_outlasts_both_retry_layers_is_oserror_ebusy(proxy: FaultProxy, bucket: str) -> None:
    """s3fs retries a SlowDown 5 times around each of botocore's calls, which retries it itself:
    with botocore held to 2 attempts (its default is 5), 2 x 5 requests before the error."""
    proxy.set_rules(Fault("slowdown", "GET", "a.bin", times=1000))
    fs = proxy.fs(AWS_MAX_ATTEMPTS="2")
    with pytest.raises(OSError) as raised:
        fs.cat_file(f"{bucket}/shards/a.bin", start=0, end=100)
    assert type(raised.value) is OSError and raised.value.errno == errno.EBUSY
    assert isinstance(raised.value.__cause__, botocore.exceptions.ClientError)
    assert _gets(proxy) == [503] * 10


def test_an_expired_token_is_permissionerror_and_not_retried(proxy: FaultProxy, bucket: str) -> None:
    proxy.set_rules(Fault("expired", "GET", "a.bin", times=1000))
    with pytest.raises(PermissionError) as raised:
        proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100)
    assert type(raised.value) is PermissionError
    cause = raised.value.__cause__
    assert isinstance(cause, botocore.exceptions.ClientError) and cause.response["Error"]["Code"] == "ExpiredToken"
    assert _gets(proxy) == [403]


def test_no_such_key_is_filenotfounderror(proxy: FaultProxy, bucket: str) -> None:
    proxy.set_rules(Fault("no_such_key", "GET", "a.bin"))
    with pytest.raises(FileNotFoundError) as raised:
        proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100)
    assert type(raised.value) is FileNotFoundError
    assert _gets(proxy) == [404]


def test_a_ranged_body_cut_short_is_read_again(proxy: FaultProxy, bucket: str) -> None:
    """The connection closed after half of the declared Content-Length: s3fs reads the range again."""
    proxy.set_rules(Fault("truncate", "GET", "a.bin", times=1))
    assert proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100) == DATA[:100]
    assert _gets(proxy) == [206, 206]


def test_a_body_cut_short_on_every_read_is_aiohttps_clientpayloaderror(proxy: FaultProxy, bucket: str) -> None:
    """Not an OSError: s3fs raises aiohttp's own exception after its 5 reads."""
    proxy.set_rules(Fault("truncate", "GET", "a.bin", times=1000))
    with pytest.raises(aiohttp.ClientPayloadError):
        proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100)
    assert proxy.counts() == [RuleCount(seen=5, injected=5)]


def test_a_short_ranged_body_is_returned_short_without_an_error(proxy: FaultProxy, bucket: str) -> None:
    """A complete response with fewer bytes than the range: only the length tells."""
    proxy.set_rules(Fault("short", "GET", "a.bin"))
    assert proxy.fs().cat_file(f"{bucket}/shards/a.bin", start=0, end=100) == DATA[:50]


def test_a_short_whole_object_fails_its_checksum(proxy: FaultProxy, bucket: str) -> None:
    """Unranged, botocore checks the body against the checksum the server sent: its own exception, not
    retried and not an OSError."""
    proxy.set_rules(Fault("short", "GET", "a.bin", times=1000))
    with pytest.raises(botocore.exceptions.FlexibleChecksumError):
        proxy.fs().cat_file(f"{bucket}/shards/a.bin")
    assert _gets(proxy) == [200]


def test_rules_written_to_the_file_by_another_process_apply(proxy: FaultProxy, bucket: str) -> None:
    """The rules file is what a forked rank writes; the proxy takes a new generation at its next request."""
    fs = proxy.fs()
    write_rules(proxy.rules_file, [Fault("no_such_key", "GET", "a.bin", times=2), Fault("no_such_key", "PUT")])
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{bucket}/shards/a.bin", start=0, end=1)
    assert fs.cat_file(f"{bucket}/shards/a.bin", start=0, end=1) == DATA[:1]
    assert proxy.counts() == [RuleCount(seen=3, injected=2), RuleCount(seen=0, injected=0)]
