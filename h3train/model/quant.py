"""A quantized frozen base for LoRA (`lora.base_quant: int8 | float8`): weight-only, per output row.

Each frozen Linear outside the float32 islands (peft's `base_layer` of every adapted layer, and the
unadapted ones) becomes a `QuantizedLinear`: codes `qweight` [out, in] (int8 in [-127, 127], or
float8 e4m3) and one bfloat16 scale per output row `scale` [out, 1] (its absmax / 127, or / 448),
the weight being `qweight * scale`. Both are plain frozen parameters, so FSDP2 shards them along
the rows like any other (1 byte per weight at rest instead of bfloat16's 2) and all-gathers them
per unit (the scales in the compute dtype). The forward multiplies them out in the input's dtype
and runs the matmul; it keeps only the codes and scales for the backward, which multiplies them out
again for the input's gradient, so a quantized layer holds no dequantized weight between the two
(the base is frozen: no weight gradient, no saved input). A row's codes need only that row, so
each rank quantizes the rows it loads.

The codes are plain tensors because FSDP2 cannot shard torchao's weight-only tensors
(`Int8WeightOnlyConfig`'s `Int8Tensor` has no `aten.split`), and a replicated base would cost more
per rank than a sharded bfloat16 one on any mesh over two ranks. Adapters and their gradients stay
in the training dtype; `--merge` merges into the unquantized base from the pretrained folder (or
the seeded init).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.torch_version import TorchVersion

from ..errors import ConfigError

# Code dtype and the largest code of each kind.
CODES = {"int8": (torch.int8, 127.0), "float8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.bfloat16
# FSDP2 before torch 2.12 makes each sharded parameter with `requires_grad=True` and only then sets
# the parameter's own flag, which an integer tensor refuses in `fully_shard` ("only Tensors of
# floating point dtype can require gradients"); 2.12 passes the flag at creation. Checked with a
# frozen int8 parameter beside a trainable one on 1 and 2 gloo ranks: 2.8, 2.11 fail; 2.12.0,
# 2.12.1, 2.13 shard, run forward and backward. float8 codes are floating point and shard anywhere.
# A version rule, not a probe: the failure shows only inside `fully_shard`, which needs a process
# group, and the check must run before any (`h3train check` has none).
FIRST_INTEGER_CODES_TORCH = "2.12"


def integer_codes_shard(version: str) -> bool:
    """Whether FSDP2 of torch `version` (a `torch.__version__` string) shards integer parameters.

    Compared as a version, not as text ("2.10" is after "2.9"). A local suffix ("+cpu", "+cu128")
    does not matter; a pre-release or nightly of the first working release ("2.12.0a0",
    "2.12.0.dev20260301", "2.12.0rc1") counts as before it, since builds from before the change
    carry the same number.
    """
    return TorchVersion(version) >= FIRST_INTEGER_CODES_TORCH


# The rule for the torch running here: the preflight check, the guard before sharding and the
# tools that skip int8 all read it, through `check_base_quant` or this flag.
INTEGER_CODES_SHARD = integer_codes_shard(torch.__version__)


def check_base_quant(kind: str, version: str = torch.__version__) -> None:
    """Refuse, in one line naming the key, a quantized base torch `version` cannot shard; before any model.

    Raises `ConfigError` for `kind` int8 where `integer_codes_shard(version)` is false; the default
    `version` is the running torch's.
    """
    if kind == "int8" and not integer_codes_shard(version):
        raise ConfigError(
            f"config key 'lora.base_quant' is int8, which FSDP2 cannot shard on torch {version} "
            f"(integer parameters shard from torch {FIRST_INTEGER_CODES_TORCH}); "
            "set lora.base_quant=float8 (also 1 byte per weight) or none"
        )


def quantize_rows(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], scale [out, 1] bfloat16) of `weight` [out, in], row by row.

    The scale is rounded to bfloat16 first and the codes are taken against the rounded scale, so
    `codes * scale` is the same on every rank and in any reference (in float32 compute exactly the
    weight the run uses; in bfloat16 compute that product rounded to bfloat16).
    """
    dtype, top = CODES[kind]
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / top).to(SCALE_DTYPE)
    # An all-zero row keeps scale 1 (any scale gives it zero codes).
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = w / scale.float()
    codes = scaled.round().clamp(-top, top).to(dtype) if kind == "int8" else scaled.clamp(-top, top).to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] of `codes` [out, in] and row `scale` [out, 1], computed in `dtype`."""
    return codes.to(dtype) * scale.to(dtype)


class _FrozenQuantizedMatmul(torch.autograd.Function):
    """`x @ (codes * scale).T + bias` for a frozen weight: saves the codes and scales, not the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(codes, scale)
        return F.linear(x, dequantize(codes, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        codes, scale = ctx.saved_tensors
        return grad @ dequantize(codes, scale, grad.dtype), None, None, None


class QuantizedLinear(nn.Module):
    """A frozen Linear held as per-row codes and scales (see the module docstring)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, kind: str, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        dtype, _ = CODES[kind]
        self.qweight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype, device=device), False)
        self.scale = nn.Parameter(torch.ones(out_features, 1, dtype=SCALE_DTYPE, device=device), False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=SCALE_DTYPE, device=device), False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> QuantizedLinear:
        """The quantized twin of `linear` (values quantized unless it is on meta)."""
        weight = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, kind, weight.device)
        if linear.bias is not None:
            out.bias.data = linear.bias.data.detach().clone()
        if not weight.is_meta:
            codes, scale = quantize_rows(weight, kind)
            out.qweight.data.copy_(codes)
            out.scale.data.copy_(scale)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The weight the forward computes with, in the scale's dtype (peft reads a base layer's `weight`)."""
        return dequantize(self.qweight, self.scale, self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return _FrozenQuantizedMatmul.apply(x, self.qweight, self.scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def _adapter_part(name: str) -> bool:
    # peft's own Linear layers (lora_A / lora_B) and any module inside an adapter's containers.
    return any(part.startswith(("lora_", "lokr_", "hada_")) for part in name.split("."))


def quantize_base(transformer: nn.Module, kind: str, islands: tuple[str, ...]) -> list[str]:
    """Replace every frozen `nn.Linear` of `transformer` outside `islands` (`name.` prefixes) and outside
    the adapters by a `QuantizedLinear`; returns the replaced module paths. Real or meta weights."""
    replaced = []
    for name, module in list(transformer.named_modules()):
        if type(module) is not nn.Linear or f"{name}.".startswith(islands) or _adapter_part(name):
            continue
        if module.weight.requires_grad:  # lora.train_modules train in full
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = transformer.get_submodule(parent_name) if parent_name else transformer
        setattr(parent, attr, QuantizedLinear.from_linear(module, kind))
        replaced.append(name)
    return replaced


@torch.no_grad()
def fill_quantized(
    qweight: torch.Tensor, scale: torch.Tensor, kind: str, read: Callable[[tuple[slice, ...]], torch.Tensor]
) -> None:
    """Give a (sharded) `qweight` / `scale` pair the codes of this rank's rows of a full weight.

    `read(rows)` returns the full weight's block at `rows`; both parameters shard dim 0 alike, so
    the rank's rows of the codes and of the scales are the same rows.
    """
    if isinstance(qweight, DTensor):
        shape, offset = compute_local_shape_and_global_offset(qweight.shape, qweight.device_mesh, qweight.placements)
        local_q, local_s = qweight.to_local(), scale.to_local()
    else:
        shape, offset, local_q, local_s = tuple(qweight.shape), (0, 0), qweight, scale
    if not local_q.numel():
        return
    codes, scales = quantize_rows(read(tuple(slice(o, o + n) for o, n in zip(offset, shape))), kind)
    local_q.copy_(codes.to(local_q.device))
    local_s.copy_(scales.to(local_s.device))


def base_bytes_per_weight(kind: str) -> int:
    """Bytes at rest per quantized weight value (the per-row scale aside): 1 for int8 and float8."""
    return CODES[kind][0].itemsize
