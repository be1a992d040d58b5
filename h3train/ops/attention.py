"""The attention kernels h3train can run, in one table: what each is called, what it needs.

`model.attention_backend` (resolved by `resolve_attention_backend` when the trainer is built and in
`preflight`) and `h3train bench --backends` both read `ATTENTION_BACKENDS`, so a kernel's name, its
diffusers `dispatch_attention_fn` backend and its requirements (a CUDA device, bf16 compute, the
flash-attn package) are written here only. `register_attention_backend` adds one, and one that trains
becomes a choice of `model.attention_backend`; the config package imports nothing from h3train but
`errors`, so it lists the built-in choices itself and a test holds them equal to `CONFIG_CHOICES`.

A packed sequence (several samples attending block-diagonally, `segment_attention`) attends in one
call where a varlen kernel runs (`packed_attention_path`), else once per sample.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import choices, register_entry
from ..errors import ConfigError, one_of

AUTO = "auto"


@dataclass(frozen=True)
class AttentionBackend:
    """One attention kernel: h3train's name for it, diffusers' name, and what it needs to run.

    `trains` is False for a kernel only the benchmark runs: it is not a `model.attention_backend` choice.
    `varlen`: the kernel has its own one-call path over a packed sequence's sample offsets (flash-attn's
    varlen kernel). Any other attends through torch's `varlen_attn` where it runs, else once per sample
    (`packed_attention_path`).
    """

    name: str
    diffusers: str
    needs_cuda: bool = False
    needs_bf16: bool = False
    needs_flash_attn: bool = False
    trains: bool = True
    varlen: bool = False


#: Kernel name -> the kernel, in registration order.
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add `backend` to the table; one that trains becomes a choice of `model.attention_backend`."""
    key = "model.attention_backend" if backend.trains else None
    return register_entry(ATTENTION_BACKENDS, backend, "attention backend", key)


for _backend in (
    # PyTorch SDPA: picks its own kernel for the device and dtype; runs everywhere.
    AttentionBackend("native", "native"),
    # flash-attn and cuDNN attention compute in half precision only.
    AttentionBackend("flash", "flash", needs_cuda=True, needs_bf16=True, needs_flash_attn=True, varlen=True),
    AttentionBackend("cudnn", "_native_cudnn", needs_cuda=True, needs_bf16=True),
    # SDPA's math kernel materialises the S x S scores: the CPU bench's second kernel, short sequences only.
    AttentionBackend("math", "_native_math", trains=False),
):
    register_attention_backend(_backend)

# `model.attention_backend`'s built-in choices: `auto` (flash-attn where it can run, else native) and every
# kernel above that trains.
CONFIG_CHOICES: tuple[str, ...] = (AUTO, *(name for name, b in ATTENTION_BACKENDS.items() if b.trains))

_REASONS = {
    "cuda": "it needs a CUDA device",
    "flash_attn": "flash-attn is not installed (the 'flash' extra)",
    "bf16": "it computes in half precision only",
}


def flash_attn_available() -> bool:
    """Whether the flash-attn package is importable (found, not imported: importing it initialises CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def _missing(backend: AttentionBackend, device_type: str, dtype: str) -> str | None:
    """The first requirement of `backend` this device and compute dtype lack (a `_REASONS` key), or None."""
    if backend.needs_cuda and device_type != "cuda":
        return "cuda"
    if backend.needs_flash_attn and not flash_attn_available():
        return "flash_attn"
    if backend.needs_bf16 and dtype != "bfloat16":
        return "bf16"
    return None


def unavailable(name: str, device_type: str, dtype: str) -> str | None:
    """Why kernel `name` cannot run on `device_type` computing in `dtype`, as a clause, or None when it can."""
    missing = _missing(ATTENTION_BACKENDS[name], device_type, dtype)
    return None if missing is None else _REASONS[missing]


def resolve_attention_backend(name: str, device_type: str, dtype: str) -> str:
    """The diffusers backend for `model.attention_backend` = `name`, or a one-line `ConfigError` naming the key.

    `auto` picks flash-attn where it can run (CUDA, installed, bf16 compute), else PyTorch SDPA.
    """
    if name == AUTO:
        name = "flash" if unavailable("flash", device_type, dtype) is None else "native"
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None or not backend.trains:
        listed = choices("model.attention_backend")
        raise ConfigError(f"config key 'model.attention_backend' is {name!r}; {one_of(name, listed)}")
    missing = _missing(backend, device_type, dtype)
    fixes = {
        "cuda": "use 'native' or 'auto' on this machine",
        "flash_attn": "install the 'flash' extra or use 'auto'",
        "bf16": f"model.dtype is '{dtype}': use model.dtype=bfloat16 or 'native'",
    }
    if missing is not None:
        raise ConfigError(
            f"config key 'model.attention_backend' is '{name}', but {_REASONS[missing]}; {fixes[missing]}"
        )
    return backend.diffusers


#: How a packed sequence attends (`packed_attention_path`): flash-attn's varlen kernel in one call.
FLASH_VARLEN = "flash_varlen"
#: Core torch's `torch.nn.attention.varlen.varlen_attn` in one call (torch >= 2.10, CUDA, half precision).
TORCH_VARLEN = "torch_varlen"
#: One call of the model's kernel per sample, then a concatenation: everywhere else.
PER_SAMPLE = "per_sample"

_HALF = (torch.bfloat16, torch.float16)


def _torch_varlen_attn():
    """Core torch's one-call varlen attention, or None where this torch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# Looked up once: a compiled block reads a module global, where a cached lookup would be a call to trace.
