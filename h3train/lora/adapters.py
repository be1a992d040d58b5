"""Adapters on the H3 transformer through its own `PeftAdapterMixin` (`transformer.add_adapter`).

`LoraTransform` is the model transform `model_transforms(cfg)` returns when `lora.rank > 0`. On the
bare transformer, before the sequence-parallel wrapper and FSDP2, it:

1. adds one peft adapter (`ADAPTER_NAME`) of the configured kind (`adapter_kinds.ADAPTER_KINDS`) on the Linear layers
   `lora.target_modules` selects; peft freezes every other parameter;
2. unfreezes the `lora.train_modules` (trained in full, float32 master weights);
3. stores the frozen base in bfloat16 except the `_keep_in_fp32_modules` islands, which stay float32
   as in the released checkpoint; adapters are float32. A frozen parameter has no gradient and no
   optimizer state, so no float32 copy of it exists anywhere;
4. gives every adapter its seeded initial value (`adapter_init`): the factors peft starts at zero
   (each kind's `zero_factors`: lora_B, lokr_w1, hada_w2_b) zero, so the adapted model starts as its base, every
   other factor as peft's default (Kaiming-uniform, a = sqrt(5)), drawn from a generator seeded by
   `train.seed` and the parameter's name, so every rank and every build (random, pretrained, meta)
   gets the same values; a DoRA magnitude is the row norm of its layer's weight as held (`magnitude`),
   so the adapted layer starts as its base exactly; or, with `lora.init_from`, the values of that
   LoRA file (`init_from.py`).

The kinds (`lora.kind`, `lora.use_dora`), all with `lora.rank` r and the output scale `lora.alpha / r`:

- `lora`: `W + s B A`, peft's `LoraConfig` (lora_A r x in, lora_B out x r); `lora.dropout` is peft's
  dropout on the adapter's input.
- DoRA (`lora.use_dora`): peft's `LoraConfig(use_dora=True)`: `m * (W + s B A) / ||W + s B A||`, the
  norm per output row and taken as a constant in the backward (peft, after the DoRA paper); the
  magnitude m (`lora_magnitude_vector`, one value per output row, 1-D) trains beside A and B.
- `lokr`: peft's `LoKrConfig`: `W + s kron(w1, w2)`, out = out_l * out_k and in = in_m * in_n factored
  near their square roots (`decompose_factor=-1`); w1 (`lokr_w1`, out_l x in_m) is a full matrix
  (`decompose_both=False`), w2 is `lokr_w2_a @ lokr_w2_b` (out_k x r, r x in_n) when r is under half of
  max(out_k, in_n), else a full `lokr_w2`. peft's rank and module dropouts draw one mask per forward,
  which sequence-parallel ranks would not share, so `lora.dropout` must be 0 (`AdapterKind.check`).
- `loha`: peft's `LoHaConfig`: `W + s (hada_w1_a @ hada_w1_b) * (hada_w2_a @ hada_w2_b)` (Hadamard
  product; the `_a` factors out x r, the `_b` ones r x in); `lora.dropout` must be 0, as for LoKr.

LoKr and LoHa materialise each adapted layer's full delta weight in the forward (peft's
`get_delta_weight`), which the backward keeps: `AdapterCounts.block_delta_values`.

A model built on the meta device (pretrained weights, resume) has no values yet: its adapters are
created on meta too and get their values in `LoraTransform.after_load`, which the trainer calls once
FSDP2 has sharded and materialised the model and the pretrained weights are in. Each rank then draws
the full adapter tensor from the seeded generator and keeps its own shard, so the sharded values
equal the unsharded init exactly (a DoRA magnitude gathers its layer's weight to take the norms).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import Config, LoraConfig
from ..errors import CheckpointError
from ..model.adapter import AdapterCounts
from ..model.build import fp32_island_names, meta_transformer, pretrained_folder
from ..model.quant import quantize_base
from ..parallel.shards import fill_from_full
from .adapter_kinds import config_kind, record_kind, zero_factors
from .base import BASE_DTYPE, BASE_KEY, base_record, check_same_base, read_record
from .names import ADAPTER_NAME, MAGNITUDE, export_name, is_adapter_param, split_factor
from .targets import resolve_targets, resolve_train_modules

ROOT_PREFIX = "transformer."


def peft_config(lora: LoraConfig, targets: list[str]) -> Any:
    """peft's config for `lora` on the resolved full module paths `targets` (the kinds: module docstring)."""
    alpha = lora.alpha if lora.alpha is not None else lora.rank
    return config_kind(lora).peft_config(lora, targets, alpha)


