"""A step's peak memory, the figure a training row logs under `mem_peak_gib`."""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak for `peak_memory_gib` (the trainer calls it as each step starts); a no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory in GiB (2**30 bytes), the figure `mem_peak_gib` logs.

    CUDA: `torch.cuda.max_memory_allocated` on `device`, the tensors' bytes (not the caching
    allocator's reserve) since the last `reset_peak_memory`, so a training row holds the peak of
    its own step (forward, backward, optimizer; validation and rendering after the step are not
    counted). Elsewhere (CPU): the process's peak resident set size since it started
    (`getrusage().ru_maxrss`, kilobytes on Linux, bytes on macOS), which never goes down. Under
    torchrun each rank measures its own; the logged value is rank 0's.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 2**30
