"""Checks that need the filesystem or the device, run before any process group or model exists.

Each failure is one line naming the key, file or sample and what to do (a `ConfigError`, or a
`DatasetError` / `SampleError` for the data itself), exit code 2.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from .config import Config, model_dims, planned_model_dims, pretrained_config_file
from .data.dataset import TASK_FILTERS, index_entries
from .data.format import INDEX_NAME, read_header, resolve_in_folder
from .errors import ConfigError, DatasetError
from .tasks.partition import check_partition

# `model.attention_backend` -> diffusers' `dispatch_attention_fn` backend name.
ATTENTION_BACKENDS = {"native": "native", "flash": "flash", "cudnn": "_native_cudnn"}


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention_backend(name: str, device_type: str, dtype: str = "bfloat16") -> str:
    """The diffusers backend for `model.attention_backend`.

    `auto` picks flash-attn on CUDA when it is installed and the blocks compute in bf16 (flash-attn
    and cuDNN attention take half precision only), else PyTorch SDPA.
    """
    if name == "auto":
        name = "flash" if device_type == "cuda" and dtype == "bfloat16" and flash_attn_available() else "native"
    if name in ("flash", "cudnn") and dtype != "bfloat16":
        raise ConfigError(
            f"config key 'model.attention_backend' is '{name}', which computes in half precision "
            f"only, but model.dtype is '{dtype}'; use model.dtype=bfloat16 or 'native'"
        )
    if name in ("flash", "cudnn") and device_type != "cuda":
        raise ConfigError(
            f"config key 'model.attention_backend' is '{name}', which needs a CUDA device; "
            "use 'native' or 'auto' on this machine"
        )
    if name == "flash" and not flash_attn_available():
        raise ConfigError(
            "config key 'model.attention_backend' is 'flash' but flash-attn is not installed; "
            "install the 'flash' extra or use 'auto'"
        )
    return ATTENTION_BACKENDS[name]


def device_type(cfg: Config) -> str:
    return "cuda" if cfg.parallel.backend != "gloo" and torch.cuda.is_available() else "cpu"


def preflight(cfg: Config, planning: bool = False) -> list[str]:
    """Inputs and device capabilities the config names exist, before any model or process group.

    Every check is cheap: the model is built on the meta device, and of the dataset only
    `index.jsonl` and one sample header are read. `planning` (`h3train check`) plans for what it
    cannot see here, the released architecture for a missing model folder and the longest released
    clip for a missing dataset, and returns a note for each such assumption; training needs both.
    """
    notes: list[str] = []
    if planning:
        dims, note = planned_model_dims(cfg)
        notes += [note] if note else []
    else:
        dims = model_dims(cfg)
    if not notes:
        _check_builds(cfg, dims)
    notes += _check_dataset(cfg, dims, required=not planning)
    check_partition(cfg)
    kind = device_type(cfg)
    resolve_attention_backend(cfg.model.attention_backend, kind, cfg.model.dtype)
    if cfg.model.dtype == "bfloat16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("config key 'model.dtype' is 'bfloat16' but this GPU has no bf16 support; use float32")
    return notes


def _model_source(cfg: Config) -> str:
    if cfg.model.config:
        return "config key 'model.config'"
    return f"config key 'model.pretrained' ('{pretrained_config_file(cfg)}')"


def _check_builds(cfg: Config, dims: dict[str, Any]) -> None:
    """The architecture builds: on the meta device, so a 33 B model costs no memory and a fraction of a second."""
    from diffusers import MiniMaxH3Transformer3DModel

    try:
        with torch.device("meta"):
            MiniMaxH3Transformer3DModel(**dims)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is a bad model config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{_model_source(cfg)} does not build a MiniMaxH3Transformer3DModel ({type(exc).__name__}: {first})"
        ) from None


def _dataset_task(tasks: set[str]) -> str:
    """The `task.name` that trains every sample task in `tasks`."""
    if tasks <= set(TASK_FILTERS["fl2va"]):
        return "fl2va"
    return "ref2va" if tasks == {"ref2va"} else "mixed"


def _check_dataset(cfg: Config, dims: dict[str, Any], required: bool) -> list[str]:
    """A cached dataset is there, lists samples of the task, and its text width is the model's.

    Reads `index.jsonl` and the header of the first sample that trains: the samples of one
    dataset come from one text encoder, so one header tells the width of all of them.
    """
    data = cfg.data
    if data.source != "cached":
        return []
    folder = Path(data.path)
    index = folder / INDEX_NAME
    if not index.is_file():
        if data.create_synthetic:
            return []  # written at start-up, with the model's text width
        if required:
            raise ConfigError(
                f"config key 'data.path': no dataset at '{data.path}' (no {INDEX_NAME}); encode one with "
                "'h3train encode' or write a synthetic one with 'h3train synth'"
            )
        return [f"data: no dataset at '{data.path}' here; planned for the longest released clip"]
    try:
        entries = index_entries(folder)
    except DatasetError as exc:
        raise DatasetError(f"{exc}; fix the line or rebuild the index with h3train.data.format.write_index") from None
    if not entries:
        raise DatasetError(
            f"dataset '{folder}': '{index}' lists no samples; encode the data with 'h3train encode' "
            "or rebuild the index with h3train.data.format.write_index"
        )
    accepted = TASK_FILTERS[cfg.task.name]
    trained = [e for e in entries if e.task in accepted]
    if not trained:
        found = {e.task for e in entries}
        raise ConfigError(
            f"config key 'task.name' is '{cfg.task.name}' (it trains {', '.join(accepted)} samples) but dataset "
            f"'{folder}' holds only {', '.join(sorted(found))} samples; use task.name={_dataset_task(found)} "
            f"or a {cfg.task.name} dataset"
        )
    sample = resolve_in_folder(folder, trained[0].file, f"index '{index}'")
    width = read_header(sample).specs["prompt_embeds"].shape[-1]
    text_dim = int(dims["text_dim"])
    if width != text_dim:
        raise ConfigError(
            f"{_model_source(cfg)} gives text_dim={text_dim} but dataset '{folder}' holds prompt embeddings "
            f"{width} wide (sample '{sample}'); "
            + (
                f"set model.config.text_dim={width} or encode the data with the matching text encoder"
                if cfg.model.config
                else "encode the data with this model's text encoder, or use the model it was encoded for"
            )
        )
    return []
