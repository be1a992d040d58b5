"""`h3train export` of a LoRA checkpoint: the diffusers format, the ComfyUI format, or merged weights.

Every adapter kind (`lora.adapter_kinds.ADAPTER_KINDS`: LoRA, DoRA, LoKr, LoHa) exports the same way; which format holds
which kind, and under which names, is `lora/files.py`'s table. A format that cannot hold the checkpoint's
adapter (LoHa in the diffusers format, LoKr on to_q / to_k / to_v in the ComfyUI one) is a one-line
`UsageError` pointing to the formats that can; `--merge` takes every kind.

A LoRA checkpoint (`trainer_state.json` has `lora`, the adapter's peft config, and `lora_base`,
`base.py`) holds the trainable parameters only, under their live FQNs in the DCP component `model`
(`model.transformer.<module>.lora_A.default.weight`) and, with an EMA, again under `ema`. They are
read whole (megabytes) and renamed to the names files use (`names.export_name`).

- `diffusers` (default): `pytorch_lora_weights.safetensors` (`export.save_diffusers_lora`), keys
  under `transformer.` or, for a ref2va run, `transformer_ref.`.
- `comfyui`: `lora_comfyui.safetensors` (`export.save_comfyui_lora`).
  Either file takes another name with `name` (`h3train export --name`, a `.safetensors` file name).
- `merge`: a diffusers transformer folder, the adapters folded into the base the run trained on.
  The base is read from the pretrained folder the checkpoint records (or `base`, the same weights
  moved elsewhere: the digest must match), one of its weight files at a time, or rebuilt from the
  seed of a random base. Each base weight is first taken as the run held it (bfloat16 outside the
  float32 islands), so the merged model computes what the trained one did; it is stored in `dtype`
  (islands stay float32).

A run with `lora.train_modules` has fully trained weights beside its adapters. A LoRA file cannot
carry them (diffusers' `load_lora_adapter` reads LoRA factors only; a norm weight in the file would be
dropped or refused), so the two LoRA formats refuse such a checkpoint and point to `--merge`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, ConfigError, UsageError
from ..lora.adapter_kinds import record_kind
from ..lora.base import as_trained, folder_digest, island_prefixes, random_base_state, read_record
from ..lora.files import (
    COMFYUI_WEIGHT_NAME,
    DIFFUSERS_WEIGHT_NAME,
    adapter_groups,
    comfyui_state_dict,
    save_comfyui_lora,
    save_diffusers_lora,
)
from ..lora.names import export_name, split_factor
from ..tasks.table import PARTITIONS, TRAINING_TASKS

# `--format` -> what its export is, as `h3train export` reports it.
FORMATS = {"diffusers": "diffusers LoRA file", "comfyui": "ComfyUI LoRA file"}


# The folder inside a checkpoint that holds the adapter files `checkpoint.export` writes at each save:
# inside the step folder, so `keep_last` prunes them and `keep_best` keeps them with it. The digests
# recorded at commit name the checkpoint's own files only, so the folder added after commit changes
# neither its verification nor a resume from it.
SAVE_FOLDER = "lora"
# `checkpoint.export` -> the formats each save of a LoRA run writes beside its checkpoint.
SAVE_FORMATS = {"none": (), "diffusers": ("diffusers",), "comfyui": ("comfyui",), "both": ("diffusers", "comfyui")}


def format_problem(fmt: str, adapters: dict[str, torch.Tensor], lora_config: dict) -> str | None:
    """Why format `fmt` cannot hold these adapters (their kind, their modules), in a few words; None if it can.

    Shapes alone decide it, so CPU zeros of the adapters' shapes stand in for trained values.
    """
    kind = record_kind(lora_config)
    try:
        if fmt == "diffusers":
            if kind.no_diffusers_file:
                return kind.no_diffusers_file
            for module, parts in adapter_groups(adapters).items():
                kind.check_parts(module, parts)
        else:
            comfyui_state_dict(adapters, lora_config)
    except ValueError as exc:
        return str(exc)
    return None


def check_save_formats(setting: str, adapters: dict[str, torch.Tensor], lora_config: dict) -> None:
    """`checkpoint.export=setting` against the run's adapters: a one-line `ConfigError` when a format
    cannot hold them, naming the setting that works."""
    wanted = SAVE_FORMATS[setting]
    problems = {fmt: format_problem(fmt, adapters, lora_config) for fmt in SAVE_FORMATS["both"]}
    for fmt in wanted:
        if problems[fmt] is not None:
            fits = [f for f in SAVE_FORMATS["both"] if problems[f] is None]
            instead = f"checkpoint.export={fits[0]}" if fits else "checkpoint.export=none (--merge exports it)"
            raise ConfigError(
                f"config key 'checkpoint.export' is {setting!r}, and {record_kind(lora_config).setting} has no "
                f"{FORMATS[fmt]}: {problems[fmt].rstrip('.')}; set {instead}"
            )


def is_lora_checkpoint(state: dict[str, Any]) -> bool:
    return state.get("lora") is not None


def trained_partition(state: dict[str, Any]) -> str:
    """`transformer` or `transformer_ref`: the partition the run trained, from its saved config."""
    try:
        saved = yaml.safe_load(state.get("config_yaml") or "") or {}
    except yaml.YAMLError:
        saved = {}
    subfolder = (saved.get("model") or {}).get("subfolder")
    if subfolder in PARTITIONS:
        return subfolder
    task = TRAINING_TASKS.get((saved.get("task") or {}).get("name", "fl2va"))
    # Mixed (no partition of its own): a pretrained run named one in `model.subfolder`; a random init is `transformer`.
    return (task.partition if task else None) or PARTITIONS[0]


def is_lora_factor(name: str) -> bool:
    """Whether a file name (`names.export_name`) is an adapter's parameter (LoRA factor, DoRA magnitude,
    LoKr or LoHa factor), what a LoRA file holds."""
    return split_factor(name) is not None


def read_trained(checkpoint: Path, reader, metadata, component: str) -> dict[str, torch.Tensor]:
    """The trainable tensors of component `model` or `ema`, float32, under file names."""
    prefix = f"{component}.transformer."
    keys = [k for k in metadata if k.startswith(prefix)]
    buffers = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    try:
        dcp.load(buffers, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any read failure: unreadable
        from ..checkpoint import read_failure_reason

        raise CheckpointError(f"checkpoint '{checkpoint}' cannot be read: {read_failure_reason(exc)}") from exc
    return {export_name(k.removeprefix(prefix)): v.float().contiguous() for k, v in buffers.items()}


def write_lora_export(
    checkpoint: Path,
    out: Path,
    state: dict[str, Any],
    trained: dict[str, torch.Tensor],
    fmt: str,
    merge: bool,
    dtype: torch.dtype,
    base: Path | None,
    name: str | None = None,
) -> str | None:
    """Write the export of a LoRA checkpoint into the (new, empty) folder `out`.

    Returns the LoRA file's name (`name`, else the format's own), or None for a merged folder.
    """
    lora_config = state["lora"]
    adapters = {k: v for k, v in trained.items() if is_lora_factor(k)}
    if base is not None and not merge:
        raise UsageError("--base is the pretrained base for --merge; add --merge or drop --base")
    if merge:
        _write_merged(checkpoint, out, state, trained, lora_config, dtype, base)
        return None
    others = sorted(k for k in trained if k not in adapters)
    if others:
        more = f" (and {len(others) - 1} more)" if others[1:] else ""
        raise UsageError(
            f"checkpoint '{checkpoint}' also trains {others[0]}{more} in full (lora.train_modules), "
            "which a LoRA file cannot hold; export it with --merge"
        )
    out.mkdir(parents=True, exist_ok=True)
    try:
        if fmt == "comfyui":
            name = name or COMFYUI_WEIGHT_NAME
            save_comfyui_lora(out / name, adapters, lora_config)
        else:
            name = name or DIFFUSERS_WEIGHT_NAME
            save_diffusers_lora(out, adapters, lora_config, partition=trained_partition(state), weight_name=name)
    except ValueError as exc:  # what the adapter's kind or modules cannot be in this format: one line
        raise UsageError(
            f"checkpoint '{checkpoint}' ({record_kind(lora_config).setting}) has no {FORMATS[fmt]}: {exc}"
        ) from None
    sort_file_metadata(out / name)
    return name


def sort_file_metadata(path: Path) -> None:
    """Put the `__metadata__` entries of safetensors file `path` in name order, in place (same length).

    safetensors writes them in the order of a Rust hash map, which changes from process to process, so
    two exports of one checkpoint would differ in bytes; sorted, a checkpoint has one file. `path` is in
    a folder not yet renamed into place (`out` above), so the in-place write is never seen half done.
    A header that would not keep its length stays as written.
    """
    with open(path, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None)
        if not metadata:
            return
        ordered = {"__metadata__": dict(sorted(metadata.items())), **header}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:
            return
        f.seek(8)
        f.write(text.ljust(size, b" "))


def _base_groups(
    checkpoint: Path, state: dict[str, Any], base: Path | None
) -> Iterator[tuple[str | None, dict[str, torch.Tensor]]]:
    """The base weights as trained, in groups: (weight file name or None, tensors under diffusers names)."""
    record = read_record(state) or {}
    model_config = state["model_config"]
    if record.get("kind") == "random":
        if base is not None:
            raise UsageError(
                f"--base: checkpoint '{checkpoint}' was trained on a random base (train.seed={record.get('seed')}), "
                "which --merge rebuilds; drop --base"
            )
        yield None, random_base_state(model_config, int(record["seed"]))
        return
    folder = base or Path(str(record.get("folder")))
    if not folder.is_dir():
        raise UsageError(
            f"--merge needs the base checkpoint '{checkpoint}' was trained on, and '{folder}' is not readable "
            "here; pass --base DIR with those weights"
        )
    if folder_digest(folder) != record.get("digest"):
        raise UsageError(
            f"--merge: the weights in '{folder}' are not the base checkpoint '{checkpoint}' was trained on "
            "(their file names or sizes differ); pass --base DIR with that base"
        )
    islands = island_prefixes(model_config)
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(file, "pt") as f:
            tensors = {k: as_trained(k, f.get_tensor(k), islands) for k in f.keys()}  # noqa: SIM118
        # One file takes the name `from_pretrained` looks for; shards keep theirs (the index names them).
        yield (file.name if len(files) > 1 else None), tensors


def _write_merged(
    checkpoint: Path,
    out: Path,
    state: dict[str, Any],
    trained: dict[str, torch.Tensor],
    lora_config: dict,
    dtype: torch.dtype,
    base: Path | None,
) -> None:
    from ..infra.atomic import apply_file_mode, atomic_save_file, atomic_write_text
    from ..lora.files import merge_adapters
    from ..model.build import meta_transformer

    model_config = state["model_config"]
    islands = island_prefixes(model_config)
    groups = _base_groups(checkpoint, state, base)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    names: list[str] = []
    total = 0
    applied: set[str] = set()
    for file_name, group in groups:
        mine = {k: v for k, v in trained.items() if _target_weight(k) in group}
        applied.update(mine)
        merged = merge_adapters(group, mine, lora_config)
        tensors = {k: (v if k.startswith(islands) else v.to(dtype)).contiguous() for k, v in merged.items()}
        name = file_name or "diffusion_pytorch_model.safetensors"
        atomic_save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        names.append(name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    left = sorted(set(trained) - applied)
    if left:
        raise CheckpointError(f"checkpoint '{checkpoint}': {left[0]} adapts no weight of the base model")
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out / "diffusion_pytorch_model.safetensors.index.json", json.dumps(index, indent=2))
    meta_transformer(model_config).save_config(out)
    apply_file_mode(out / "config.json")


def _target_weight(name: str) -> str:
    """The base weight a trained tensor changes: `m.lora_A.weight`, `m.lokr_w1` -> `m.weight`; a full one itself."""
    split = split_factor(name)
    return f"{split[0]}.weight" if split is not None else name


def write_save_files(checkpoint: Path, setting: str) -> list[Path]:
    """Write the adapter files of `checkpoint.export=setting` into `<checkpoint>/lora/`; returns them.

    Each file is what `h3train export --format <format>` writes from the committed checkpoint: the same
    tensors, read back from its DCP files (the adapters only: megabytes, no collective, so a background
    save runs this on its writer thread), and the same writer. The files are written into a temporary
    folder beside, renamed into place whole, so a crash midway leaves no file under its final name. An
    existing `lora/` is left as it is (`FileExistsError`).
    """
    from ..checkpoint import NamingReader, read_trainer_state
    from ..infra.atomic import apply_file_mode, fsync_path

    final = checkpoint / SAVE_FOLDER
    if final.exists():
        raise FileExistsError(f"'{final}' exists already")
    state = read_trainer_state(checkpoint)
    reader = NamingReader(checkpoint)
    trained = read_trained(checkpoint, reader, reader.read_metadata().state_dict_metadata, "model")
    tmp = checkpoint / f".tmp-{SAVE_FOLDER}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        names = [
            write_lora_export(checkpoint, tmp, state, trained, fmt, False, torch.float32, None)
            for fmt in SAVE_FORMATS[setting]
        ]
        for name in names:
            apply_file_mode(tmp / name)
            fsync_path(tmp / name)
        os.replace(tmp, final)
        fsync_path(checkpoint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [final / name for name in names]
