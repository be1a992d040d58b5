"""LoRA files from a trained adapter: the diffusers format, the ComfyUI format, and merged weights.

Every function takes the adapter as a state dict under the names `peft.get_peft_model_state_dict`
gives (`transformer_blocks.0.attn.to_q.lora_A.weight`; `adapters.trainable_state_dict` returns it)
and the adapter's peft `LoraConfig` as a dict (`adapters.adapter_config`), so it works the same on a
live model and on a checkpoint's contents. The adapter's output is scaled by `lora_alpha / rank`.

- `save_diffusers_lora`: `pytorch_lora_weights.safetensors` written by
  `MiniMaxH3LoraLoaderMixin.save_lora_weights`, under the trained partition's name: `transformer.`
  (t2va / fl2va) or `transformer_ref.` (ref2va), with the peft config as the file's adapter metadata, so
  `pipe.load_lora_weights(dir)` and `transformer.load_lora_adapter(dir)` rebuild the same adapter.
- `comfyui_state_dict` / `save_comfyui_lora`: the original checkpoint's module names under
  `diffusion_model.`, as the reference code and ComfyUI read them, kohya style
  (`lora_down` / `lora_up` / `alpha`, scale `alpha / rank`). It is the exact inverse of diffusers'
  `_convert_non_diffusers_minimax_h3_lora_to_diffusers`:
  `to_q`, `to_k`, `to_v` fuse into `attn.qkv_proj` (`[q; k; v]` rows, as every producer but
  DiffSynth-Studio writes it): their lora_A stack into one down matrix of rank `3 r` and their
  lora_B sit block-diagonally in the up matrix, so `up @ down` restricted to each third is exactly
  that projection's `B @ A`; alpha is `3 r * alpha / r`, keeping the scale. `ff.net.0.proj` becomes
  `mlp.fc1` with its output halves in the original order: diffusers' SwiGLU computes
  `value * silu(gate)` from `[value; gate]`, the original `fc2(silu(gate) * value)` from
  `[gate; value]` (recorded in the file's metadata as `swiglu_fc1_halves`).
- `merge_adapters` / `save_merged_transformer`: the adapters folded into the base weights
  (`W + alpha / r * B @ A`, computed in float32, stored in the weight's own dtype, so the float32
  islands stay float32), as a diffusers transformer folder `from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..atomic import atomic_save_file
from ..tasks.table import PARTITIONS, SAMPLE_TASKS, TRAINING_TASKS

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
COMFYUI_WEIGHT_NAME = "lora_comfyui.safetensors"
COMFYUI_PREFIX = "diffusion_model."
# Output halves of the original checkpoint's fused SwiGLU input projection, in row order.
SWIGLU_FC1_HALVES = "gate,value"

# diffusers module -> original module, outside the block stacks (the converter's `standalone_renames`).
_STANDALONE = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}
# Within a block: diffusers sub-module -> original sub-module (qkv and fc1 are handled apart).
_IN_BLOCK = {"attn.to_out.0": "attn.out_proj", "ff.net.2": "mlp.fc2", "adaln_proj.linear": "adaln_proj.linear"}
_BLOCKS = (
    (re.compile(r"transformer_blocks\.(\d+)\.(.+)"), "blocks"),
    (re.compile(r"token_refiner\.refiner_blocks\.(\d+)\.(.+)"), "token_refiner.blocks"),
)
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")


def _modules(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (lora_A, lora_B); anything but LoRA factors is an error."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in adapters:
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"'{key}' is not a LoRA factor; a LoRA file holds lora_A / lora_B weights only")
            continue
        module = key.removesuffix(".lora_A.weight")
        b_key = f"{module}.lora_B.weight"
        if b_key not in adapters:
            raise ValueError(f"'{key}' has no '{b_key}'")
        out[module] = (adapters[key], adapters[b_key])
    missing_a = [k for k in adapters if k.endswith(".lora_B.weight") and k.removesuffix(".lora_B.weight") not in out]
    if missing_a:
        raise ValueError(f"'{missing_a[0]}' has no lora_A")
    return out


def lora_scale(lora_config: dict, rank: int) -> float:
    """The adapter output scale of a module of rank `rank` (peft's `lora_alpha / r`, rsLoRA aside)."""
    if lora_config.get("rank_pattern") or lora_config.get("alpha_pattern"):
        raise ValueError("per-module rank or alpha patterns are not supported by these exports")
    alpha = float(lora_config["lora_alpha"])
    return alpha / (rank**0.5) if lora_config.get("use_rslora") else alpha / rank


def save_diffusers_lora(
    out_dir: str | os.PathLike,
    adapters: dict[str, torch.Tensor],
    lora_config: dict,
    task: str = "fl2va",
    *,
    partition: str | None = None,
    weight_name: str = DIFFUSERS_WEIGHT_NAME,
) -> Path:
    """Write `out_dir/<weight_name>` (`pytorch_lora_weights.safetensors`) in the diffusers format; returns the file.

    A file of another `weight_name` is read back with `pipe.load_lora_weights(out_dir, weight_name=...)`.

    The keys go under the partition the adapter was trained on, since the pipeline loads them into
    the component of that name: `partition` (`transformer` or `transformer_ref`) or, without it, the
    partition of `task` (a `task.name` or a sample task, from the task table).
    """
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    if partition is None:
        spec = TRAINING_TASKS.get(task) or SAMPLE_TASKS.get(task)
        partition = spec.partition if spec is not None else None
        if partition is None:
            raise ValueError(f"task '{task}' names no single partition; pass partition= (one of {list(PARTITIONS)})")
    if partition not in PARTITIONS:
        raise ValueError(f"partition '{partition}' is not one of {list(PARTITIONS)}")
    layers = {k: v.detach().cpu().contiguous() for k, v in adapters.items()}
    metadata = json.loads(json.dumps(lora_config))
    metadata["target_modules"] = sorted(_modules(adapters))
    # `save_lora_weights` takes `<component>_lora_layers` / `<component>_lora_adapter_metadata` per partition.
    kwargs = {f"{partition}_lora_layers": layers, f"{partition}_lora_adapter_metadata": metadata}
    MiniMaxH3LoraLoaderMixin.save_lora_weights(str(out_dir), weight_name=weight_name, **kwargs)
    return Path(out_dir) / weight_name


def _original_name(module: str) -> tuple[str, str]:
    """diffusers module path -> (original module path, kind): kind is `qkv:<i>`, `fc1` or `plain`."""
    if module in _STANDALONE:
        return _STANDALONE[module], "plain"
    for pattern, prefix in _BLOCKS:
        m = pattern.fullmatch(module)
        if not m:
            continue
        block, sub = f"{prefix}.{m[1]}", m[2]
        if sub in _QKV:
            return f"{block}.attn.qkv_proj", f"qkv:{_QKV.index(sub)}"
        if sub == "ff.net.0.proj":
            return f"{block}.mlp.fc1", "fc1"
        if sub in _IN_BLOCK and not (prefix == "token_refiner.blocks" and sub == "adaln_proj.linear"):
            return f"{block}.{_IN_BLOCK[sub]}", "plain"
    raise ValueError(
        f"'{module}' has no module in the original H3 checkpoint's layout, so a ComfyUI LoRA cannot hold it; "
        "export the diffusers format or merge instead"
    )


def comfyui_state_dict(
    adapters: dict[str, torch.Tensor], lora_config: dict
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of the ComfyUI-format file (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    ranks = set()
    for module, (a, b) in _modules(adapters).items():
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        ranks.add(a.shape[0])
        name, kind = _original_name(module)
        if kind.startswith("qkv:"):
            fused.setdefault(name, {})[int(kind[4:])] = (a, b)
            continue
        if kind == "fc1":
            value, gate = b.chunk(2, dim=0)
            b = torch.cat([gate, value], dim=0)
        _put(tensors, name, a, b, lora_scale(lora_config, a.shape[0]) * a.shape[0])
    for name, parts in fused.items():
        scales = {lora_scale(lora_config, a.shape[0]) for a, _ in parts.values()}
        if len(scales) != 1:
            raise ValueError(f"'{name}': q, k and v adapters of different scales cannot share one fused alpha")
        out_rows = {b.shape[0] for _, b in parts.values()}.pop()
        rank = sum(a.shape[0] for a, _ in parts.values())
        down = torch.cat([parts[i][0] for i in sorted(parts)], dim=0)
        up = torch.zeros(3 * out_rows, rank)
        col = 0
        for i in sorted(parts):
            a, b = parts[i]
            up[i * out_rows : (i + 1) * out_rows, col : col + a.shape[0]] = b
            col += a.shape[0]
        _put(tensors, name, down, up, scales.pop() * rank)
    metadata = {
        "format": "pt",
        "h3train_lora_format": "comfyui",
        "rank": ",".join(str(r) for r in sorted(ranks)),
        "lora_alpha": str(lora_config["lora_alpha"]),
        "target_modules": json.dumps(sorted(_modules(adapters))),
        "swiglu_fc1_halves": SWIGLU_FC1_HALVES,
        "qkv_rows": "q,k,v",
    }
    return tensors, metadata


def _put(tensors: dict[str, torch.Tensor], name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> None:
    tensors[f"{COMFYUI_PREFIX}{name}.lora_down.weight"] = down.contiguous()
    tensors[f"{COMFYUI_PREFIX}{name}.lora_up.weight"] = up.contiguous()
    tensors[f"{COMFYUI_PREFIX}{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)


def save_comfyui_lora(path: str | os.PathLike, adapters: dict[str, torch.Tensor], lora_config: dict) -> Path:
    """Write the ComfyUI-format LoRA file at `path`; returns it."""
    tensors, metadata = comfyui_state_dict(adapters, lora_config)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_save_file(tensors, path, metadata=metadata)
    return Path(path)


@torch.no_grad()
def merge_adapters(
    base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], lora_config: dict
) -> dict[str, torch.Tensor]:
    """The base state dict (diffusers names) with the adapters folded in and `train_modules` replaced.

    `trained` is `adapters.trainable_state_dict`: LoRA factors plus any fully trained parameters.
    Each merged weight keeps the base weight's dtype (bf16 base bf16, float32 islands float32).
    """
    factors = {k: v for k, v in trained.items() if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    merged = dict(base)
    for key, value in trained.items():
        if key not in factors:
            if key not in base:
                raise ValueError(f"trained parameter '{key}' is not a parameter of the base model")
            merged[key] = value.to(base[key].dtype)
    for module, (a, b) in _modules(factors).items():
        key = f"{module}.weight"
        if key not in base:
            raise ValueError(f"adapter '{module}' adapts no weight of the base model")
        w = base[key]
        delta = lora_scale(lora_config, a.shape[0]) * (b.float() @ a.float())
        merged[key] = (w.float() + delta).to(w.dtype)
    return merged


def save_merged_transformer(out_dir: str | os.PathLike, model_config: dict, merged: dict[str, torch.Tensor]) -> Path:
    """Write `merged` as a diffusers `MiniMaxH3Transformer3DModel` folder; returns it."""
    from ..model.build import meta_transformer

    model = meta_transformer(model_config)
    model.load_state_dict(merged, strict=True, assign=True)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
