"""Parameter names of a peft-adapted transformer, and the names files use for them.

peft wraps each target Linear: its weight moves to `<module>.base_layer.weight` and the adapter
adds `<module>.lora_A.<adapter>.weight` / `<module>.lora_B.<adapter>.weight`. Files name them as
diffusers and peft do outside the live model: the base under the transformer's own name
(`<module>.weight`) and the adapters under the names `peft.get_peft_model_state_dict` gives
(`<module>.lora_A.weight`), which are also the names in a diffusers LoRA file after its
`transformer.` prefix.
"""

from __future__ import annotations

ADAPTER_NAME = "default"
LORA_PARTS = ("lora_A", "lora_B")


def is_adapter_param(name: str) -> bool:
    """Whether a parameter path of the live model belongs to a LoRA adapter."""
    return any(f".{part}." in name for part in LORA_PARTS)


def export_name(name: str, adapter: str = ADAPTER_NAME) -> str:
    """Live parameter path -> its name in files (base: diffusers name, adapter: peft state-dict name)."""
    name = name.replace(".base_layer.", ".")
    for part in LORA_PARTS:
        name = name.replace(f".{part}.{adapter}.", f".{part}.")
    return name


def pretrained_key(name: str) -> str | None:
    """The pretrained checkpoint's key for a live parameter path; None for an adapter (not in it)."""
    return None if is_adapter_param(name) else export_name(name)
