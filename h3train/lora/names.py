"""Parameter names of a peft-adapted transformer, and the names files use for them.

peft wraps each adapted layer: its weight moves to `<module>.base_layer.weight`, and every parameter
the adapter adds sits in a dict keyed by the adapter's name (`ADAPTER_NAME`): LoRA's
`<module>.lora_A.<adapter>.weight`, a DoRA magnitude `<module>.lora_magnitude_vector.<adapter>.weight`,
LoKr's `<module>.lokr_w1.<adapter>`, LoHa's `<module>.hada_w1_a.<adapter>`. Files name them as
diffusers and peft do outside the live model: the base under the transformer's own name
(`<module>.weight`) and the adapters under the names `peft.get_peft_model_state_dict` gives (the
adapter's name dropped: `<module>.lora_A.weight`, `<module>.lokr_w1`; a DoRA magnitude, a module of
its own in the live model, is `<module>.lora_magnitude_vector`), which are also the names in a
diffusers LoRA file after its `transformer.` prefix.

Which parameters are an adapter's goes by the adapter's name, not by any one adapter kind's
parameter names, so every peft adapter kind is named the same way; the readers that take a file name
apart (`split_factor`) know the parameter names of every registered kind (`adapter_kinds.adapter_factors`).
"""

from __future__ import annotations

from .adapter_kinds import MAGNITUDE, adapter_factors

ADAPTER_NAME = "default"


def is_adapter_param(name: str) -> bool:
    """Whether a parameter path of the live model belongs to an adapter."""
    return ADAPTER_NAME in name.split(".")


def export_name(name: str, adapter: str = ADAPTER_NAME) -> str:
    """Live parameter path -> its name in files (base: diffusers name, adapter: peft state-dict name)."""
    out = ".".join(part for part in name.split(".") if part not in ("base_layer", adapter))
    return out.removesuffix(".weight") if out.endswith(f".{MAGNITUDE}.weight") else out


def split_factor(name: str) -> tuple[str, str] | None:
    """A file name of an adapter parameter -> (module path, factor: a kind's `factors`); None otherwise."""
    for factor in adapter_factors():
        if name.endswith(f".{factor}"):
            return name.removesuffix(f".{factor}"), factor
    return None


def pretrained_key(name: str) -> str | None:
    """The pretrained checkpoint's key for a live parameter path; None for an adapter (not in it)."""
    return None if is_adapter_param(name) else export_name(name)
