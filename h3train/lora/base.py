"""The frozen base of a LoRA run: what a checkpoint records about it, and how it is rebuilt.

A LoRA checkpoint holds the trainable state only, so resuming or exporting it needs the very base it
was trained on. `trainer_state.json` records it under `lora_base`:

- a pretrained base: `{"kind": "pretrained", "folder": ..., "digest": ...}`, the digest a SHA-256
  over the names and byte sizes of the folder's `*.safetensors` files and the text of its
  `*.safetensors.index.json` (cheap on 66 GB of weights, and it changes when the weights do: a
  re-sharded, re-quantised or other checkpoint has other files or sizes);
- a random base: `{"kind": "random", "seed": train.seed}`, rebuilt by `build_model(cfg, seed)`.

The model config is recorded beside it (`model_config`) and checked as for any resume.

`as_trained` gives a base weight as the run computed with it: outside the float32 islands rounded to
bfloat16 (`BASE_DTYPE`), returned in float32; `random_base_state` the whole seeded random base so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

BASE_KEY = "lora_base"
# The frozen base is held in bfloat16 outside the float32 islands; adapters and train_modules in float32.
BASE_DTYPE = torch.bfloat16


def folder_digest(folder: Path) -> str:
    """SHA-256 over the weight files' names and sizes and the index text of a diffusers model folder."""
    h = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        h.update(f"{file.name}\0{file.stat().st_size}\n".encode())
    for index in sorted(folder.glob("*.safetensors.index.json")):
        h.update(index.name.encode() + b"\0" + index.read_bytes())
    return h.hexdigest()


def base_record(pretrained: Path | None, seed: int, quant: str = "none") -> dict[str, Any]:
    """What `trainer_state.json` records about the base of a LoRA run (see the module docstring);
    `quant`: `lora.base_quant`, recorded when the base is quantized."""
    if pretrained is not None:
        record = {"kind": "pretrained", "folder": str(pretrained.resolve()), "digest": folder_digest(pretrained)}
    else:
        record = {"kind": "random", "seed": int(seed)}
    return {**record, "quant": quant} if quant != "none" else record


def _describe(record: dict[str, Any]) -> str:
    quant = f", lora.base_quant={record['quant']}" if record.get("quant", "none") != "none" else ""
    if record.get("kind") == "pretrained":
        return f"the pretrained base '{record.get('folder')}' (digest {str(record.get('digest'))[:12]}{quant})"
    return f"a random base of train.seed={record.get('seed')}{quant}"


def check_same_base(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> None:
    """A LoRA checkpoint resumes only on the base it was trained on; CheckpointError otherwise.

    A pretrained base is compared by digest (the folder may have moved), a random one by its seed.
    """
    if saved is None:
        raise CheckpointError(
            f"checkpoint '{path}' records no LoRA base (it is not a LoRA checkpoint); resume it with lora.rank=0 "
            "or set checkpoint.resume=none"
        )
    same = (
        saved.get("quant", "none") == current.get("quant", "none")
        and saved.get("kind") == current.get("kind")
        and (
            saved.get("digest") == current.get("digest")
            if current.get("kind") == "pretrained"
            else saved.get("seed") == current.get("seed")
        )
    )
    if not same:
        raise CheckpointError(
            f"checkpoint '{path}' was trained on {_describe(saved)}, this run has {_describe(current)}; "
            "resume on the same base (model.pretrained, or train.seed for a random one, and lora.base_quant) "
            "or set checkpoint.resume=none"
        )


def as_trained(name: str, value: torch.Tensor, islands: tuple[str, ...]) -> torch.Tensor:
    """A base weight as the LoRA run held it (bf16 outside the float32 islands), in float32."""
    if name.startswith(islands):
        return value.float()
    return value.to(BASE_DTYPE).float()


def random_base_state(model_config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The seeded random base of `build_model(cfg, seed)`, as trained (see `as_trained`), diffusers names."""
    from ..model.build import build_seeded, fp32_island_names

    model = build_seeded(model_config, seed)
    islands = tuple(f"{n}." for n in fp32_island_names(model))
    return {k: as_trained(k, v, islands) for k, v in model.state_dict().items()}


def island_prefixes(model_config: dict[str, Any]) -> tuple[str, ...]:
    """`name.` of each float32 island of the architecture `model_config` (built on meta)."""
    from ..model.build import fp32_island_names, meta_transformer

    return tuple(f"{n}." for n in fp32_island_names(meta_transformer(model_config)))


def read_record(state: dict[str, Any]) -> dict[str, Any] | None:
    """The `lora_base` record of a trainer state (None for a full fine-tune)."""
    record = state.get(BASE_KEY)
    return json.loads(json.dumps(record)) if record is not None else None
