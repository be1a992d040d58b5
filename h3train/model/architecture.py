"""The transformer's constructor kwargs: diffusers' defaults, `model.config` or a pretrained config.json.

The plan, preflight, the LoRA checks and the model builder all read the architecture through these,
so a key the constructor does not take, or a size of the wrong sign, is one `ConfigError` naming the
key wherever it is first read. Kept out of the config package: they import diffusers and the task table,
and the config schema stays a leaf every module can import.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError, did_you_mean
from ..tasks.table import TRAINING_TASKS


def model_defaults() -> dict[str, Any]:
    """`MiniMaxH3Transformer3DModel`'s constructor defaults: the released MiniMax-H3 architecture."""
    from diffusers import MiniMaxH3Transformer3DModel

    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    return {name: p.default for name, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def model_kwargs(overrides: dict[str, Any]) -> dict[str, Any]:
    """Constructor kwargs of `MiniMaxH3Transformer3DModel`: the diffusers defaults, then `overrides`."""
    return {**model_defaults(), **overrides}


# Constructor arguments that may be 0 (every other integer is a size or a count that must be > 0).
_MAY_BE_ZERO = frozenset({"num_refiner_layers"})


def check_model_kwargs(kwargs: dict[str, Any], where: str, strict_keys: bool) -> None:
    """Each constructor argument has the type and sign of its diffusers default; `where` prefixes the key.

    `where` is e.g. "config key 'model.config." or "'.../config.json' key '". With `strict_keys`
    an argument the constructor does not take is an error (`model.config`); a pretrained
    config.json may carry extra keys diffusers ignores.
    """
    defaults = model_defaults()
    for name, value in kwargs.items():
        if name not in defaults:
            if strict_keys:
                raise ConfigError(
                    f"unknown {where}{name}': not a MiniMaxH3Transformer3DModel constructor argument "
                    f"(arguments: {', '.join(defaults)}){did_you_mean(str(name), defaults)}"
                )
            continue
        default = defaults[name]
        if isinstance(default, bool):
            ok, what = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
            ok = ok and (value >= 0 if name in _MAY_BE_ZERO else value > 0)
            what = f"{'an integer >= 0' if name in _MAY_BE_ZERO else 'a positive integer'}, e.g. {default}"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            what = f"a positive number, e.g. {default}"
        elif isinstance(default, tuple):
            ok = (
                isinstance(value, (list, tuple))
                and len(value) == len(default)
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
            )
            what = f"{len(default)} positive integers, e.g. {list(default)}"
        else:
            continue
        if not ok:
            raise ConfigError(f"{where}{name}' is {value!r}; it takes {what}")
    rope = kwargs.get("rope_freq_dim", defaults["rope_freq_dim"])
    head_dim = kwargs.get("attention_head_dim", defaults["attention_head_dim"])
    if 6 * rope > head_dim:
        raise ConfigError(
            f"{where}attention_head_dim' is {head_dim} but rotary embeddings rotate 2 * 3 * rope_freq_dim = "
            f"{6 * rope} channels per head; raise attention_head_dim or lower rope_freq_dim"
        )


def default_subfolder(cfg: Config) -> str:
    """The partition `model.subfolder` defaults to: the training task's (`transformer`, `transformer_ref`).

    `mixed` has no default: H3 ships one partition per task family, so it must be named
    (`h3train/tasks/partition.py`).
    """
    partition = TRAINING_TASKS[cfg.task.name].partition
    if partition is None:
        from ..tasks.partition import mixed_subfolder

        return mixed_subfolder(cfg)
    return partition


def pretrained_config_file(cfg: Config) -> Path:
    """The transformer's config.json in the pretrained folder, under `model.subfolder` or its default."""
    return Path(cfg.model.pretrained) / (cfg.model.subfolder or default_subfolder(cfg)) / "config.json"


def _read_pretrained_config(cfg_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(cfg_file.read_text())
    except OSError as exc:
        raise ConfigError(f"config key 'model.pretrained': cannot read '{cfg_file}': {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config key 'model.pretrained': '{cfg_file}' is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config key 'model.pretrained': '{cfg_file}' must hold a JSON object of constructor kwargs")
    kwargs = {k: v for k, v in data.items() if not k.startswith("_")}
    check_model_kwargs(kwargs, f"'{cfg_file}' key '", strict_keys=False)
    return kwargs


def model_config_dict(cfg: Config) -> dict[str, Any]:
    """The transformer's constructor kwargs: `model.config`, or the pretrained folder's config.json."""
    if cfg.model.config:
        return dict(cfg.model.config)
    cfg_file = pretrained_config_file(cfg)
    if not cfg_file.is_file():
        raise ConfigError(
            f"config key 'model.pretrained': no transformer config at '{cfg_file}'; point it at a "
            "local diffusers folder (nothing is downloaded)"
        )
    return _read_pretrained_config(cfg_file)


def model_dims(cfg: Config) -> dict[str, Any]:
    """The architecture numbers the plan needs, with the diffusers defaults filled in."""
    return model_kwargs(model_config_dict(cfg))


def planned_model_dims(cfg: Config) -> tuple[dict[str, Any], str | None]:
    """`model_dims`, or away from the model folder the released architecture, with a note saying so.

    Planning (`h3train check` on a laptop or a login node) needs only the transformer's
    config.json; without it the diffusers defaults, which are the released MiniMax-H3 transformer,
    stand in. Training needs the folder itself (`preflight`).
    """
    if cfg.model.config or pretrained_config_file(cfg).is_file():
        return model_dims(cfg), None
    return model_defaults(), (
        f"model: '{pretrained_config_file(cfg)}' is not readable here; planned for the released "
        "MiniMax-H3 transformer (the diffusers defaults)"
    )
