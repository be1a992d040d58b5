"""Load the next samples on a background thread while the current one trains.

Reading and unpacking a cached sample is file I/O plus a few tensor copies, which release the GIL,
so one thread `depth` samples ahead hides it behind the forward/backward of the current sample.

Exact resume: the loop's stream (`data.source.MicroBatchStream`) prefetches from a copy of the
sampler's position and advances the sampler itself only as the loop consumes each step, so a
checkpoint's sampler state counts consumed samples, not prefetched ones. The prefetcher yields
`(key, item)` so the loop can check that the two agree.

The training loop also noises each micro-batch on this thread: what it draws is a function of the
step and of each sample's slot in the step, both known from the sampler position alone, so the
prefetched items are exactly those the loop would have built, and the training thread only checks
they agree.

The thread runs its tensor work on one intra-op thread (`torch.set_num_threads(1)` there, as
`torch.utils.data` workers do): a second OpenMP team beside the training thread's competes for the
cores the step itself uses (on the 2-core step report, both a bare step and the trainer's ran
about 8 % slower while a loader team existed). The setting is the thread's own; threads started
later take it as their default, the training thread keeps its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
K = TypeVar("K")

# How often a blocked thread re-checks whether the prefetcher was closed.
_POLL_S = 0.1


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _End:
    pass


class Prefetcher(Generic[K, T]):
    """Iterate `(index, load(index))` for `index in indices`, loading up to `depth` samples ahead.

    `load` is a callable or anything indexable (`dataset[index]`); an index is any value `load`
    takes (a step's micro-batch for the training loop). An exception raised while loading
    is re-raised, with its original traceback, by the `next()` that would have returned that sample;
    samples before it are still delivered. `close()` (or leaving a `with` block) stops the thread.
    """

    def __init__(
        self, load: Callable[[K], T] | object, indices: Iterable[K], depth: int = 2, name: str = "prefetch"
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._load: Callable[[K], T] = load if callable(load) else load.__getitem__  # type: ignore[attr-defined]
        self._indices = iter(indices)
        self._queue: queue.Queue[tuple[K, T] | _Failure | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(1)
        try:
            for index in self._indices:
                if self._stop.is_set() or not self._put((index, self._load(index))):
                    return
            self._put(_End())
        except BaseException as exc:  # noqa: BLE001 - every failure belongs to the consumer
            self._put(_Failure(exc))

    def _put(self, item: tuple[K, T] | _Failure | _End) -> bool:
        """Block until there is room or the prefetcher is closed; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[K, T]]:
        return self

    def __next__(self) -> tuple[K, T]:
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

    def __enter__(self) -> Prefetcher[K, T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