def is_adapted(transformer: nn.Module) -> bool:
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


def adapted_modules(names: Any) -> list[str]:
    """The module paths that file names `names` hold adapter parameters of, sorted."""
    return sorted({split[0] for split in map(split_factor, names) if split is not None})


def adapter_config(transformer: nn.Module) -> dict | None:
    """The adapter's peft config as a JSON-able dict (`peft_config_from_record` rebuilds it); None without one.

    The LyCORIS kinds' `alpha` is recorded as `lora_alpha` too, so a reader of the rank and scale
    (`r`, `lora_alpha`) needs no kind.
    """
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
    if "lora_alpha" not in out:
        out["lora_alpha"] = out["alpha"]
    # peft rewrites a long target list to the shortest suffixes that select the same modules; record
    # the adapted modules' full paths instead, which select them in any model of this layout.
    out["target_modules"] = adapted_modules(
        export_name(n) for n, _ in transformer.named_parameters() if is_adapter_param(n)
    )
    return out


def peft_config_from_record(record: Mapping[str, Any], **changes: Any) -> Any:
    """The peft config object of a recorded one (`adapter_config`), with `changes` applied."""
    cls = record_kind(record).peft_class
    names = {f.name for f in fields(cls)} - {"peft_type", "task_type", "peft_version", "auto_mapping"}
    return cls(**{k: v for k, v in {**record, **changes}.items() if k in names})


