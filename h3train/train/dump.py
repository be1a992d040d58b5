"""Debug dump of one optimizer step, so anyone can check the numbers with plain diffusers.

`<logging.dir>/dump/step_N/`:
- inputs.safetensors: `m{m}.<arg>` for the ten forward arguments of each micro-batch of rank 0
  (unsharded, unpadded), `m{m}.target_video|target_audio|loss_mask_video|loss_mask_audio`, and the
  scalars `m{m}.weight_video|weight_audio` (the full factor of each modality's MSE); under CFG also
  `m{m}.uncond.<arg>` and `m{m}.cfg_scale_video|cfg_scale_audio|cfg_curvature_power`;
- weights.safetensors: every parameter before the update, unsharded float32, under diffusers names;
  in a LoRA run the frozen base under the transformer's own names (`<module>.weight`, as
  `from_pretrained` loads it) plus the adapters under the names `peft.get_peft_model_state_dict`
  gives (`<module>.lora_A.weight`);
- grads.safetensors: the gradient of every trained parameter as the optimizer receives it (before
  clipping), under the same names (all parameters in full fine-tuning; adapters and
  `lora.train_modules` in a LoRA run);
- meta.json: model config, micro-batch count, DP and SP sizes, each micro-batch's task and geometry,
  and `lora`: the adapter's peft `LoraConfig` as a dict (null in full fine-tuning), so the step is
  rebuilt with diffusers and peft alone: `add_adapter(LoraConfig(**lora))`,
  `set_peft_model_state_dict`, the base loaded before the adapter is added.

`StepDump` is the step hook that gathers and writes it (`debug.dump_step`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..infra.atomic import atomic_save_file, atomic_write_text
from ..lora.names import export_name
from ..model.quant import dequantize
from ..objective import TrainingInputs
from ..train.hooks import MicroBatchEvent, TrainerHook, TrainerView

ROOT_PREFIX = "transformer."
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Unshard a DTensor (a collective: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def diffusers_state(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Unsharded float32 parameters (or the trained ones' gradients) under their file names."""
    out = {}
    for name, param in model.named_parameters():
        if grads and not param.requires_grad:
            continue
        src = param.grad if grads else param
        if src is None:
            src = torch.zeros_like(param)
        src = src.detach()
        if src.dtype in FLOAT8:  # gloo gathers no float8 (a quantized base's codes)
            src = src.float()
        out[export_name(name.removeprefix(ROOT_PREFIX))] = full_tensor(src).float().cpu().contiguous()
    # A quantized base layer (`model/quant.py`) is written as the weight it computes with.
    for codes in [k for k in out if k.endswith(".qweight")]:
        module = codes.removesuffix(".qweight")
        out[f"{module}.weight"] = dequantize(out.pop(codes), out.pop(f"{module}.scale"))
    return out


def lora_meta(model: nn.Module) -> dict | None:
    """The adapter's peft config of a (wrapped) LoRA model as a dict; None in full fine-tuning."""
    from ..lora.adapters import adapter_config

    return adapter_config(getattr(model, "transformer", model))


def _own(t: torch.Tensor) -> torch.Tensor:
    # The two CFG branches share their row tensors; safetensors refuses shared storage.
    return t.detach().cpu().clone().contiguous()


def micro_batch_tensors(m: int, ti: TrainingInputs) -> dict[str, torch.Tensor]:
    tensors = {f"m{m}.{k}": _own(v) for k, v in ti.model_inputs.items()}
    weight_video, weight_audio = ti.full_weights()
    if ti.uncond_inputs is not None:
        tensors.update({f"m{m}.uncond.{k}": _own(v) for k, v in ti.uncond_inputs.items()})
        tensors.update(
            {
                f"m{m}.cfg_scale_video": torch.tensor(ti.guidance.scale_video, dtype=torch.float64),
                f"m{m}.cfg_scale_audio": torch.tensor(ti.guidance.scale_audio, dtype=torch.float64),
                f"m{m}.cfg_curvature_power": torch.tensor(ti.guidance.curvature_power, dtype=torch.float64),
            }
        )
    tensors.update(
        {
            f"m{m}.target_video": _own(ti.target_video),
            f"m{m}.target_audio": _own(ti.target_audio),
            f"m{m}.loss_mask_video": _own(ti.loss_mask_video),
            f"m{m}.loss_mask_audio": _own(ti.loss_mask_audio),
            f"m{m}.weight_video": torch.tensor(weight_video, dtype=torch.float64),
            f"m{m}.weight_audio": torch.tensor(weight_audio, dtype=torch.float64),
        }
    )
    return tensors


def write_dump(
    out_dir: Path,
    inputs: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    meta: dict,
) -> None:
    # Atomic writes with the umask's mode, as every other file of a run (safetensors alone writes 0600).
    for name, tensors in (("inputs", inputs), ("weights", weights), ("grads", grads)):
        atomic_save_file(tensors, out_dir / f"{name}.safetensors", metadata={"format": "pt"})
    atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2, default=str))


class StepDump(TrainerHook):
    """Dumps optimizer step `step` to `<log_dir>/dump/step_<step>/`: each micro-batch's inputs as it
    runs, then the weights and the gradients once the backward is done, before the update.

    `model_config` is the transformer's config as `meta.json` records it.
    """

    def __init__(self, step: int, log_dir: Path, model_config: dict[str, Any]) -> None:
        self.step = step
        self.log_dir = log_dir
        self.model_config = model_config
        self._inputs: dict[str, torch.Tensor] = {}
        self._metas: list[dict] = []

    def on_micro_batch(self, trainer: TrainerView, batch: MicroBatchEvent) -> None:
        if batch.step == self.step:
            self._inputs.update(micro_batch_tensors(batch.index, batch.inputs))
            self._metas.append(batch.sample.meta())

    def after_backward(self, trainer: TrainerView, step: int) -> None:
        if step != self.step:
            return
        inputs, metas, self._inputs, self._metas = self._inputs, self._metas, {}, []
        # Unsharding is collective: every rank gathers, rank 0 writes.
        weights = diffusers_state(trainer.model, grads=False)
        grads = diffusers_state(trainer.model, grads=True)
        ctx = trainer.ctx
        if ctx.is_main:
            meta = {
                "step": step,
                "model_config": self.model_config,
                "num_micro_batches": len(metas),
                "dp_size": ctx.dims.dp,
                "sp_size": ctx.dims.sp,
                "micro_batches": metas,
                "lora": lora_meta(trainer.model),
            }
            write_dump(self.log_dir / "dump" / f"step_{step}", inputs, weights, grads, meta)
