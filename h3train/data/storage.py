"""Datasets on object storage: `data.path` as a URL (`s3://bucket/prefix`), read through fsspec.

A dataset at a URL is the folder layout of a local one (`index.jsonl`, the sample files or shards,
`data/shard_files.py`) as objects. A start reads one object, the index: `dataset_folder(url)` keeps a copy of
`index.jsonl` in a local folder of its own (under `H3TRAIN_CACHE`, default `~/.cache/h3train`), fetched
again only when the object's size or ETag changed (one HEAD), and the compact index is built there as
beside any index (`format.open_index`); the folder's `remote.json` names the URL. Every later step of a
start plans from that folder; a sample is read from the URL when it is drawn (`RemoteStore.read`), one
ranged GET of its bytes in a shard.

Credentials, the endpoint and the region come from where the object store's own tools read them (for
S3: `AWS_*` variables, `~/.aws/config` and `~/.aws/credentials`, an instance role), never from the YAML.

Errors, each one line naming the sample and the object:

- a missing object, or a range that ends early (a truncated shard), is the sample's fault: a `SampleError`,
  which `data.on_error=skip` passes over as it does a damaged file;
- throttling, a connection lost, a body cut short: retried `RETRIES` times with a backoff doubling from
  `BACKOFF_S` (above what s3fs and botocore retry themselves), then a `DatasetError`;
- a credential refused (expired, denied) is not retried and is a `DatasetError`: every sample would fail.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..errors import DatasetError, SampleError
from ..infra.objects import is_url
from .location import INDEX_NAME

REMOTE_NAME = "remote.json"
# Retries of a transient failure of one read, and the first wait between them (doubling).
RETRIES = 4
BACKOFF_S = 0.25


def cache_root() -> Path:
    """Where the local copies of remote datasets' indexes are kept: `H3TRAIN_CACHE`, else ~/.cache/h3train."""
    return Path(os.environ.get("H3TRAIN_CACHE") or Path.home() / ".cache" / "h3train")


class RemoteStore:
    """The objects under one URL, read by ranges with retries (module docstring). Made in the process that
    reads: the fsspec filesystem is made on first use, so a forked rank makes its own."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._fs: Any = None
        self._root = ""

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RemoteStore, (self.url,))

    @property
    def fs(self) -> Any:
        if self._fs is None:
            from fsspec.core import url_to_fs

            # Not the instance fsspec caches: its client may belong to another process (a fork's parent).
            self._fs, self._root = url_to_fs(self.url, skip_instance_cache=True)
        return self._fs

    def key(self, relative: str) -> str:
        """The object key of `relative` (a path in the dataset, `/`-separated)."""
        _ = self.fs
        return f"{self._root.rstrip('/')}/{relative}"

    def name(self, relative: str) -> str:
        return f"{self.url}/{relative}"

    def info(self, relative: str) -> dict[str, Any]:
        """The object's size and ETag (one HEAD); `FileNotFoundError` when there is none."""
        return self._retried(relative, lambda: self.fs.info(self.key(relative)))

    def read(self, relative: str, start: int = 0, length: int | None = None) -> bytes:
        """`length` bytes of `relative` from byte `start` (None: to its end), exactly: a range that ends early
        is read again, then a `SampleError` (`truncated`)."""

        def get() -> bytes:
            end = None if length is None else start + length
            data = self.fs.cat_file(self.key(relative), start=start, end=end)
            if length is not None and len(data) != length:
                raise _Short(len(data))
            return data

        try:
            return self._retried(relative, get)
        except _Short as short:
            raise SampleError(
                f"'{self.name(relative)}', bytes {start}-{start + (length or 0)}: truncated (read {short.got} of "
                f"{length} bytes); the object is shorter than its index says: upload it again"
            ) from None

    def names_in(self, directory: str) -> list[str]:
        """The names of the objects directly under `directory` (one listing; empty when there are none)."""
        try:
            found = self._retried(directory, lambda: self.fs.ls(self.key(directory).rstrip("/"), detail=False))
        except FileNotFoundError:
            return []
        return [str(path).rstrip("/").rsplit("/", 1)[-1] for path in found]

    def _retried(self, relative: str, call: Any) -> Any:
        wait = BACKOFF_S
        for attempt in range(RETRIES + 1):
            try:
                return call()
            except FileNotFoundError:
                raise
            except PermissionError as exc:
                raise DatasetError(
                    f"'{self.name(relative)}': access refused ({_said(exc)}); renew the credentials the "
                    "object store reads from the environment or its config files, then run again"
                ) from None
            except _Short:
                if attempt == RETRIES:
                    raise
            except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own kinds for a lost connection
                if not _transient(exc) or attempt == RETRIES:
                    raise DatasetError(
                        f"'{self.name(relative)}': cannot be read after {attempt + 1} tries ({_said(exc)}); "
                        "the object store is unreachable or throttling: run again later, or lower data.prefetch"
                    ) from None
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")


