"""`lora.init_from`: start the adapters from an existing LoRA file instead of the seeded init.

The file is read by diffusers' own H3 loader (`MiniMaxH3LoraLoaderMixin.lora_state_dict`), so every
format it reads works: the diffusers format (`transformer.` or `transformer_ref.` keys, peft config
in the metadata) and the original-layout ones (ComfyUI / ai-toolkit `diffusion_model.`, musubi
`lora_unet_`, DiffSynth), which it converts to diffusers names with any `alpha` folded in.

The values are rescaled so the adapted layer computes the same `scale_file * B @ A` under this
run's `lora.alpha / lora.rank`; lora_A takes the factor, and equal scales copy the file unchanged.
A fused `attn.qkv_proj` in the original layout converts to `to_q` / `to_k` / `to_v` adapters of
the fused rank sharing one lora_A; a file this trainer wrote (each projection's lora_B non-zero
only in its own block of columns) is split back into the per-projection rank-r factors exactly.
Anything else that does not fit the configured adapters is a `ConfigError` naming the module.

A DoRA run (`lora.use_dora`) takes the magnitudes a DoRA file holds (`<module>.lora_magnitude_vector`,
the diffusers format h3train writes) as they are; from a plain LoRA file its magnitudes are the row
norms of `W + s B A` (`adapters.adapter_values`), so it starts computing what the LoRA did. A plain
LoRA run refuses a DoRA file (it would drop the magnitudes). The LyCORIS kinds (`lora.kind` lokr,
loha) take no file (their `AdapterKind.reads_init_from`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..tasks.table import PARTITIONS
from .names import MAGNITUDE

_QKV = (".attn.to_q", ".attn.to_k", ".attn.to_v")


def _key(msg: str) -> ConfigError:
    return ConfigError(f"config key 'lora.init_from': {msg}")


def read_lora_file(path: str) -> tuple[dict[str, torch.Tensor], float | None]:
    """(factors under peft state-dict names, the file's `lora_alpha` or None when folded / alpha == rank)."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    try:
        state_dict, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(path, return_lora_metadata=True)
    except Exception as exc:  # noqa: BLE001 - any reader error becomes one line
        raise _key(f"'{path}' is not a LoRA file diffusers' H3 loader reads: {str(exc).splitlines()[0]}") from None
    found = [p for p in PARTITIONS if any(k.startswith(f"{p}.") for k in state_dict)]
    if len(found) != 1:
        raise _key(f"'{path}' holds LoRA weights for {found or 'no'} partition(s); one of {list(PARTITIONS)} is needed")
    prefix = f"{found[0]}."
    factors = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    alpha = None
    if metadata:
        if metadata.get(f"{prefix}rank_pattern") or metadata.get(f"{prefix}alpha_pattern"):
            raise _key(f"'{path}' has per-module ranks or alphas, which lora.rank / lora.alpha cannot express")
        alpha = metadata.get(f"{prefix}lora_alpha")
    return factors, None if alpha is None else float(alpha)


def _split_fused(module: str, a: torch.Tensor, b: torch.Tensor, rank: int, siblings: list[str]):
    """This projection's rank-r factors from a fused-qkv conversion, or None when they are not separable."""
    n = a.shape[0] // rank
    if a.shape[0] != n * rank or n != len(siblings) or module not in siblings:
        return None
    i = siblings.index(module)
    cols = b.reshape(b.shape[0], n, rank)
    if any(torch.count_nonzero(cols[:, j]) for j in range(n) if j != i):
        return None
    return a[i * rank : (i + 1) * rank], b[:, i * rank : (i + 1) * rank].contiguous()


def init_values(path: str, shapes: dict[str, torch.Size], scale: float) -> dict[str, torch.Tensor]:
    """Values for the adapter parameters `shapes` (peft state-dict names) from the file at `path`."""
    factors, alpha = read_lora_file(path)
    modules = sorted({k.removesuffix(".lora_A.weight") for k in shapes if k.endswith(".lora_A.weight")})
    file_modules = {k.removesuffix(".lora_A.weight") for k in factors if k.endswith(".lora_A.weight")}
    missing = [m for m in modules if m not in file_modules]
    extra = sorted(file_modules - set(modules))
    if extra:
        raise _key(f"'{path}' adapts {extra[0]} (and {len(extra) - 1} more), which lora.target_modules does not select")
    if missing:
        raise _key(
            f"'{path}' has no adapter for {missing[0]} (and {len(missing) - 1} more) that lora.target_modules selects"
        )
    magnitudes = {k for k in factors if k.endswith(f".{MAGNITUDE}")}
    if magnitudes and not any(k.endswith(f".{MAGNITUDE}") for k in shapes):
        raise _key(f"'{path}' holds DoRA magnitudes ({sorted(magnitudes)[0]}, ...); set lora.use_dora=true to train it")
    out = {}
    for key in sorted(magnitudes & set(shapes)):
        if factors[key].shape != shapes[key]:
            raise _key(f"'{path}': {key} has {factors[key].numel()} values, the layer has {shapes[key][0]} outputs")
        out[key] = factors[key].float().contiguous()
    for module in modules:
        a, b = factors[f"{module}.lora_A.weight"].float(), factors[f"{module}.lora_B.weight"].float()
        want_a, want_b = shapes[f"{module}.lora_A.weight"], shapes[f"{module}.lora_B.weight"]
        rank = want_a[0]
        file_scale = 1.0 if alpha is None else alpha / a.shape[0]
        if a.shape != want_a or b.shape != want_b:
            block = module.rsplit(".attn.", 1)[0] if module.endswith(_QKV) else None
            siblings = [block + s for s in _QKV if block + s in modules] if block else []
            split = _split_fused(module, a, b, rank, siblings) if siblings else None
            if split is None:
                raise _key(
                    f"'{path}': {module} has rank {a.shape[0]} (lora_A {list(a.shape)}), the run's adapter "
                    f"{list(want_a)}; set lora.rank to the file's rank"
                )
            a, b = split
        if file_scale != scale:
            a = a * (file_scale / scale)
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return out