_VARLEN_ATTN = _torch_varlen_attn()


def torch_varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10)."""
    return _VARLEN_ATTN is not None


def packed_attention_path(backend: str | None, device_type: str, dtype: torch.dtype, torch_varlen: bool) -> str:
    """How a packed sequence attends: `FLASH_VARLEN`, `TORCH_VARLEN` or `PER_SAMPLE`.

    `backend` is the diffusers name the model's processors carry (None: diffusers' default),
    `device_type` and `dtype` those of q, k, v, `torch_varlen` whether this torch has `varlen_attn`.
    A kernel with `varlen` (flash-attn) keeps its own one-call path. Any other kernel on CUDA in half
    precision attends through torch's `varlen_attn` (its flash kernel, whatever SDPA kernel the
    unpacked rows use): one call whatever the pack holds, so a compiled block does not compile again
    per composition. Elsewhere (the CPU, float32, torch < 2.10) each sample attends alone.
    """
    if device_type != "cuda":
        return PER_SAMPLE
    if any(b.varlen and b.diffusers == backend for b in ATTENTION_BACKENDS.values()):
        return FLASH_VARLEN
    if torch_varlen and dtype in _HALF:
        return TORCH_VARLEN
    return PER_SAMPLE


@dataclass(frozen=True)
class Segments:
    """A packed sequence's samples: their lengths in rows, in order, and on CUDA their offsets.

    `offsets` `[k + 1]` int32 (`cu_seqlens`, from 0 to the total rows) are copied to the device once
    per forward (`segments_on`), not in every block: a copy per attention call would stall the host
    each time. A one-call kernel reads only `offsets` (a tensor whose length a compiled block takes as
    dynamic), never `lengths`: python ints a compiled block would guard on.
    """

    lengths: tuple[int, ...]
    offsets: torch.Tensor | None = None


def packed_offsets(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """`[len(lengths) + 1]` int32 offsets of samples of `lengths` rows (`0, l0, l0 + l1, ...`) on `device`.

    The count of samples is marked dynamic: a compiled block takes packs of any count in one graph
    instead of compiling once for the first count and again for the next.
    """
    host = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    offsets = host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
    torch._dynamo.maybe_mark_dynamic(offsets, 0)
    return offsets


def segments_on(lengths: Sequence[int], device: torch.device) -> Segments:
    """`Segments` of `lengths` for attention on `device` (offsets only where a varlen kernel can run)."""
    offsets = packed_offsets(lengths, device) if device.type == "cuda" else None
    return Segments(tuple(int(n) for n in lengths), offsets)


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments, backend: str | None
) -> torch.Tensor:
    """Attention of a packed sequence, each sample attending over its own rows only (block-diagonal).

    q, k, v `[1, S, H, D]` with `S = sum(segments.lengths)`; returns `[1, S, H, D]`. `backend` is the
    diffusers name the model's processors carry (None: diffusers' default). Where a one-call kernel
    runs (`packed_attention_path`) it takes the sample offsets; otherwise the kernel runs once per
    sample, which is each sample's attention as it is alone, with the same kernel.
    """
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    path = PER_SAMPLE
    # Offsets exist on CUDA only: on the CPU the table is not looked at.
    if segments.offsets is not None:
        path = packed_attention_path(backend, query.device.type, query.dtype, _VARLEN_ATTN is not None)
    if path != PER_SAMPLE:
        offsets = segments.offsets
        # The longest sample bounds each kernel's grid. Compiled, it must not depend on the pack: a
        # python int taken from `lengths` would be guarded on, and every new longest sample would
        # compile the block again. The total rows bound every sample and are the tensor's own size.
        longest = query.shape[1] if torch.compiler.is_compiling() else max(segments.lengths)
        if path == FLASH_VARLEN:
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(query[0], key[0], value[0], offsets, offsets, longest, longest, causal=False)
        else:
            out = _VARLEN_ATTN(query[0], key[0], value[0], offsets, offsets, longest, longest)
        return out[None]
    sizes = list(segments.lengths)
    outs = [
        dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, backend=backend)
        for q, k, v in zip(query.split(sizes, dim=1), key.split(sizes, dim=1), value.split(sizes, dim=1), strict=True)
    ]
    return torch.cat(outs, dim=1)