class _Short(Exception):
    def __init__(self, got: int) -> None:
        super().__init__(got)
        self.got = got


def _transient(exc: BaseException) -> bool:
    """Whether a failed read may succeed again: throttling, a lost connection, a body cut short."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return True  # s3fs maps SlowDown (EBUSY) and unknown service errors (EIO) to OSError
    name = type(exc).__name__
    return name in {"ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "IncompleteRead"}


def _said(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def dataset_folder(path: str | os.PathLike) -> Path:
    """The local folder a dataset is planned from: `path` itself, or for a URL the copy of its index
    (`mirror_index`)."""
    return mirror_index(os.fspath(path)) if is_url(path) else Path(path)


def has_index(path: str | os.PathLike) -> bool:
    """Whether the dataset at `path` (a folder, or a URL whose index can be read from here) has an index."""
    if not is_url(path):
        return (Path(path) / INDEX_NAME).is_file()
    try:
        mirror_index(os.fspath(path))
    except DatasetError:
        return False
    return True


def is_dataset_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a dataset folder here, or a URL holding a dataset's index."""
    return has_index(path) if is_url(path) else Path(path).is_dir()


def planning_folder(path: str | os.PathLike) -> Path:
    """`dataset_folder(path)` where the dataset's index can be read from here; else `path` as a local folder
    (which holds no index: the callers plan without the data, or say that it is missing)."""
    return dataset_folder(path) if not is_url(path) or has_index(path) else Path(os.fspath(path))


def mirror_index(url: str) -> Path:
    """The local folder holding the index of the dataset at `url`, fetched when the object changed.

    Raises `DatasetError` naming the URL when it holds no index."""
    url = url.rstrip("/")
    folder = cache_root() / "datasets" / hashlib.sha256(url.encode()).hexdigest()[:20]
    store = RemoteStore(url)
    try:
        info = store.info(INDEX_NAME)
    except FileNotFoundError:
        raise DatasetError(
            f"dataset '{url}' has no {INDEX_NAME}; write the dataset there with 'h3train shard DIR --out {url}'"
        ) from None
    version = {"url": url, "size": int(info.get("size") or 0), "etag": str(info.get("ETag") or "")}
    marker = folder / REMOTE_NAME
    try:
        held = json.loads(marker.read_text())
    except (OSError, ValueError):
        held = None
    if held != version or not (folder / INDEX_NAME).is_file():
        from ..infra.atomic import atomic_write

        folder.mkdir(parents=True, exist_ok=True)
        data = store.read(INDEX_NAME)
        atomic_write(folder / INDEX_NAME, lambda tmp: tmp.write_bytes(data))
        atomic_write(marker, lambda tmp: tmp.write_text(json.dumps(version)))
    return folder


@functools.lru_cache(maxsize=16)
def _store_of(folder: str, marker_mtime_ns: int) -> RemoteStore | None:
    try:
        return RemoteStore(json.loads((Path(folder) / REMOTE_NAME).read_text())["url"])
    except (OSError, ValueError, KeyError):
        return None


def remote_store(folder: Path) -> RemoteStore | None:
    """The store of the dataset whose index `folder` holds a copy of (`mirror_index`); None for a local one."""
    try:
        mtime = (folder / REMOTE_NAME).stat().st_mtime_ns
    except OSError:
        return None
    return _store_of(str(folder), mtime)
