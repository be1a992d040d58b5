"""A background save's copy of the checkpoint state in host memory: allocated once, reused by every save.

One `HostStaging` per checkpointer, so one per rank. It holds one host copy of this rank's share of
the state: every plain tensor the state's tensors are made of (a DTensor's local shard, a tensor
subclass's inner tensors such as torchao's 8-bit codes and block scales, the replicated tensors
and step counters). The copy is kept from one save to the next as long as the state's layout (its
nesting, and each of those plain tensors' shape and dtype) stays the same; a changed layout gets a
new copy, the old one freed first. The buffers are h3train's own, so no torch version's staging
cache decides whether a save allocates and page-locks the whole shard again.

Memory. The copy lives in one anonymous memory map, each plain tensor in its own storage inside it
(at `ALIGN`-byte offsets): DCP's file writer writes a tensor's whole storage, and clones a tensor
that views a larger one. On CUDA the map is page-locked once (`cudaHostRegister`), so the pinned
memory is the state's size; torch's pinned allocator would round each tensor up to a power of two
and keep freed blocks cached. `close` unlocks it and drops the buffers.

Copy. `stage` runs on the training thread. On CUDA it queues the copies on a stream of its own,
after the work already queued on the current stream (the step that produced the state),
non-blocking into the pinned buffers, and records `copied` behind them: `order_after_copy` makes
the current stream wait for that event (no host sync: the next step's optimizer update queues
behind the copy), and `wait_copied` blocks the calling thread (the writer's) until it. Tensors
already on the host (AdamW's step counters, a CPU-offloaded state) are copied at once. On the CPU
the copy is a plain `copy_` inside `stage`, complete when it returns.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

# Offset alignment of each buffer in the map: a page, so no two buffers share one.
ALIGN = 4096


def plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s values, in a fixed order: a wrapper subclass's inner
    tensors (`__tensor_flatten__`: a DTensor's local shard, torchao's codes and scales), recursively,
    else `tensor` itself."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        # A DTensor also names its device mesh; only tensors hold values.
        return [part for t in inner if isinstance(t, torch.Tensor) for part in plain_parts(t)]
    return [tensor]


def _rebuilt(tensor: torch.Tensor, host: Iterator[torch.Tensor]) -> torch.Tensor:
    """`tensor` with its plain parts (`plain_parts`' order) taken from `host`: the same wrappers around them."""
    if is_traceable_wrapper_subclass(tensor):
        names, context = tensor.__tensor_flatten__()
        inner = {}
        for name in names:
            value = getattr(tensor, name)
            inner[name] = _rebuilt(value, host) if isinstance(value, torch.Tensor) else value
        return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())
    return next(host)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostStaging:
    """This rank's host copy of the checkpoint state, pinned on CUDA, reused by every background save.

    The caller keeps two rules: a save does not `stage` again before the previous save's writer is
    done with the buffers (the checkpointer waits for its write first), and nothing changes the
    state in place before `order_after_copy` (on CUDA, queued work behind it may).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self.pinned else None
        # Blocking: the writer thread sleeps in `wait_copied` instead of spinning a core beside training.
        self._copied = torch.cuda.Event(blocking=True) if self.pinned else None
        # One host tensor per plain part of the state, in `plain_parts` order over the flattened state.
        self._buffers: list[torch.Tensor] = []
        self._layout: tuple | None = None
        self._map: mmap.mmap | None = None
        self._locked: int | None = None  # the address `cudaHostRegister` page-locked, while it is

    def host_buffers(self) -> list[torch.Tensor]:
        """The host tensors the saves copy into (empty before the first save and after `close`)."""
        return list(self._buffers)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Start the copy of every tensor of `state_dict` into the host buffers (allocated at the first
        save and at a changed layout); return the host state dict of the same nesting and keys, whose
        tensors hold the copy once it is done (`wait_copied`). Other values are shared as they are
        (plain numbers and strings; the containers are new)."""
        leaves, spec = tree_flatten(state_dict)
        tensors = [leaf.detach() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        sources = [part for t in tensors if t is not None for part in plain_parts(t)]
        layout = (spec, tuple(type(t) for t in tensors), tuple((tuple(p.shape), p.dtype) for p in sources))
        if layout != self._layout:
            self._allocate([(tuple(p.shape), p.dtype) for p in sources])
            self._layout = layout
        self._copy(sources)
        host = iter(self._buffers)
        staged = [leaf if t is None else _rebuilt(t, host) for leaf, t in zip(leaves, tensors, strict=True)]
        return tree_unflatten(staged, spec)

    def order_after_copy(self) -> None:
        """Queue the current stream behind the copy of the last `stage` (CUDA; no host sync).

        On the CPU there is nothing to wait for: `stage` copied before it returned.
        """
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    def wait_copied(self) -> None:
        """Block the calling thread until the copy of the last `stage` is in the host buffers."""
        if self._copied is not None:
            self._copied.synchronize()

    def close(self, wait: bool = True) -> None:
        """Free the buffers: with `wait`, once a copy in flight is done, unlocked and dropped (a writer
        still holding a staged state keeps their memory until it lets go). Without, a process on its
        way out leaves them as they are: a copy may still be landing in them."""
        if not wait:
            return
        self.wait_copied()
        self._free()

    def _allocate(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """New buffers of `shapes` in one map (page-locked on CUDA), the old ones freed first."""
        self._free()
        sizes = [_aligned(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in shapes]
        total = sum(sizes)
        self._map = mmap.mmap(-1, total) if total else None
        buffers, offset = [], 0
        for (shape, dtype), size in zip(shapes, sizes, strict=True):
            count = torch.Size(shape).numel()
            if count:
                # Each its own storage of exactly its bytes, inside the map (which it keeps alive).
                buffer = torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).view(shape)
            else:
                buffer = torch.empty(shape, dtype=dtype)
            buffers.append(buffer)
            offset += size
        if self.pinned and self._map is not None:
            address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
            error = int(torch.cuda.cudart().cudaHostRegister(address, total, 0))
            if error:
                raise RuntimeError(f"could not page-lock {total} bytes of checkpoint staging (cudaError {error})")
            self._locked = address
        self._buffers = buffers

    def _copy(self, sources: list[torch.Tensor]) -> None:
        """Copy `sources` into the buffers: on CUDA queued on the staging stream, else at once."""
        with torch.no_grad():
            if self._stream is None:
                for buffer, source in zip(self._buffers, sources, strict=True):
                    buffer.copy_(source)
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for buffer, source in zip(self._buffers, sources, strict=True):
                    buffer.copy_(source, non_blocking=True)
                    if source.is_cuda:
                        # Read on this stream: the allocator must not hand its memory out before the copy.
                        source.record_stream(self._stream)
                self._copied.record(self._stream)

    def _free(self) -> None:
        if self._locked is not None:
            torch.cuda.cudart().cudaHostUnregister(self._locked)
            self._locked = None
        # The map is unmapped once no buffer (here or in a staged state a writer holds) refers to it.
        self._buffers, self._layout, self._map = [], None, None
