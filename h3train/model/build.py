"""Build `diffusers.MiniMaxH3Transformer3DModel`: from a local pretrained folder or a config.

Master weights are float32 whatever `model.dtype` says; the compute dtype is applied by FSDP2's
mixed-precision policy (see `model/fsdp.py`), which keeps the `_keep_in_fp32_modules` islands
in float32.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors import safe_open
from torch import nn

from ..config import Config
from ..errors import ConfigError
from ..parallel.shards import fill_from_full
from .adaln import accumulate_adaln_in_float32
from .adapter import ModelTransform
from .architecture import default_subfolder, model_config_dict
from .quant import fill_quantized


def build_model(cfg: Config, seed: int) -> MiniMaxH3Transformer3DModel:
    """A randomly initialised float32 model (`model.config`) on the CPU, identical on every rank.

    Pretrained weights take the sharded path instead: `build_meta_model` + `load_pretrained_shards`.
    Both give the blocks' AdaLN lookups a float32 gradient sum (`adaln.py`).
    """
    return build_seeded(model_config_dict(cfg), seed)


def build_seeded(model_config: dict[str, Any], seed: int) -> MiniMaxH3Transformer3DModel:
    """`build_model` from the constructor kwargs themselves (e.g. a checkpoint's `model_config`)."""
    # The default RNG is seeded here and restored, so model init never shifts other draws.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**model_config)
    accumulate_adaln_in_float32(model)
    return model.float()


def pretrained_folder(cfg: Config) -> Path:
    return Path(cfg.model.pretrained) / (cfg.model.subfolder or default_subfolder(cfg))


def fp32_island_names(model: MiniMaxH3Transformer3DModel) -> list[str]:
    """Top-level submodules diffusers keeps in float32 (`_keep_in_fp32_modules`) that own parameters."""
    keep = model._keep_in_fp32_modules or []
    return [
        name
        for name, module in model.named_children()
        if any(k in name for k in keep) and any(True for _ in module.parameters())
    ]


def store_trainable(model: MiniMaxH3Transformer3DModel, dtype: torch.dtype) -> None:
    """Store the trainable parameters outside the float32 islands in `dtype` (`optim.weights_dtype`).

    The islands keep float32: diffusers computes them in float32, and an FSDP2 unit all-gathers one
    dtype. Works on real and meta parameters, before sharding.
    """
    if dtype == torch.float32:
        return
    islands = tuple(f"{name}." for name in fp32_island_names(model))
    for name, param in model.named_parameters():
        if param.requires_grad and not name.startswith(islands):
            param.data = param.data.to(dtype)


def apply_transforms(
    transformer: MiniMaxH3Transformer3DModel,
    cfg: Config,
    transforms: Sequence[ModelTransform],
    trainable_dtype: torch.dtype,
) -> MiniMaxH3Transformer3DModel:
    """The bare transformer made the one a run trains, before any wrapper or sharding: each of `transforms`
    applied in order (adapters, a quantized base), then the trainable parameters stored in `trainable_dtype`
    (`optim.weights_dtype`). The builder and the traffic count both make it here."""
    for each in transforms:
        each(transformer, cfg)
    store_trainable(transformer, trainable_dtype)
    return transformer


def meta_transformer(dims: dict[str, Any]) -> MiniMaxH3Transformer3DModel:
    """`MiniMaxH3Transformer3DModel(**dims)` on the `meta` device: names, shapes and config, no memory.

    Keys starting with `_` (diffusers' bookkeeping in a saved `config.json`) are left out.
    """
    with torch.device("meta"):
        return MiniMaxH3Transformer3DModel(**{k: v for k, v in dims.items() if not str(k).startswith("_")})


def build_meta_model(cfg: Config) -> MiniMaxH3Transformer3DModel:
    """The architecture on the `meta` device: no memory until FSDP has sharded it."""
    model = meta_transformer(model_config_dict(cfg))
    accumulate_adaln_in_float32(model)
    return model


def _weight_files(folder: Path) -> dict[str, Path]:
    """Parameter name -> safetensors file of a diffusers model folder (sharded or single-file)."""
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"config key 'model.pretrained': no safetensors weights in '{folder}'")
    out = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out.update({name: file for name in f.keys()})  # noqa: SIM118 - safe_open is not iterable
    return out


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, prefix: str = "transformer.") -> None:
    """Allocate a meta-initialised (and sharded) model on `device`, values uninitialised.

    The rotary `inv_freq` buffer is computed, not stored in checkpoints, so it is recomputed here;
    every other value must come from a checkpoint.
    """
    model.to_empty(device=device)
    transformer = getattr(model, prefix.rstrip(".")) if prefix else model
    rope = transformer.rope
    fresh = type(rope)(rope_freq_dim=rope.rope_freq_dim, rope_theta=transformer.config.rope_theta)
    rope.inv_freq.copy_(fresh.inv_freq.to(device))
    others = {n for n, _ in transformer.named_buffers()} - {"rope.inv_freq"}
    if others:
        raise RuntimeError(f"buffers {sorted(others)} are not restored by the sharded loader")


@torch.no_grad()
def load_pretrained_shards(
    model: nn.Module,
    folder: Path,
    device: torch.device,
    pretrained_key: Callable[[str], str | None],
    prefix: str = "transformer.",
) -> None:
    """Materialise a meta-initialised, FSDP-sharded model and fill each rank's shards from safetensors.

    Every rank reads only the rows of each tensor it owns (`get_slice`), so no rank ever holds the
    whole model. Weights are cast to each parameter's dtype (float32 master weights, bfloat16 under
    `adamw_bf16` or for a LoRA's base), and a quantized base layer's rows are quantized as they load.
    `pretrained_key(name)` is the file's key of a live parameter path, None for one the files do not
    hold (an adapter's: `lora/names.pretrained_key`).
    """
    materialize(model, device, prefix)
    files = _weight_files(folder)
    handles: dict[Path, Any] = {}
    params = dict(model.named_parameters())
    # A quantized base layer (`model/quant.py`) holds its file weight as codes and row scales.
    quantized = {n.removesuffix(".qweight") for n in params if n.endswith(".qweight")}
    try:
        for name, param in params.items():
            module = name.rpartition(".")[0]
            if module in quantized and name.endswith(".scale"):
                continue  # filled with its codes
            # LoRA adapters are not in the pretrained files (their transform initialises them after
            # this load); an adapted layer's weight is there under its unadapted name.
            stored = f"{module}.weight" if module in quantized and name.endswith(".qweight") else name
            key = pretrained_key(stored.removeprefix(prefix))
            if key is None:
                continue
            if key not in files:
                raise ConfigError(f"config key 'model.pretrained': weight '{key}' missing from '{folder}'")
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            tensor_slice = handles[file].get_slice(key)
            if list(tensor_slice.get_shape()) != list(param.shape):
                raise ConfigError(
                    f"config key 'model.pretrained': weight '{key}' in '{file.name}' has shape "
                    f"{tensor_slice.get_shape()}, the model expects {list(param.shape)}"
                )
            if stored != name:
                layer = model.get_submodule(module)
                fill_quantized(param, params[f"{module}.scale"], layer.kind, tensor_slice.__getitem__)
            else:
                fill_from_full(param, tensor_slice.__getitem__)
    finally:
        handles.clear()
