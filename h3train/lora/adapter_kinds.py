"""The adapter kinds h3train trains, one entry each in `ADAPTER_KINDS` (formulas: `adapters` docstring).

A kind says everything about itself: which config asks for it (`selected_by`, `setting`), the peft
config it injects (`peft_config`), how a recorded config names it (`matches`), its parameters' file
names (`factors`, `zero_factors`), what the memory plan counts (`layer_counts`), what it refuses
(`check`), and how its ComfyUI file holds it (`file_parts`, `fc1_rows`, `fuse_qkv`, `comfyui_rank`).
`register_adapter_kind` adds one and makes it a choice of `lora.kind`; a later kind refines an
earlier one it also matches (DoRA is LoRA with `use_dora`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..config import register_entry
from ..errors import ConfigError, one_of

# peft's state-dict name of a DoRA magnitude: its live `<module>.lora_magnitude_vector.<adapter>.weight`.
MAGNITUDE = "lora_magnitude_vector"


def lora_scale(lora_config: Mapping[str, Any], rank: int) -> float:
    """The adapter output scale of a module of rank `rank` (peft's `lora_alpha / r`, rsLoRA `/ sqrt(r)`)."""
    if lora_config.get("rank_pattern") or lora_config.get("alpha_pattern"):
        raise ValueError("per-module rank or alpha patterns are not supported by these exports")
    alpha = float(lora_config["lora_alpha"])
    return alpha / (rank**0.5) if lora_config.get("use_rslora") else alpha / rank


def fuse_pairs(thirds: Mapping[int, Mapping[str, Any]], pairs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Fused-projection factors from per-third ones: each (down, up) pair's downs stacked, ups block-diagonal.

    `thirds[i][up] @ thirds[i][down]` is then the fused product's rows of third i.
    """
    out: dict[str, Any] = {}
    for down_key, up_key in pairs:
        out_rows = {p[up_key].shape[0] for p in thirds.values()}.pop()
        rank = sum(p[down_key].shape[0] for p in thirds.values())
        out[down_key] = torch.cat([thirds[i][down_key] for i in sorted(thirds)], dim=0)
        up = torch.zeros(3 * out_rows, rank)
        col = 0
        for i in sorted(thirds):
            block = thirds[i][up_key]
            up[i * out_rows : (i + 1) * out_rows, col : col + block.shape[1]] = block
            col += block.shape[1]
        out[up_key] = up
    return out


class AdapterKind:
    """One adapter kind. Subclass, set the class attributes, override what differs, register an instance."""

    name: ClassVar[str]
    #: What printouts call it (`LoRA`).
    label: ClassVar[str]
    #: peft's `peft_type` of its config, as a checkpoint's record holds it.
    peft_type: ClassVar[str]
    #: File-name suffixes (after `<module>.`) of its parameters; `zero_factors` start at zero.
    factors: ClassVar[tuple[str, ...]]
    zero_factors: ClassVar[tuple[str, ...]] = ()
    #: What it refuses (`check`): `lora.use_dora`, peft dropout on the input, `lora.init_from`, a quantized base.
    takes_dora: ClassVar[bool] = False
    takes_dropout: ClassVar[bool] = True
    reads_init_from: ClassVar[bool] = True
    takes_quantized_base: ClassVar[bool] = False
    #: Why diffusers' LoRA loader cannot read it (None: it can).
    no_diffusers_file: ClassVar[str | None] = None

    @property
    def setting(self) -> str:
        """The config setting that asks for it, as messages name it."""
        return f"lora.kind={self.name}"

    def selected_by(self, lora: Any) -> bool:
        """Whether the `LoraConfig` asks for this kind."""
        return lora.kind == self.name

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether a recorded peft config (`adapters.adapter_config`) is of this kind."""
        return str(record.get("peft_type") or "LORA") == self.peft_type

    @property
    def peft_class(self) -> type:
        raise NotImplementedError

    def peft_config(self, lora: Any, targets: list[str], alpha: float) -> Any:
        """peft's config on the full module paths `targets`, scale numerator `alpha`."""
        raise NotImplementedError

    def check(self, lora: Any) -> None:
        """What this kind cannot do with `lora`, as a one-line `ConfigError` naming the key; before any model."""
        if not self.takes_dora and lora.use_dora:
            raise ConfigError(
                f"config key 'lora.use_dora' is a variant of lora.kind=lora, not of {lora.kind!r}: set one of them"
            )
        if not self.takes_dropout and lora.dropout:
            raise ConfigError(
                f"config key 'lora.dropout' is {lora.dropout}, and {self.setting} has no input dropout (peft's "
                "rank and module dropouts draw one mask per forward, which sequence-parallel ranks would not share); "
                "set lora.dropout=0"
            )
        if not self.takes_quantized_base and lora.base_quant != "none":
            raise ConfigError(
                f"config key 'lora.base_quant' is {lora.base_quant}, which takes plain LoRA adapters, not "
                f"{self.setting}: set lora.base_quant=none, or train LoRA on the quantized base"
            )
        if not self.reads_init_from and lora.init_from:
            raise ConfigError(
                f"config key 'lora.init_from' reads LoRA and DoRA files, not {self.setting} adapters; drop "
                "lora.init_from (a run of this kind continues with checkpoint.resume)"
            )

    def layer_counts(self, rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        """(parameters, values kept per row for the backward, values kept per forward) an adapted Linear adds."""
        raise NotImplementedError

    def check_parts(self, module: str, parts: Mapping[str, torch.Tensor]) -> None:
        """Raise `ValueError` when one module's file parts are incomplete."""

    def file_parts(self, module: str, parts: dict[str, torch.Tensor], lora_config: Mapping[str, Any]) -> dict:
        """One module's adapter as the ComfyUI file names it (before renaming and fusing), float32."""
        raise NotImplementedError

    def fc1_rows(self, module: str, parts: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
        """The ComfyUI parts whose rows are the SwiGLU input projection's output rows (swapped in halves)."""
        raise NotImplementedError

    def fuse_qkv(self, name: str, thirds: Mapping[int, Mapping[str, Any]]) -> dict:
        """The ComfyUI parts of `attn.qkv_proj` from those of to_q / to_k / to_v (index 0, 1, 2)."""
        raise NotImplementedError

    def comfyui_rank(self, lora_config: Mapping[str, Any], groups: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
        """The rank a ComfyUI file's metadata states."""
        return str(lora_config["r"])


class LoraKind(AdapterKind):
    """`W + s B A`: peft's `LoraConfig` (lora_A r x in, lora_B out x r)."""

    name = "lora"
    label = "LoRA"
    peft_type = "LORA"
    factors = ("lora_A.weight", "lora_B.weight")
    zero_factors = ("lora_B.weight",)
    takes_quantized_base = True

    def selected_by(self, lora: Any) -> bool:
        return lora.kind == self.name and not lora.use_dora

    def matches(self, record: Mapping[str, Any]) -> bool:
        return super().matches(record) and not record.get("use_dora")

    @property
    def peft_class(self) -> type:
        from peft import LoraConfig

        return LoraConfig

    def peft_config(self, lora: Any, targets: list[str], alpha: float) -> Any:
        return self.peft_class(
            r=lora.rank,
            lora_alpha=alpha,
            lora_dropout=lora.dropout,
            target_modules=list(targets),
            init_lora_weights=True,
            bias="none",
            use_dora=lora.use_dora,
        )

    def layer_counts(self, rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        # Kept per row: its rank-r lora_A output.
        return rank * (in_features + out_features), rank, 0

    def check_parts(self, module: str, parts: Mapping[str, torch.Tensor]) -> None:
        for have, need in (("lora_A.weight", "lora_B.weight"), ("lora_B.weight", "lora_A.weight")):
            if need not in parts:
                raise ValueError(f"'{module}.{have}' has no '{module}.{need}'")

    def file_parts(self, module: str, parts: dict[str, torch.Tensor], lora_config: Mapping[str, Any]) -> dict:
        self.check_parts(module, parts)
        a, b = parts["lora_A.weight"], parts["lora_B.weight"]
        return {"lora_down.weight": a, "lora_up.weight": b, "alpha": lora_scale(lora_config, a.shape[0]) * a.shape[0]}

    def fc1_rows(self, module: str, parts: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
        return ("lora_up.weight",)

    def fuse_qkv(self, name: str, thirds: Mapping[int, Mapping[str, Any]]) -> dict:
        scales = {p["alpha"] / p["lora_down.weight"].shape[0] for p in thirds.values()}
        if len(scales) != 1:
            raise ValueError(f"'{name}': q, k and v adapters of different scales cannot share one fused alpha")
        out = fuse_pairs(thirds, (("lora_down.weight", "lora_up.weight"),))
        out["alpha"] = scales.pop() * out["lora_down.weight"].shape[0]
        return out

    def comfyui_rank(self, lora_config: Mapping[str, Any], groups: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
        return ",".join(str(r) for r in sorted({parts["lora_A.weight"].shape[0] for parts in groups.values()}))


class DoraKind(LoraKind):
    """`m * (W + s B A) / ||W + s B A||` per output row: peft's `LoraConfig(use_dora=True)`."""

    name = "dora"
    label = "DoRA"
    factors = (*LoraKind.factors, MAGNITUDE)
    takes_dora = True
    takes_quantized_base = False  # its magnitudes are row norms of the base layer's whole weight

    @property
    def setting(self) -> str:
        return "lora.use_dora=true"

    def selected_by(self, lora: Any) -> bool:
        return lora.kind == "lora" and bool(lora.use_dora)

    def matches(self, record: Mapping[str, Any]) -> bool:
        return AdapterKind.matches(self, record) and bool(record.get("use_dora"))

    def layer_counts(self, rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        # The magnitude adds one value per output row; its gradient keeps the lora_B and base outputs.
        params, row, _ = super().layer_counts(rank, in_features, out_features)
        return params + out_features, row + 2 * out_features, 0

    def file_parts(self, module: str, parts: dict[str, torch.Tensor], lora_config: Mapping[str, Any]) -> dict:
        return {**super().file_parts(module, parts, lora_config), "dora_scale": parts[MAGNITUDE].reshape(-1, 1)}

    def fc1_rows(self, module: str, parts: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
        return ("lora_up.weight", "dora_scale")

    def fuse_qkv(self, name: str, thirds: Mapping[int, Mapping[str, Any]]) -> dict:
        if len(thirds) != 3:
            raise ValueError(
                f"'{name}': a DoRA magnitude covers the fused projection's every row, so to_q, to_k and to_v must "
                "all be adapted; export the diffusers format or merge instead"
            )
        return {**super().fuse_qkv(name, thirds), "dora_scale": torch.cat([thirds[i]["dora_scale"] for i in range(3)])}


class LycorisKind(AdapterKind):
    """The LyCORIS kinds: no input dropout, no file to start from, the scale folded into the first factor."""

    takes_dropout = False
    reads_init_from = False
    #: The factor a ComfyUI file scales by `alpha / r` (its readers take a LyCORIS file's scale as 1).
    scaled_factor: ClassVar[str]

    def peft_config(self, lora: Any, targets: list[str], alpha: float) -> Any:
        common = dict(r=lora.rank, alpha=alpha, rank_dropout=0.0, module_dropout=0.0, init_weights=True)
        return self.peft_class(**common, target_modules=list(targets), **self.peft_options)

    peft_options: ClassVar[dict[str, Any]] = {}

    def file_parts(self, module: str, parts: dict[str, torch.Tensor], lora_config: Mapping[str, Any]) -> dict:
        first = self.first_factor(parts)
        scale = lora_scale(lora_config, int(lora_config["r"]))
        return {k: v * scale if k == first else v for k, v in parts.items()}

    def first_factor(self, parts: Mapping[str, torch.Tensor]) -> str:
        return self.scaled_factor


class LokrKind(LycorisKind):
    """`W + s kron(w1, w2)`: peft's `LoKrConfig`, out and in factored near their square roots."""

    name = "lokr"
    label = "LoKr"
    peft_type = "LOKR"
    factors = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
    zero_factors = ("lokr_w1", "lokr_w1_a")
    peft_options = {"decompose_both": False, "decompose_factor": -1}

    @property
    def peft_class(self) -> type:
        from peft import LoKrConfig

        return LoKrConfig

    def layer_counts(self, rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        from peft.tuners.lokr.layer import factorization

        out_l, out_k = factorization(out_features, -1)
        in_m, in_n = factorization(in_features, -1)
        w2 = rank * (out_k + in_n) if rank < max(out_k, in_n) / 2 else out_k * in_n
        # The backward keeps the materialised delta weight (out x in), nothing per row.
        return out_l * in_m + w2, 0, in_features * out_features

    def first_factor(self, parts: Mapping[str, torch.Tensor]) -> str:
        return "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"

    def fc1_rows(self, module: str, parts: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
        # kron(w1, w2): output row i = a * out_k + b. Halves swap as w1's rows do when out_l is even.
        out_l = parts[self.first_factor(parts)].shape[0]
        if out_l % 2 == 0:
            return ("lokr_w1", "lokr_w1_a")
        if out_l == 1:
            return ("lokr_w2", "lokr_w2_a")
        raise ValueError(f"'{module}': a LoKr of {out_l} x ... Kronecker rows cannot swap the SwiGLU halves")

    def fuse_qkv(self, name: str, thirds: Mapping[int, Mapping[str, Any]]) -> dict:
        raise ValueError(
            f"'{name}': the original layout fuses to_q, to_k and to_v into one Linear, and LoKr's Kronecker "
            "products do not fuse; export the diffusers format or merge, or leave to_q / to_k / to_v out of "
            "lora.target_modules"
        )


class LohaKind(LycorisKind):
    """`W + s (w1_a @ w1_b) * (w2_a @ w2_b)`: peft's `LoHaConfig` (Hadamard product of two rank-r products)."""

    name = "loha"
    label = "LoHa"
    peft_type = "LOHA"
    factors = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
    zero_factors = ("hada_w2_b",)
    scaled_factor = "hada_w1_a"
    no_diffusers_file = (
        "diffusers' LoRA loader reads LoRA, DoRA and LoKr adapters, not LoHa; export the ComfyUI format "
        "(LyCORIS hada_ keys) or merge instead"
    )

    @property
    def peft_class(self) -> type:
        from peft import LoHaConfig

        return LoHaConfig

    def layer_counts(self, rank: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        return 2 * rank * (in_features + out_features), 0, in_features * out_features

    def fc1_rows(self, module: str, parts: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
        return ("hada_w1_a", "hada_w2_a")

    def fuse_qkv(self, name: str, thirds: Mapping[int, Mapping[str, Any]]) -> dict:
        # Each Hadamard factor's product fuses as a LoRA pair does: `_b` stacked, `_a` block-diagonal.
        return fuse_pairs(thirds, (("hada_w1_b", "hada_w1_a"), ("hada_w2_b", "hada_w2_a")))


#: Kind name -> the kind, in registration order.
ADAPTER_KINDS: dict[str, AdapterKind] = {}


def register_adapter_kind(kind: AdapterKind) -> AdapterKind:
    """Add `kind` to the table; a kind `lora.kind` can name becomes one of its choices."""
    # A kind another key selects (DoRA: `lora.use_dora`) is no `lora.kind` value.
    key = "lora.kind" if kind.setting == f"lora.kind={kind.name}" else None
    return register_entry(ADAPTER_KINDS, kind, "adapter kind", key)


for _kind in (LoraKind(), DoraKind(), LokrKind(), LohaKind()):
    register_adapter_kind(_kind)


def config_kind(lora: Any) -> AdapterKind:
    """The kind a `LoraConfig` asks for (`lora.kind`, `lora.use_dora`)."""
    for kind in reversed(ADAPTER_KINDS.values()):
        if kind.selected_by(lora):
            return kind
    raise ConfigError(f"config key 'lora.kind' is {lora.kind!r}; {one_of(lora.kind, kind_choices())}")


def record_kind(record: Mapping[str, Any]) -> AdapterKind:
    """The kind of a recorded peft config; the latest registered kind that matches it."""
    for kind in reversed(ADAPTER_KINDS.values()):
        if kind.matches(record):
            return kind
    peft_type = str(record.get("peft_type") or "LORA")
    raise ValueError(
        f"peft_type {peft_type!r} is not one of the adapter kinds h3train trains ({', '.join(ADAPTER_KINDS)})"
    )


def kind_choices() -> tuple[str, ...]:
    """The values `lora.kind` takes."""
    return tuple(k.name for k in ADAPTER_KINDS.values() if k.setting == f"lora.kind={k.name}")


def adapter_factors() -> tuple[str, ...]:
    """Every registered kind's parameter file-name suffixes."""
    return tuple(dict.fromkeys(f for kind in ADAPTER_KINDS.values() for f in kind.factors))


def zero_factors() -> tuple[str, ...]:
    """The factors peft starts at zero, so that the adapted layer starts as its base."""
    return tuple(dict.fromkeys(f for kind in ADAPTER_KINDS.values() for f in kind.zero_factors))
