"""LoRA adapters on the H3 transformer through its own `PeftAdapterMixin` (`transformer.add_adapter`).

`LoraTransform` is the model transform `model_transforms(cfg)` returns when `lora.rank > 0`. On the
bare transformer, before the sequence-parallel wrapper and FSDP2, it:

1. adds one peft adapter (`ADAPTER_NAME`) on the Linear layers `lora.target_modules` selects;
   peft freezes every other parameter;
2. unfreezes the `lora.train_modules` (trained in full, float32 master weights);
3. stores the frozen base in bfloat16 except the `_keep_in_fp32_modules` islands, which stay float32
   as in the released checkpoint; adapters are float32. A frozen parameter has no gradient and no
   optimizer state, so no float32 copy of it exists anywhere;
4. gives every adapter its seeded initial value (`adapter_init`): lora_A as peft's default
   (Kaiming-uniform, a = sqrt(5)), lora_B zero, drawn from a generator seeded by `train.seed` and the
   parameter's name, so every rank and every build (random, pretrained, meta) gets the same values;
   or, with `lora.init_from`, the values of that LoRA file (`init_from.py`).

A model built on the meta device (pretrained weights, resume) has no values yet: its adapters are
created on meta too and get their values in `LoraTransform.after_load`, which the trainer calls once
FSDP2 has sharded and materialised the model and the pretrained weights are in. Each rank then draws
the full adapter tensor from the seeded generator and keeps its own shard, so the sharded values
equal the unsharded init exactly.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from peft import LoraConfig as PeftLoraConfig
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import Config, LoraConfig
from ..errors import CheckpointError
from ..model.adapter import AdapterCounts
from ..model.build import fp32_island_names, meta_transformer, pretrained_folder
from ..parallel.shards import fill_from_full
from .base import BASE_DTYPE, BASE_KEY, base_record, check_same_base, read_record
from .names import ADAPTER_NAME, export_name, is_adapter_param
from .targets import resolve_targets, resolve_train_modules

ROOT_PREFIX = "transformer."


def peft_config(lora: LoraConfig, targets: list[str]) -> PeftLoraConfig:
    """peft's config for `lora` on the resolved full module paths `targets`."""
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha if lora.alpha is not None else lora.rank,
        lora_dropout=lora.dropout,
        target_modules=list(targets),
        init_lora_weights=True,
        bias="none",
    )


def is_adapted(transformer: nn.Module) -> bool:
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


def adapter_config(transformer: nn.Module) -> dict | None:
    """The adapter's peft config as a JSON-able dict (what `LoraConfig(**d)` rebuilds); None without one."""
    if not is_adapted(transformer):
        return None
    d = transformer.peft_config[ADAPTER_NAME].to_dict()
    out = {}
    for k, v in d.items():
        if isinstance(v, set):
            v = sorted(v)
        if k in ("peft_type", "task_type") and v is not None:
            v = str(getattr(v, "value", v))
        out[k] = v
    # peft rewrites a long target list to the shortest suffixes that select the same modules; record
    # the adapted modules' full paths instead, which select them in any model of this layout.
    out["target_modules"] = sorted(
        {export_name(n).removesuffix(".lora_A.weight") for n, _ in transformer.named_parameters() if ".lora_A." in n}
    )
    return out


def _param_seed(seed: int, name: str) -> int:
    # One stream per adapter parameter: values do not depend on the order parameters are visited.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def adapter_init(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The seeded initial value of adapter parameter `name` (a file name, see `names.export_name`)."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(_param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
    return value


