"""A folder on object storage (`s3://bucket/prefix`), read and written through fsspec with the few `Path`
methods h3train's checkpoint code uses, so a checkpoint folder may be a URL.

An object store has no folders and no rename: a "folder" is a key prefix, it exists while an object lies
under it, and a move is a copy of each object and its deletion. So nothing here is atomic across objects;
what one object's PUT gives (a reader sees none of it or all of it) is the only atomic step, and the
checkpoint commit is built on it (`checkpoint/writer.py`). Listings are never cached: another rank or node
may have written a moment ago.

Credentials, the endpoint and the region come from where the store's own tools read them (for S3: the
`AWS_*` variables, `~/.aws/config` and `~/.aws/credentials`, an instance role), never from the YAML.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any


def is_url(path: str | os.PathLike | RemoteDir) -> bool:
    """Whether `path` names an object store (`scheme://...`) rather than a local path."""
    if isinstance(path, RemoteDir):
        return True
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def location(path: str | os.PathLike | RemoteDir) -> Path | RemoteDir:
    """`path` as a local `Path`, or as a `RemoteDir` when it is a URL. A URL must not pass through `Path`,
    which folds its `//`."""
    if isinstance(path, RemoteDir):
        return path
    return RemoteDir(os.fspath(path)) if is_url(path) else Path(path)


# The filesystem options of every client made here (DCP's fsspec reader and writer take them too): not
# fsspec's shared instance (its client may be a forked parent's), and no listing cache.
LISTING: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}


def _filesystem(url: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(url, **LISTING)


class RemoteDir:
    """The objects under one URL prefix, with the `Path` methods checkpoint code uses (module docstring).

    `iterdir()` gives each child with what the listing said of it (kind and size), so `is_dir()`,
    `is_file()` and `stat()` of a listed child cost no request."""

    def __init__(self, url: str, _fs: Any = None, _key: str | None = None, _entry: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self._fs = _fs
        self._key = _key
        self._entry = _entry

    # -- names -----------------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemoteDir({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteDir) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RemoteDir, (self.url,))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemoteDir:
        return self._sibling(self.url.rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> RemoteDir:
        return self._sibling(f"{self.url}/{name}", f"{self.key}/{name}")

    def with_name(self, name: str) -> RemoteDir:
        return self.parent / name

    def resolve(self) -> RemoteDir:
        return self

    def _sibling(self, url: str, key: str | None = None, entry: dict | None = None) -> RemoteDir:
        return RemoteDir(url, self._fs, key, entry)

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs, _ = _filesystem(self.url)
        return self._fs

    @property
    def key(self) -> str:
        """The object key (the store's path, without the scheme)."""
        if self._key is None:
            self._key = self.fs._strip_protocol(self.url).rstrip("/")
        return self._key

    # -- what is there ---------------------------------------------------------------------------

    def exists(self) -> bool:
        return bool(self.fs.exists(self.key))

    def is_dir(self) -> bool:
        if self._entry is not None:
            return self._entry.get("type") == "directory"
        return bool(self.fs.isdir(self.key))

    def is_file(self) -> bool:
        if self._entry is not None:
            return self._entry.get("type") == "file"
        return bool(self.fs.isfile(self.key))

    def stat(self) -> SimpleNamespace:
        """`st_size` alone, which is what a store says of an object."""
        entry = self._entry if self._entry is not None else self.fs.info(self.key)
        return SimpleNamespace(st_size=int(entry.get("size") or 0))

    def iterdir(self) -> Iterator[RemoteDir]:
        """The objects and prefixes directly under this one, each with its listing entry (one request)."""
        try:
            entries = self.fs.ls(self.key, detail=True)
        except FileNotFoundError:
            return iter(())
        children = []
        for entry in entries:
            child = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if child and f"{self.key}/{child}" != self.key:
                children.append(self._sibling(f"{self.url}/{child}", f"{self.key}/{child}", entry))
        return iter(children)

    def glob(self, pattern: str) -> Iterator[RemoteDir]:
        """The children whose names match `pattern` (one level, `fnmatch`'s rules)."""
        return (child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, pattern))

    # -- reading and writing -----------------------------------------------------------------------

    def open(self, mode: str = "rb") -> IO:
        return self.fs.open(self.key, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.key))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        """One PUT: a reader sees no object or the whole of `data`, never part of it."""
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once an object lies under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rename(self, target: RemoteDir, first: str | None = None) -> RemoteDir:
        """Move every object under this prefix to `target` (a copy and a delete each); `first`, a child's
        name, moves before the others. Returns `target`."""
        children = sorted(self.iterdir(), key=lambda child: child.name != first)
        if not children:
            self.fs.mv(self.key, target.key)
        for child in children:
            if child.is_dir():
                child.rename(target / child.name)
            else:
                self.fs.mv(child.key, (target / child.name).key)
        return target

    def remove_tree(self) -> None:
        """Delete every object under this prefix."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key, recursive=True)


# A folder that checkpoint code reads and writes: a local one, or a prefix on object storage.
Folder = Path | RemoteDir
