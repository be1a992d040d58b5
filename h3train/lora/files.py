"""Adapter files from a trained adapter: the diffusers format, the ComfyUI format, and merged weights.

Every function takes the adapter as a state dict under the names `peft.get_peft_model_state_dict`
gives (`transformer_blocks.0.attn.to_q.lora_A.weight`, `....lokr_w1`; `adapters.trainable_state_dict`
returns it) and the adapter's recorded peft config as a dict (`adapters.adapter_config`), so it works
the same on a live model and on a checkpoint's contents. The adapter's output is scaled by
`lora_alpha / rank`. What each kind is written as (its `adapter_kinds.ADAPTER_KINDS` entry's `file_parts`,
`fc1_rows`, `fuse_qkv`):

| kind | diffusers format (`transformer.` + peft names)    | ComfyUI format (`diffusion_model.` + original names)    |
| ---- | ------------------------------------------------- | ------------------------------------------------------- |
| lora | `lora_A.weight`, `lora_B.weight`                  | `lora_down.weight`, `lora_up.weight`, `alpha`           |
| dora | those and `lora_magnitude_vector`                 | those and `dora_scale` (out x 1)                        |
| lokr | `lokr_w1`, `lokr_w2` or `lokr_w2_a` / `lokr_w2_b` | the same LyCORIS names, the scale folded into w1        |
| loha | none: diffusers' loader does not read LoHa        | `hada_w1_a` / `_w1_b` / `_w2_a` / `_w2_b`, scale in w1_a |

- `save_diffusers_lora`: `pytorch_lora_weights.safetensors` written by
  `MiniMaxH3LoraLoaderMixin.save_lora_weights`, under the trained partition's name: `transformer.`
  (t2va / fl2va) or `transformer_ref.` (ref2va), with the peft config as the file's adapter metadata, so
  `pipe.load_lora_weights(dir)` and `transformer.load_lora_adapter(dir)` rebuild the same adapter
  (diffusers' `load_lora_adapter` builds a DoRA `LoraConfig` or a `LoKrConfig` from that metadata; the
  pipeline's `load_lora_weights` takes names holding `lora` only, so a LoKr file loads per model:
  `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`).
- `comfyui_state_dict` / `save_comfyui_lora`: the original checkpoint's module names under
  `diffusion_model.`, as the reference code and ComfyUI read them, with kohya / LyCORIS names
  (ComfyUI's `lora`, `loha` and `lokr` weight adapters). For LoRA it is the exact inverse of diffusers'
  `_convert_non_diffusers_minimax_h3_lora_to_diffusers`:
  `to_q`, `to_k`, `to_v` fuse into `attn.qkv_proj` (`[q; k; v]` rows, as every producer but
  DiffSynth-Studio writes it): their lora_A stack into one down matrix of rank `3 r` and their
  lora_B sit block-diagonally in the up matrix, so `up @ down` restricted to each third is exactly
  that projection's `B @ A`; alpha is `3 r * alpha / r`, keeping the scale. LoHa fuses the same way
  (each product's `_a` factors block-diagonal, its `_b` factors stacked), DoRA stacks the three
  magnitudes; a Kronecker product does not split into thirds, so LoKr on to_q / to_k / to_v has no
  ComfyUI form. `ff.net.0.proj` becomes `mlp.fc1` with its output halves in the original order:
  diffusers' SwiGLU computes `value * silu(gate)` from `[value; gate]`, the original
  `fc2(silu(gate) * value)` from `[gate; value]` (recorded in the file's metadata as
  `swiglu_fc1_halves`): the rows of lora_up (and the DoRA magnitude), of both LoHa `_a` factors, or of
  the LoKr factor whose rows hold the halves swap. LoKr and LoHa files hold no `alpha`: readers
  take their scale as 1, and the factors carry it. DoRA's `dora_scale` is peft's magnitude, one value
  per output row (LyCORIS' `wd_on_out`): `m * (W + dW) / ||W + dW||` per row. ComfyUI reads an
  output-axis `dora_scale` but normalises by the base weight's row norms `||W||`, so it applies a
  DoRA file approximately; `--merge` is exact.
- `merge_adapters` / `save_merged_transformer`: the adapters folded into the base weights by peft's
  own `merge` of the adapter kind (LoRA `W + s B A`; DoRA, LoKr, LoHa as the `adapters` docstring
  says), computed in float32, stored in the weight's own dtype, so the float32 islands stay float32,
  as a diffusers transformer folder `from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from ..infra.atomic import atomic_save_file
from ..tasks.table import PARTITIONS, SAMPLE_TASKS, TRAINING_TASKS
from .adapter_kinds import record_kind
from .adapters import peft_config_from_record, peft_metadata
from .names import export_name, is_adapter_param, split_factor

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


def adapter_groups(adapters: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Module path -> {factor (a kind's `factors`, `names.split_factor`): tensor}; a name that is no adapter
    parameter is an error."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapters.items():
        split = split_factor(key)
        if split is None:
            raise ValueError(f"'{key}' is not an adapter parameter; an adapter file holds the adapters' factors only")
        out.setdefault(split[0], {})[split[1]] = value
    return out


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
    partition of `task` (a `task.name` or a sample task, from the task table). A LoHa adapter has no
    diffusers form (`ValueError`).
    """
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    kind = record_kind(lora_config)
    if kind.no_diffusers_file:
        raise ValueError(kind.no_diffusers_file)
    if partition is None:
        spec = TRAINING_TASKS.get(task) or SAMPLE_TASKS.get(task)
        partition = spec.partition if spec is not None else None
        if partition is None:
            raise ValueError(f"task '{task}' names no single partition; pass partition= (one of {list(PARTITIONS)})")
    if partition not in PARTITIONS:
        raise ValueError(f"partition '{partition}' is not one of {list(PARTITIONS)}")
    groups = adapter_groups(adapters)
    for module, parts in groups.items():
        kind.check_parts(module, parts)
    layers = {k: v.detach().cpu().contiguous() for k, v in adapters.items()}
    # The config the kind's peft class takes (diffusers builds `LoraConfig` / `LoKrConfig(**metadata)`).
    metadata = json.loads(json.dumps(peft_metadata(lora_config)))
    metadata["target_modules"] = sorted(groups)
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