def adapter_values(model: nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """Initial values of `model`'s adapter parameters by file name: from `lora.init_from`, or seeded."""
    shapes = {
        export_name(name.removeprefix(ROOT_PREFIX)): param.shape
        for name, param in model.named_parameters()
        if is_adapter_param(name)
    }
    if cfg.lora.init_from:
        from .init_from import init_values

        return init_values(cfg.lora.init_from, shapes, adapter_scale(cfg.lora))
    return {name: adapter_init(name, shape, cfg.train.seed) for name, shape in shapes.items()}


def adapter_scale(lora: LoraConfig) -> float:
    """The adapters' output scale, `alpha / rank`."""
    return (lora.alpha if lora.alpha is not None else lora.rank) / lora.rank


@torch.no_grad()
def init_adapters(model: nn.Module, cfg: Config) -> None:
    """Give every adapter parameter of `model` (bare, wrapped or sharded) its initial value."""
    values = adapter_values(model, cfg)
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            full = values[export_name(name.removeprefix(ROOT_PREFIX))].to(param.device)
            fill_from_full(param, full.__getitem__)


def add_adapters(transformer: MiniMaxH3Transformer3DModel, cfg: Config) -> None:
    """Steps 1-4 of the module docstring, on the bare transformer (real or on meta)."""
    lora = cfg.lora
    targets = resolve_targets(transformer, lora.target_modules)
    train_modules = resolve_train_modules(transformer, lora.train_modules, targets)
    # peft initialises with the default RNG; fork it, so adding adapters never shifts other draws.
    with torch.random.fork_rng(devices=[]):
        transformer.add_adapter(peft_config(lora, targets), adapter_name=ADAPTER_NAME)
    modules = dict(transformer.named_modules())
    for name in train_modules:
        modules[name].requires_grad_(True)
    islands = tuple(f"{name}." for name in fp32_island_names(transformer))
    for name, param in transformer.named_parameters():
        if is_adapter_param(name) or param.requires_grad:
            param.data = param.data.float()
        elif not name.startswith(islands):
            param.data = param.data.to(BASE_DTYPE)
    if not any(p.is_meta for p in transformer.parameters()):
        init_adapters(transformer, cfg)


class LoraTransform:
    """The model transform of `lora.rank > 0` (see the module docstring), and the run's adapter.

    As the adapter it says what a checkpoint of the run records (`checkpoint_info`), that the
    checkpoint holds the trainable state only (`trainable_only`: the frozen base is rebuilt as on a
    fresh start) and which checkpoints a resume may continue (`check_checkpoint`: the same base).
    """

    #: A checkpoint holds the parameters that train; the frozen base is rebuilt where a fresh start gets it.
    trainable_only = True

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._base: dict[str, Any] | None = None

    @property
    def base(self) -> dict[str, Any]:
        """What `trainer_state.json` records about the frozen base (`base.base_record`)."""
        if self._base is None:
            pretrained = pretrained_folder(self.cfg) if self.cfg.model.pretrained else None
            self._base = base_record(pretrained, self.cfg.train.seed)
        return self._base

    def checkpoint_info(self, model: nn.Module) -> dict[str, Any]:
        """The adapter's entries of `trainer_state.json`: its peft config and its base."""
        return {"lora": adapter_config(getattr(model, "transformer", model)), BASE_KEY: self.base}

    def check_checkpoint(self, saved: dict[str, Any], path: Path) -> None:
        """A LoRA checkpoint resumes only on the base it was trained on, into adapters of its rank
        (`CheckpointError` naming what changed and the ways out otherwise)."""
        check_same_base(read_record(saved), self.base, path)
        record = saved.get("lora") or {}
        old = record.get("r")
        if old is not None and int(old) != self.cfg.lora.rank:
            raise CheckpointError(
                f"checkpoint '{path}' holds adapters of another rank: lora.rank {old} -> {self.cfg.lora.rank}; "
                f"resume it with lora.rank={old}, or start afresh in a new logging.dir (or checkpoint.resume=none)"
            )

    def plan_counts(self, dims: dict[str, Any]) -> AdapterCounts:
        """What the adapters add to the architecture `dims`, for the memory plan (`lora_counts`)."""
        return lora_counts(dims, self.cfg.lora)

    def __call__(self, transformer: MiniMaxH3Transformer3DModel, cfg: Config) -> None:
        add_adapters(transformer, cfg)

    def after_load(self, model: nn.Module) -> None:
        """Once the (sharded) model holds its base values: the adapters' initial values."""
        init_adapters(model, self.cfg)


def trainable_state_dict(model: nn.Module, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """The trained parameters (adapters and train_modules), unsharded float32 on the CPU, under file names.

    A collective on a sharded model: every rank must call it. Adapters come under the names
    `peft.get_peft_model_state_dict` gives, train_modules under their diffusers names;
    `adapters_only` keeps the LoRA factors alone (what a LoRA file holds).
    """
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad and (is_adapter_param(name) or not adapters_only):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[export_name(name.removeprefix(ROOT_PREFIX))] = full.detach().float().cpu().contiguous()
    return out


def lora_counts(dims: Mapping[str, Any], lora: Any) -> AdapterCounts:
    """Count a `LoraConfig`'s adapters on the architecture `dims`, built on the meta device (no memory).

    Each adapted Linear gains `rank x (in + out)` parameters (lora_A, lora_B) and keeps its rank-r
    lora_A output per row for the backward (`AdapterCounts.rank`).
    """
    model = meta_transformer(dict(dims))
    targets = resolve_targets(model, lora.target_modules)
    trained = resolve_train_modules(model, lora.train_modules, targets)
    modules = dict(model.named_modules())
    rank = int(lora.rank)

    def adapter(name: str) -> int:
        layer = modules[name]
        return rank * (layer.in_features + layer.out_features)

    trained_params = {n: p.numel() for m in trained for n, p in modules[m].named_parameters(prefix=m)}
    islands = tuple(f"{n}." for n in fp32_island_names(model))
    frozen_fp32 = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(islands) and n not in trained_params
    )
    block = "transformer_blocks.0."
    block_adapters = sum(adapter(t) for t in targets if t.startswith(block))
    return AdapterCounts(
        rank=rank,
        adapted_layers=len(targets),
        adapters=sum(adapter(t) for t in targets),
        train_modules=sum(trained_params.values()),
        frozen_fp32=frozen_fp32,
        block_adapters=block_adapters,
        block_trainable=block_adapters + sum(v for n, v in trained_params.items() if n.startswith(block)),
        block_adapted_layers=sum(1 for t in targets if t.startswith(block)),
    )
