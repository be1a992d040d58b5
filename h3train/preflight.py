"""Checks that need the filesystem or the device, run before any process group or model exists.

Each failure is a `ConfigError`: one line naming the key and what to do, exit code 2.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .config import Config
from .errors import ConfigError

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


def preflight(cfg: Config) -> None:
    """Inputs and device capabilities the config names exist, before any heavy work."""
    data = cfg.data
    if data.source == "cached" and not data.create_synthetic and not (Path(data.path) / "index.jsonl").is_file():
        raise ConfigError(
            f"config key 'data.path': no dataset at '{data.path}' (no index.jsonl); encode one with "
            "'h3train encode' or write a synthetic one with 'h3train synth'"
        )
    kind = device_type(cfg)
    resolve_attention_backend(cfg.model.attention_backend, kind, cfg.model.dtype)
    if cfg.model.dtype == "bfloat16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("config key 'model.dtype' is 'bfloat16' but this GPU has no bf16 support; use float32")
