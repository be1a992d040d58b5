"""AdamW with optimizer states below float32: torchao's block-quantized moments and a bfloat16 AdamW.

Both keep the update rule of `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments,
float32 arithmetic); what changes is what is stored between steps.

- `QuantizedAdamW` (`optim.name: adamw8bit | adamw4bit`): torchao's `AdamW8bit` / `AdamW4bit`. Each
  moment is a tensor subclass of 8- or 4-bit codes with one float32 scale per block of 256 / 128
  values of the rank's shard, dequantized, updated and requantized inside one compiled function per
  parameter shape. Shards under 4,096 values, or not a whole number of blocks, keep float32 moments.
  Over FSDP2 the moments are DTensors of those subclasses, so DCP saves and reshards them.
- `BF16AdamW` (`optim.name: adamw_bf16`): weights, gradients and both moments in bfloat16 (the trainer
  builds the trainable parameters in bfloat16, `weights_dtype`). A bfloat16 weight has 8 bits of
  mantissa, so an update under half its last bit would round away every step; the new weight is
  stochastically rounded instead (rounded up with probability equal to the discarded fraction), so
  small updates land on average. The moments are rounded the same way: `exp_avg_sq` moves by
  `1 - beta2` = 0.1 % of itself a step, under half a bfloat16 step, so rounded to nearest it would
  stop following the gradient's size. FSDP2 hands each micro-batch's reduced gradient over in the
  parameter's dtype, so under `train.grad_accum > 1` the micro-batches' gradients are summed in
  bfloat16 (HSDP keeps that partial sum in float32). The random bits are a hash of (seed, step, parameter, element's
  index in the full tensor): no state to checkpoint, the same under any sharding, and the same on
  every replica, so HSDP replicas stay identical. float32 parameters (the `_keep_in_fp32_modules`
  islands) are updated in float32 with float32 moments.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import ConfigError

# Elements per quantization block (one float32 scale each) and the smallest shard torchao quantizes.
QUANT_BLOCK = {"adamw8bit": 256, "adamw4bit": 128}
QUANT_CODE_BITS = {"adamw8bit": 8, "adamw4bit": 4}
QUANT_MIN_NUMEL = 4096
# Each quantized moment also holds its code book: 2^bits float32 values.
QUANT_CODE_BOOK = {name: 4 * 2**bits for name, bits in QUANT_CODE_BITS.items()}


def torchao_missing(name: str) -> str | None:
    """The one-line reason `optim.name=name` cannot run here, or None (checked before any process group)."""
    if name not in QUANT_BLOCK:
        return None
    if importlib.util.find_spec("torchao") is None:
        return (
            f"config key 'optim.name' is {name}, which needs torchao (its quantized AdamW): "
            "pip install 'h3train[lowbit]' (torchao matching your torch), or use optim.name=adamw_bf16"
        )
    return None


def _torchao_class(name: str) -> type[torch.optim.Optimizer]:
    problem = torchao_missing(name)
    if problem:
        raise ConfigError(problem)
    from torchao.optim import AdamW4bit, AdamW8bit

    return {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name]


def quantized_adamw(name: str, groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
    """torchao's `AdamW8bit` / `AdamW4bit` over `groups`, made to take a float LR from the scheduler.

    torchao keeps each group's LR as a 0-d tensor (a compiled step's input, so a new value does
    not recompile); the LR scheduler and the checkpoint's schedule writes floats. The step turns a
    float into that tensor and back, so the rest of the trainer sees a plain `torch.optim` optimizer.
    """
    base = _torchao_class(name)

    class QuantizedAdamW(base):  # type: ignore[misc, valid-type]
        @torch.no_grad()
        def init_state(self, param: torch.Tensor) -> None:
            """The state torchao's first `step` gives `param`: a step count and the two quantized moments
            (`_new_buffer`: codes, block scales and code book, or float32 for a small shard), no update."""
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._new_buffer(param, True)
                state["exp_avg_sq"] = self._new_buffer(param, False)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            floats = []
            for group in self.param_groups:
                floats.append(not isinstance(group["lr"], torch.Tensor))
                if floats[-1]:
                    group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
            try:
                # The compiled step's autograd-cache entry does not tell the 8-bit, 4-bit and plain
                # moment subclasses apart across processes (a later run of another kind reads a
                # wrong graph from the shared inductor cache); compiling it afresh is seconds.
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    return super().step(closure)
            finally:
                for group, was_float in zip(self.param_groups, floats, strict=True):
                    if was_float:
                        group["lr"] = float(group["lr"])

    QuantizedAdamW.__name__ = QuantizedAdamW.__qualname__ = f"Quantized{base.__name__}"
    for group in groups:
        group.setdefault("lr", hyper["lr"])
    optimizer = QuantizedAdamW(groups, **hyper)
    for group in optimizer.param_groups:
        group["lr"] = float(group["lr"])
    return optimizer


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2^32), elementwise; int64 out."""
    mask = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    # The product may pass 2^63: int64 wraps, and only its low 32 bits are kept.
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def _global_offset(param: torch.Tensor) -> int:
    """Flat index, in the full tensor, of the first element of this rank's shard (FSDP2 shards dim 0)."""
    if not isinstance(param, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0] * (param.numel() // max(param.shape[0], 1)) if param.ndim else 0


def element_hashes(numel: int, offset: int, device: torch.device) -> torch.Tensor:
    """A 32-bit hash of each element's index in the full tensor (`offset + i`), int64 [numel]."""
    index = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
    return _mix32(index & 0xFFFFFFFF)


def stochastic_round_bf16(
    value: torch.Tensor, key: int, offset: int, hashes: torch.Tensor | None = None
) -> torch.Tensor:
    """`value` (float32) rounded to bfloat16, up or down with probability by the discarded 16 bits.

    The 16 random bits of element `i` are a hash of (`key`, `offset + i`): the same element of the
    full tensor draws the same bits whatever the shard it lies in. `hashes`: `element_hashes` of
    `value`'s elements, when several roundings of one shard share them.
    """
    mask = 0xFFFFFFFF
    flat = value.reshape(-1)
    if hashes is None:
        hashes = element_hashes(flat.numel(), offset, flat.device)
    salt = int(_mix32(torch.tensor(key & mask)).item()) ^ (key >> 32 & mask)
    noise = _mix32((hashes + salt) & mask) & 0xFFFF
    # On the unsigned float32 pattern: the sum carries into the upper half exactly when the draw
    # is under the discarded fraction of the last bfloat16 bit; the upper half is then the result.
    bits = (flat.view(torch.int32).to(torch.int64) & mask) + noise
    bits = (bits & 0xFFFF0000) >> 16
    upper = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return upper.view(torch.bfloat16).view_as(value)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW over bfloat16 weights with bfloat16 moments and a stochastically rounded update.

    The arithmetic is float32 (`torch.optim.AdamW`'s, for-loop form); bfloat16 parameters keep
    bfloat16 `exp_avg` / `exp_avg_sq` and get the new weight and moments rounded by
    `stochastic_round_bf16`; float32 parameters keep float32 moments and a float32 update. `seed`
    keys the rounding: parameter `i` (in group order) at step `t` draws from `hash(seed, t, i)` for
    its weight and each moment.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = int(seed)

    @torch.no_grad()
    def init_state(self, param: torch.Tensor) -> None:
        """The state the first `step` gives `param`: a step count and two moments in its own dtype."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                self.init_state(param)
                state = self.state[param]
                state["step"] += 1
                step = int(state["step"].item())
                p = param.to_local() if isinstance(param, DTensor) else param
                g = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                m, v = (_local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                w = p.float()
                g32 = g.float()
                w.mul_(1.0 - lr * decay)
                m32 = m.float().lerp_(g32, 1.0 - beta1)
                v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
                bias1, bias2 = 1.0 - beta1**step, 1.0 - beta2**step
                denom = (v32.sqrt() / math.sqrt(bias2)).add_(eps)
                w.addcdiv_(m32, denom, value=-lr / bias1)
                if p.dtype == torch.bfloat16:
                    # One draw per tensor and step: the weight and each moment from keys of their own.
                    key = ((self.seed * 1_000_003 + step) * 1_000_033 + index) * 3
                    offset = _global_offset(param)
                    hashes = element_hashes(w.numel(), offset, w.device)
                    p.copy_(stochastic_round_bf16(w, key, offset, hashes))
                    m.copy_(stochastic_round_bf16(m32, key + 1, offset, hashes))
                    v.copy_(stochastic_round_bf16(v32, key + 2, offset, hashes))
                else:
                    m.copy_(m32)
                    v.copy_(v32)
                    p.copy_(w)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def quantized_state_bytes(name: str, numel: int) -> int:
    """Bytes of torchao's two moments (`adamw8bit` / `adamw4bit`) for one parameter shard of `numel` values.

    Codes plus one float32 scale per block and a code book per moment, or float32 where torchao keeps
    a shard unquantized. The step counter (one float32 per parameter tensor) is not counted.
    """
    block = QUANT_BLOCK[name]
    if numel < QUANT_MIN_NUMEL or numel % block:
        return 8 * numel
    return 2 * (numel * QUANT_CODE_BITS[name] // 8 + 4 * (numel // block) + QUANT_CODE_BOOK[name])


def quantized_bytes_per_value(name: str) -> float:
    """Bytes of torchao's two moments per trainable value at scale (every shard quantized), for the plan."""
    return 2 * (QUANT_CODE_BITS[name] / 8 + 4 / QUANT_BLOCK[name])


def warm_code_books() -> None:
    """Compute torchao's quantization code books (cached once per process) while values can be read:
    on the host, before a fake-tensor mode."""
    from torchao.optim import subclass_4bit, subclass_8bit

    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed()
        module.get_qmap_unsigned()
