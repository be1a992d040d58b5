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
parameter names, so every peft adapter kind is named the same way; `FACTORS` lists the parameter
names of the kinds h3train trains (`adapters.KINDS`), for the readers that take a file name apart.
"""

from __future__ import annotations

ADAPTER_NAME = "default"
# peft's state-dict name of a DoRA magnitude: its live `<module>.lora_magnitude_vector.<adapter>.weight`.
MAGNITUDE = "lora_magnitude_vector"
# File-name suffix of each adapter parameter, after `<module>.`: LoRA (DoRA adds the magnitude), LoKr, LoHa.
FACTORS = (
    "lora_A.weight",
    "lora_B.weight",
    MAGNITUDE,
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter path of the live model belongs to an adapter."""
    return ADAPTER_NAME in name.split(".")


def export_name(name: str, adapter: str = ADAPTER_NAME) -> str:
    """Live parameter path -> its name in files (base: diffusers name, adapter: peft state-dict name)."""
    out = ".".join(part for part in name.split(".") if part not in ("base_layer", adapter))
    return out.removesuffix(".weight") if out.endswith(f".{MAGNITUDE}.weight") else out


def split_factor(name: str) -> tuple[str, str] | None:
    """A file name of an adapter parameter -> (module path, factor: one of `FACTORS`); None otherwise."""
    for factor in FACTORS:
        if name.endswith(f".{factor}"):
            return name.removesuffix(f".{factor}"), factor
    return None


def pretrained_key(name: str) -> str | None:
    """The pretrained checkpoint's key for a live parameter path; None for an adapter (not in it)."""
    return None if is_adapter_param(name) else export_name(name)
