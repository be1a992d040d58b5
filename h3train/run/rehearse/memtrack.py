"""Live tensor storages by category, with peaks: the memory bookkeeping of a rehearsal under fake tensors.

A fake tensor holds no memory, but its storage says how many bytes the real one would, and a
storage's Python object lives exactly as long as the storage itself (torch preserves it), so a
finalizer on it fires when the real storage would be freed. `StorageTracker` is a dispatch mode
that registers every storage an op returns (a DTensor's or another wrapper subclass's inner
tensors, a view's base storage once), each under the category current when it was created
(`attributing`), and keeps per category the live bytes, each category's own peak, the peak of the
total and the split of the total at that moment (`Snapshot`).

Three things do not pass through an op's output, and are followed by hand:

- tensors that exist before tracking starts (the sharded parameters, the micro-batch):
  `adopt(tensors, category)` registers their storages, or moves them to `category`;
- in-place storage resizes: FSDP2 frees a unit's unsharded parameters by resizing their storage
  to 0 bytes and allocates them again by resizing it back, so `UntypedStorage.resize_` is wrapped
  while tracking and a resized storage counts under `resized_category`;
- storages whose role their owner decides: FSDP2 hands each reduce-scattered gradient to its
  parameter's `.grad`, and first allocates a unit's all-gathered parameters with a plain `empty`;
  `reclassify` (a callable returning `{category: tensors}`) is called at every new peak after one
  of `COLLECTIVE_OPS` ran, until a call moves nothing, and at `refresh()`.

Bytes are storage bytes: a padded FSDP2 shard counts its padding, a view counts nothing of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

# The category of a storage created while no `attributing` block says otherwise.
TRANSIENT = "activations"
# Ops after which `reclassify` is asked (FSDP2's all-gather copy-out, its reduce-scatter).
COLLECTIVE_OPS = ("all_gather", "split_with_sizes_copy", "reduce_scatter")


@dataclass
class Snapshot:
    """Live bytes per category at one moment, and a label of where the step was (`phase`)."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    phase: str = ""


def _inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t` itself, or the plain tensors inside a wrapper subclass (DTensor, torchao's quantized states)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _inner_tensors(inner)
    else:
        yield t


class StorageTracker(TorchDispatchMode):
    """Dispatch mode counting live storage bytes per category (module docstring).

    Enter it inside the `FakeTensorMode` (so it sees ops before they are faked). `phase` is a label the
    caller sets (e.g. "backward, micro-batch 2") and a peak records. `reclassify` returns, for the
    categories that ownership decides (gradients), the tensors that now belong to them.
    """

    def __init__(
        self,
        resized_category: str = "unsharded params",
        reclassify: Callable[[], dict[str, Iterable[torch.Tensor]]] | None = None,
    ) -> None:
        super().__init__()
        self.resized_category = resized_category
        self.reclassify = reclassify
        self.category = TRANSIENT
        self.phase = ""
        # storage id -> [bytes, category]; the id is the storage's C++ address, unique while it lives.
        self._live: dict[int, list[Any]] = {}
        self.live: dict[str, int] = {}
        self.category_peaks: dict[str, int] = {}
        self.peak = Snapshot()
        self._total = 0
        self._pending_reclassify = False
        self._resize: Callable[..., Any] | None = None

    # -- categories ---------------------------------------------------------------------------

    @contextmanager
    def attributing(self, category: str) -> Iterator[None]:
        """Storages created inside the block are counted under `category`."""
        before, self.category = self.category, category
        try:
            yield
        finally:
            self.category = before

    def adopt(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Count the storages of `tensors` under `category` (registering those not seen yet)."""
        for tensor in tensors:
            if tensor is None:
                continue
            for inner in _inner_tensors(tensor):
                self._register(inner.untyped_storage(), category, move=True)

    def refresh(self) -> None:
        """Apply `reclassify` now (e.g. after the backward), then check the peak."""
        self._apply_reclassify()
        self._check_peak()

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is live now."""
        self.category_peaks = dict(self.live)
        self.peak = Snapshot(self._total, dict(self.live), self.phase)

    # -- bookkeeping --------------------------------------------------------------------------

    def _add(self, category: str, nbytes: int) -> None:
        self.live[category] = self.live.get(category, 0) + nbytes
        self._total += nbytes
        if self.live[category] > self.category_peaks.get(category, 0):
            self.category_peaks[category] = self.live[category]

    def _register(self, storage: torch.UntypedStorage, category: str, move: bool = False) -> None:
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            if move and entry[1] != category:
                self._add(entry[1], -entry[0])
                entry[1] = category
                self._add(category, entry[0])
            return
        nbytes = storage.nbytes()
        self._live[key] = [nbytes, category]
        self._add(category, nbytes)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._add(entry[1], -entry[0])

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            self._register(storage, self.resized_category)
            return
        self._add(entry[1], -entry[0])
        entry[1] = self.resized_category
        entry[0] = nbytes
        self._add(entry[1], nbytes)
        self._check_peak()

    def _apply_reclassify(self) -> bool:
        """Move what `reclassify` names; whether anything moved."""
        if self.reclassify is None:
            return False
        moved = False
        for category, tensors in self.reclassify().items():
            for tensor in tensors:
                for inner in _inner_tensors(tensor):
                    entry = self._live.get(inner.untyped_storage()._cdata)
                    if entry is not None and entry[1] != category:
                        moved = True
                        self._add(entry[1], -entry[0])
                        entry[1] = category
                        self._add(category, entry[0])
        return moved

    def _check_peak(self) -> None:
        if self._total <= self.peak.total:
            return
        # After a collective the owners take what it made, one or more ops later: look until nothing moves.
        if self._pending_reclassify and not self._apply_reclassify():
            self._pending_reclassify = False
        self.peak = Snapshot(self._total, dict(self.live), self.phase)

    # -- the mode -----------------------------------------------------------------------------

    def __enter__(self) -> StorageTracker:
        tracker = self
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage, int(size))
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        if any(name in func.__name__ for name in COLLECTIVE_OPS):
            self._pending_reclassify = True
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for inner in _inner_tensors(t):
                    self._register(inner.untyped_storage(), self.category)
        self._check_peak()
        return out
