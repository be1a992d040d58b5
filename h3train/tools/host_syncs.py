"""Counting the device->host syncs of a stretch of training code.

On CUDA the device says when the host waits for it: `cuda_syncs` runs a block under
`torch.cuda.set_sync_debug_mode("warn")` and records each sync as the Python `file:line` that made it.

A CPU has no such sync to observe, so `SyncCounter` counts the calls that would be one on a GPU:
`item`, `tolist`, `cpu`, `numpy`, `float()`, `int()`, `bool()` of a tensor, on the thread that made
the counter, except on tensors an earlier counted call already brought to the host and in code whose
tensors live on the host on a GPU as well (`host_side`).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType
from typing import Any

import torch


def is_sync(message: object) -> bool:
    """Whether a warning or error message is CUDA's report of a sync."""
    return "synchroniz" in str(message).lower()


@contextmanager
def cuda_syncs(active: bool, outer: str = "error") -> Iterator[list[str]]:
    """The block under sync debug mode "warn", every sync recorded as the Python `file:line` that made it.

    For a block inside code that runs under mode `outer`, set again on exit. The list yielded is
    filled on exit; warnings other than syncs are shown as usual afterwards. Inactive, the block runs
    as it is and the list stays empty.
    """
    where: list[str] = []
    if not active:
        yield where
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield where
    finally:
        torch.cuda.set_sync_debug_mode(outer)
    for w in caught:
        if is_sync(w.message):
            where.append(f"{Path(w.filename).name}:{w.lineno}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


# Code whose tensors live on the host on a GPU as well: AdamW's step counters (not capturable), the
# sampler's permutation, and the noising of a sample (`make_training_inputs` and what it calls).
_HOST_FILES = ("/torch/optim/", "/h3train/data/", "/h3train/tasks/")
_DEVICE_OBJECTIVE = ("compute_loss", "masked_mse", "guided_mse")


def host_side(code: CodeType) -> bool:
    """Whether `code` reads tensors that are on the host on a GPU too, so that its reads are no sync."""
    path = code.co_filename.replace(os.sep, "/")
    if any(part in path for part in _HOST_FILES):
        return True
    return path.endswith("/h3train/objective.py") and code.co_name not in _DEVICE_OBJECTIVE


class SyncCounter:
    """Counts, while `active`, this thread's tensor reads that are a device->host sync on a GPU.

    `calls` maps `"<method> in <file>:<function>"` to a count. Patches `torch.Tensor` until `restore`.
    """

    METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")

    def __init__(self) -> None:
        self.active = False
        self.calls: Counter = Counter()
        self._thread = threading.current_thread()
        # id -> weak reference of tensors already on the host (tensors compare by value, not identity).
        self._host: dict[int, weakref.ref] = {}
        self._originals = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def wrapper(tensor, *args, **kwargs):
            counting = counter.active and threading.current_thread() is counter._thread
            frame = sys._getframe(1)
            if counting and id(tensor) not in counter._host and not host_side(frame.f_code):
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
                counter.active = False  # calls made by the counted call itself are not counted
                try:
                    result = original(tensor, *args, **kwargs)
                finally:
                    counter.active = True
                counter.calls[f"{name.strip('_')} in {where}"] += 1
                if isinstance(result, torch.Tensor):
                    key = id(result)
                    counter._host[key] = weakref.ref(result, lambda _, key=key: counter._host.pop(key, None))
                return result
            return original(tensor, *args, **kwargs)

        return wrapper

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