def peft_metadata(record: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded config as a file's adapter metadata: the keys the kind's peft config takes."""
    cls = record_kind(record).peft_class
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in record.items() if k in names}


def _param_seed(seed: int, name: str) -> int:
    # One stream per adapter parameter: values do not depend on the order parameters are visited.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def adapter_init(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The seeded initial value of adapter factor `name` (a file name, see `names.export_name`).

    A DoRA magnitude depends on the base weight, not on a seed: `magnitude`.
    """
    if is_magnitude(name):
        raise ValueError(f"'{name}' is a DoRA magnitude, the row norms of its layer's weight (adapters.magnitude)")
    split = split_factor(name)
    if split is not None and split[1] in zero_factors():
        return torch.zeros(shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(_param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
    return value


def magnitude(weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """A DoRA magnitude: the float32 row norms of `weight + delta` (peft's `get_weight_norm`).

    With the LoRA delta of the layer's initial factors (zero, unless `lora.init_from`), the adapted
    layer starts as `W + delta` exactly: the magnitude equals the norm peft divides by.
    """
    w = weight.float()
    return torch.linalg.norm(w if delta is None else w + delta.float(), dim=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def adapter_values(model: nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """Initial values of `model`'s adapter parameters by file name: from `lora.init_from`, or seeded.

    A collective on a sharded DoRA model (each magnitude gathers its layer's weight): every rank calls it.
    """
    params = {export_name(name.removeprefix(ROOT_PREFIX)): p for name, p in model.named_parameters()}
    shapes = {
        export_name(name.removeprefix(ROOT_PREFIX)): param.shape
        for name, param in model.named_parameters()
        if is_adapter_param(name)
    }
    scale = adapter_scale(cfg.lora)
    if cfg.lora.init_from:
        from .init_from import init_values

        values = init_values(cfg.lora.init_from, shapes, scale)
    else:
        values = {n: adapter_init(n, s, cfg.train.seed) for n, s in shapes.items() if not is_magnitude(n)}
    # The magnitudes the file does not hold (all of them without one): the row norms of the layers.
    for name in sorted(set(shapes) - set(values)):
        module = name.removesuffix(f".{MAGNITUDE}")
        weight = params[f"{module}.weight"]
        if weight.is_meta:  # preflight's check of a model on meta: shapes only
            values[name] = torch.zeros(shapes[name])
            continue
        a, b = values[f"{module}.lora_A.weight"], values[f"{module}.lora_B.weight"]
        delta = scale * (b @ a) if torch.count_nonzero(b) else None
        values[name] = magnitude(_full(weight).detach().cpu(), delta)
    return values


def is_magnitude(name: str) -> bool:
    """Whether a file name is a DoRA magnitude (`<module>.lora_magnitude_vector`)."""
    return name.endswith(f".{MAGNITUDE}")


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
    if lora.base_quant != "none":
        quantize_base(transformer, lora.base_quant, islands)
    if not any(p.is_meta for p in transformer.parameters()):
        init_adapters(transformer, cfg)


class LoraTransform:
    """The model transform of `lora.rank > 0` (see the module docstring), and the run's adapter.

    As the adapter it says what a checkpoint of the run records (`checkpoint_info`), that the
    checkpoint holds the trainable state only (`trainable_only`: the frozen base is rebuilt as on a
    fresh start) and which checkpoints a resume may continue (`check_checkpoint`: the same base, kind
    and rank). What the kind cannot do was refused by the start's checks (`AdapterKind.check`), before any model.
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
            self._base = base_record(pretrained, self.cfg.train.seed, self.cfg.lora.base_quant)
        return self._base

    def checkpoint_info(self, model: nn.Module) -> dict[str, Any]:
        """The adapter's entries of `trainer_state.json`: its peft config and its base."""
        return {"lora": adapter_config(getattr(model, "transformer", model)), BASE_KEY: self.base}

    def check_checkpoint(self, saved: dict[str, Any], path: Path) -> None:
        """A LoRA checkpoint resumes only on the base it was trained on, into adapters of its kind and
        rank (`CheckpointError` naming what changed and the ways out otherwise)."""
        check_same_base(read_record(saved), self.base, path)
        record = saved.get("lora") or {}
        old, new = record_kind(record), config_kind(self.cfg.lora)
        if record and old is not new:
            raise CheckpointError(
                f"checkpoint '{path}' holds adapters of another kind: {old.setting} -> {new.setting}; "
                f"resume it with {old.setting}, or start afresh in a new logging.dir (or checkpoint.resume=none)"
            )
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
    `adapters_only` keeps the adapter's own parameters alone (what a LoRA file holds).
    """
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad and (is_adapter_param(name) or not adapters_only):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[export_name(name.removeprefix(ROOT_PREFIX))] = full.detach().float().cpu().contiguous()
    return out


# The output projections: the last modules of the forward, after the block stack and `norm_out`.
OUTPUT_HEADS = ("proj_out", "audio_proj_out")


def lora_counts(dims: Mapping[str, Any], lora: Any) -> AdapterCounts:
    """Count a `LoraConfig`'s adapters on the architecture `dims`, built on the meta device (no memory).

    Each adapted Linear gains the parameters of its kind's `layer_counts` (LoRA: `rank x (in + out)`, lora_A and
    lora_B) and keeps what it says for the backward (`AdapterCounts.block_row_values`, `block_delta_values`).
    """
    model = meta_transformer(dict(dims))
    targets = resolve_targets(model, lora.target_modules)
    trained = resolve_train_modules(model, lora.train_modules, targets)
    modules = dict(model.named_modules())
    rank = int(lora.rank)
    kind = config_kind(lora)

    def adapter(name: str) -> tuple[int, int, int]:
        layer = modules[name]
        return kind.layer_counts(rank, layer.in_features, layer.out_features)

    trained_params = {n: p.numel() for m in trained for n, p in modules[m].named_parameters(prefix=m)}
    islands = tuple(f"{n}." for n in fp32_island_names(model))
    frozen_fp32 = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(islands) and n not in trained_params
    )
    block = [adapter(t) for t in targets if t.startswith("transformer_blocks.0.")]
    block_adapters = sum(c[0] for c in block)
    heads = [adapter(t) for t in targets if t in OUTPUT_HEADS]
    heads_only = all(m in OUTPUT_HEADS for m in [*targets, *trained])
    return AdapterCounts(
        rank=rank,
        adapted_layers=len(targets),
        adapters=sum(adapter(t)[0] for t in targets),
        train_modules=sum(trained_params.values()),
        frozen_fp32=frozen_fp32,
        block_adapters=block_adapters,
        block_trainable=block_adapters
        + sum(v for n, v in trained_params.items() if n.startswith("transformer_blocks.0.")),
        block_adapted_layers=len(block),
        block_row_values=sum(c[1] for c in block),
        block_delta_values=sum(c[2] for c in block),
        heads_only=heads_only,
        head_row_values=sum(c[1] for c in heads) if heads_only else 0,
        head_delta_values=sum(c[2] for c in heads) if heads_only else 0,
        head_output_values=max(modules[m].out_features for m in OUTPUT_HEADS if m in [*targets, *trained])
        if heads_only
        else 0,
        kind=kind.label,
    )
