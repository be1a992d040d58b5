"""Load the next samples on a background thread while the current one trains.

Reading and unpacking a cached sample is file I/O plus a few tensor copies, which release the GIL,
so one thread `depth` samples ahead hides it behind the forward/backward of the current sample.

Exact resume: feed `sampler.iter_indices()` (which does not advance the sampler) and call
`sampler.next_index()` for every sample the loop consumes, so a checkpoint's sampler state counts
consumed samples, not prefetched ones. The prefetcher yields `(index, sample)` so the loop can check
that the two agree.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# How often a blocked thread re-checks whether the prefetcher was closed.
_POLL_S = 0.1


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _End:
    pass


class Prefetcher(Generic[T]):
    """Iterate `(index, load(index))` for `index in indices`, loading up to `depth` samples ahead.

    `load` is a callable or anything indexable (`dataset[index]`). An exception raised while loading
    is re-raised, with its original traceback, by the `next()` that would have returned that sample;
    samples before it are still delivered. `close()` (or leaving a `with` block) stops the thread.
    """

    def __init__(
        self, load: Callable[[int], T] | object, indices: Iterable[int], depth: int = 2, name: str = "prefetch"
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._load: Callable[[int], T] = load if callable(load) else load.__getitem__  # type: ignore[attr-defined]
        self._indices = iter(indices)
        self._queue: queue.Queue[tuple[int, T] | _Failure | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index in self._indices:
                if self._stop.is_set() or not self._put((index, self._load(index))):
                    return
            self._put(_End())
        except BaseException as exc:  # noqa: BLE001 - every failure belongs to the consumer
            self._put(_Failure(exc))

    def _put(self, item: tuple[int, T] | _Failure | _End) -> bool:
        """Block until there is room or the prefetcher is closed; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, T]]:
        return self

    def __next__(self) -> tuple[int, T]:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # Closed from another thread, or the worker died without reporting.
                    self._done = True
                    raise StopIteration from None
        if isinstance(item, _End):
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread and drop what it prefetched. Safe to call more than once."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10 * _POLL_S + 5)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