def _swap_fc1(rows: tuple[str, ...], parts: dict) -> dict:
    """`parts` with the output halves of the parts named `rows` swapped (the SwiGLU order, module docstring)."""

    def swap(t: torch.Tensor) -> torch.Tensor:
        first, second = t.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)

    return {k: swap(v) if k in rows else v for k, v in parts.items()}


def comfyui_state_dict(
    adapters: dict[str, torch.Tensor], lora_config: dict
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of the ComfyUI-format file (see the module docstring)."""
    kind = record_kind(lora_config)
    groups = adapter_groups(adapters)
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, dict]] = {}
    for module, parts in groups.items():
        name, where = _original_name(module)
        parts = kind.file_parts(module, {k: v.detach().float().cpu() for k, v in parts.items()}, lora_config)
        if where.startswith("qkv:"):
            fused.setdefault(name, {})[int(where[4:])] = parts
            continue
        _put(tensors, name, _swap_fc1(kind.fc1_rows(module, parts), parts) if where == "fc1" else parts)
    for name, thirds in fused.items():
        _put(tensors, name, kind.fuse_qkv(name, thirds))
    metadata = {
        "format": "pt",
        "h3train_lora_format": "comfyui",
        "adapter_kind": kind.name,
        "rank": kind.comfyui_rank(lora_config, groups),
        "lora_alpha": str(lora_config["lora_alpha"]),
        "target_modules": json.dumps(sorted(groups)),
        "swiglu_fc1_halves": SWIGLU_FC1_HALVES,
        "qkv_rows": "q,k,v",
    }
    return tensors, metadata


def _put(tensors: dict[str, torch.Tensor], name: str, parts: dict) -> None:
    for key, value in parts.items():
        value = torch.tensor(float(value), dtype=torch.float32) if key == "alpha" else value
        tensors[f"{COMFYUI_PREFIX}{name}.{key}"] = value.contiguous()


def save_comfyui_lora(path: str | os.PathLike, adapters: dict[str, torch.Tensor], lora_config: dict) -> Path:
    """Write the ComfyUI-format LoRA file at `path`; returns it."""
    tensors, metadata = comfyui_state_dict(adapters, lora_config)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_save_file(tensors, path, metadata=metadata)
    return Path(path)


@torch.no_grad()
def merged_weight(weight: torch.Tensor, parts: dict[str, torch.Tensor], lora_config: dict) -> torch.Tensor:
    """`weight` (out x in) with one module's adapter `parts` ({factor: tensor}) folded in, float32.

    The adapter kind's own peft layer does it: a Linear holding `weight` gets the recorded config's
    adapter, takes `parts` as its values and runs peft's `merge`.
    """
    from peft import inject_adapter_in_model

    holder = nn.Module()
    holder.layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    holder.layer.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
    config = peft_config_from_record(lora_config, target_modules=["layer"])
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(config, holder)
    for name, param in holder.named_parameters():
        if is_adapter_param(name):
            param.copy_(parts[export_name(name).removeprefix("layer.")])
    holder.layer.merge()
    return holder.layer.get_base_layer().weight.detach()


@torch.no_grad()
def merge_adapters(
    base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], lora_config: dict
) -> dict[str, torch.Tensor]:
    """The base state dict (diffusers names) with the adapters folded in and `train_modules` replaced.

    `trained` is `adapters.trainable_state_dict`: the adapters' parameters plus any fully trained ones.
    Each merged weight keeps the base weight's dtype (bf16 base bf16, float32 islands float32).
    """
    factors = {k: v for k, v in trained.items() if split_factor(k) is not None}
    merged = dict(base)
    for key, value in trained.items():
        if key not in factors:
            if key not in base:
                raise ValueError(f"trained parameter '{key}' is not a parameter of the base model")
            merged[key] = value.to(base[key].dtype)
    for module, parts in adapter_groups(factors).items():
        key = f"{module}.weight"
        if key not in base:
            raise ValueError(f"adapter '{module}' adapts no weight of the base model")
        w = base[key]
        merged[key] = merged_weight(w, parts, lora_config).to(w.dtype)
    return merged


def save_merged_transformer(out_dir: str | os.PathLike, model_config: dict, merged: dict[str, torch.Tensor]) -> Path:
    """Write `merged` as a diffusers `MiniMaxH3Transformer3DModel` folder; returns it."""
    from ..model.build import meta_transformer

    model = meta_transformer(model_config)
    model.load_state_dict(merged, strict=True, assign=True)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
