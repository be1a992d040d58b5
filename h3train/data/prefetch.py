"""Load the next samples on background threads while the current one trains.

`depth` loads are in flight at once, each on a thread of its own, and their results are handed out
in order. Reading a cached sample from a local folder is file I/O plus a few tensor copies, which
release the GIL; from object storage (`data/storage.py`) each read is one ranged GET whose time is
mostly the store's latency, so `depth` of them at once, not one after another, keep a step fed.

Exact resume: the loop's stream (`data.source.MicroBatchStream`) prefetches from a copy of the
sampler's position and advances the sampler itself only as the loop consumes each step, so a
checkpoint's sampler state counts consumed samples, not prefetched ones. The prefetcher yields
`(key, item)` so the loop can check that the two agree.

The training loop also noises each micro-batch on these threads: what it draws is a function of the
step and of each sample's slot in the step, both known from the sampler position alone, so the
prefetched items are exactly those the loop would have built whichever thread built them and in
whichever order they finished, and the training thread only checks they agree.

Each thread runs its tensor work on one intra-op thread (`torch.set_num_threads(1)` there, as
`torch.utils.data` workers do): a second OpenMP team beside the training thread's competes for the
cores the step itself uses (on the 2-core step report, both a bare step and the trainer's ran
about 8 % slower while a loader team existed). The setting is the thread's own; the training
thread keeps its own.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
K = TypeVar("K")

# How often a blocked consumer re-checks whether the prefetcher was closed.
_POLL_S = 0.1


class Prefetcher(Generic[K, T]):
    """Iterate `(index, load(index))` for `index in indices`, with up to `depth` loads in flight at once.

    `load` is a callable or anything indexable (`dataset[index]`); an index is any value `load`
    takes (a step's micro-batch for the training loop). The indices are drawn on the consumer's
    thread, `depth` ahead of the one handed out; the loads run on `depth` daemon threads (a load stuck
    on a dead connection never holds up the interpreter's exit). An exception raised while loading
    is re-raised, with its original traceback, by the `next()` that would have returned that sample;
    samples before it are still delivered. `close()` (or leaving a `with` block) stops the threads.
    """

    def __init__(
        self, load: Callable[[K], T] | object, indices: Iterable[K], depth: int = 2, name: str = "prefetch"
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._load: Callable[[K], T] = load if callable(load) else load.__getitem__  # type: ignore[attr-defined]
        self._indices = iter(indices)
        self._depth = depth
        self._pending: deque[tuple[K, Future[T]]] = deque()
        self._jobs: queue.SimpleQueue[tuple[K, Future[T]] | None] = queue.SimpleQueue()
        self._drawn_all = False
        self._done = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}" if depth > 1 else name, daemon=True)
            for i in range(depth)
        ]
        for thread in self._threads:
            thread.start()
        self._fill()

    def _work(self) -> None:
        torch.set_num_threads(1)
        while (job := self._jobs.get()) is not None:
            index, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._load(index))
            except BaseException as exc:  # noqa: BLE001 - every failure belongs to the consumer
                future.set_exception(exc)

    def _fill(self) -> None:
        """Draw indices until `depth` loads are pending (or the indices end)."""
        while not self._drawn_all and len(self._pending) < self._depth:
            try:
                index = next(self._indices)
            except StopIteration:
                self._drawn_all = True
                return
            except BaseException as exc:  # noqa: BLE001 - raised in its turn, after the loads before it
                self._drawn_all = True
                failed: Future[T] = Future()
                failed.set_exception(exc)
                self._pending.append((None, failed))  # type: ignore[arg-type]
                return
            job = (index, Future())
            self._pending.append(job)
            self._jobs.put(job)

    def __iter__(self) -> Iterator[tuple[K, T]]:
        return self

    def __next__(self) -> tuple[K, T]:
        if self._done or not self._pending:
            self._done = True
            raise StopIteration
        index, future = self._pending[0]
        while True:
            try:
                item = future.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                if self._done:
                    raise StopIteration from None
            except CancelledError:
                # Closed from another thread.
                self._done = True
                raise StopIteration from None
            except BaseException:
                self.close()
                raise
        if self._done:
            raise StopIteration
        self._pending.popleft()
        self._fill()
        return index, item

    def close(self) -> None:
        """Stop the threads and drop what they prefetched. Safe to call more than once."""
        self._done = True
        while self._pending:
            self._pending.popleft()[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=10 * _POLL_S + 5)

    def __enter__(self) -> Prefetcher[K, T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
