"""Debug dump of one optimizer step, so anyone can check the numbers with plain diffusers.

`<logging.dir>/dump/step_N/`:
- inputs.safetensors: `m{m}.<arg>` for the ten forward arguments of each micro-batch of rank 0
  (unsharded, unpadded), `m{m}.target_video|target_audio|loss_mask_video|loss_mask_audio`, and the
  scalars `m{m}.weight_video|weight_audio`;
- weights.safetensors / grads.safetensors: every parameter before the update and its gradient as
  the optimizer receives it (before clipping), unsharded, under diffusers names;
- meta.json: model config, micro-batch count, DP and SP sizes, each micro-batch's task and geometry.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ..objective import TrainingInputs

ROOT_PREFIX = "transformer."


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Unshard a DTensor (a collective: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def diffusers_state(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Unsharded float32 parameters (or their gradients) under the transformer's own names."""
    out = {}
    for name, param in model.named_parameters():
        src = param.grad if grads else param
        if src is None:
            src = torch.zeros_like(param)
        out[name.removeprefix(ROOT_PREFIX)] = full_tensor(src.detach()).float().cpu().contiguous()
    return out


def micro_batch_tensors(m: int, ti: TrainingInputs) -> dict[str, torch.Tensor]:
    tensors = {f"m{m}.{k}": v.detach().cpu().contiguous() for k, v in ti.model_inputs.items()}
    tensors.update({
        f"m{m}.target_video": ti.target_video.cpu().contiguous(),
        f"m{m}.target_audio": ti.target_audio.cpu().contiguous(),
        f"m{m}.loss_mask_video": ti.loss_mask_video.cpu().contiguous(),
        f"m{m}.loss_mask_audio": ti.loss_mask_audio.cpu().contiguous(),
        f"m{m}.weight_video": torch.tensor(ti.weight_video, dtype=torch.float64),
        f"m{m}.weight_audio": torch.tensor(ti.weight_audio, dtype=torch.float64),
    })
    return tensors


def write_dump(
    out_dir: Path,
    inputs: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    meta: dict,
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(inputs, str(out_dir / "inputs.safetensors"))
    save_file(weights, str(out_dir / "weights.safetensors"))
    save_file(grads, str(out_dir / "grads.safetensors"))
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
