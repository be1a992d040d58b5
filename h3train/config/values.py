"""Value checks of a loaded config that the type system cannot express, each a one-line `ConfigError`.

Only the values are read: no file, no model, no other h3train module, and no kind of an extension table
(`h3train.run.checks.check` does the rest, and asks each chosen table entry to check itself).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, did_you_mean, one_of
from .schema import (
    _CHOICES,
    CfgConfig,
    Config,
    DataConfig,
    LoraConfig,
    ValidationConfig,
    get_key,
    leaf_types,
    sample_key,
)


def check_values(cfg: Config) -> None:
    """Value checks the type system cannot express. Raises `ConfigError` on the first problem.

    Only the values themselves are read: no file, no model, no other h3train module, so the
    config stays a leaf every module can import (`h3train.run.checks.check` does the rest).
    """
    _check_numbers(cfg)
    for key, choices in _CHOICES.items():
        value = get_key(cfg, key)
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; {one_of(value, choices)}")
    _check_ranges(cfg)
    _check_model_and_debug(cfg)
    _check_synthetic(cfg)
    _validate_cfg(cfg.cfg)
    _positive(cfg, "checkpoint.every", allow_zero=True)
    _positive(cfg, "train.spike_factor", allow_zero=True)
    _positive(cfg, "train.spike_window")
    _positive(cfg, "train.max_consecutive_skips", allow_zero=True)
    _positive(cfg, "checkpoint.keep_last", allow_zero=True)
    # Each dataset of `data.path` is well formed; whether the data source reads it is the source's check.
    dataset_specs(cfg.data)
    _validate_lora(cfg.lora)
    _validate_validation(cfg.validation)
    _validate_keep_best(cfg)
    _validate_export(cfg)
    if not 0.0 <= cfg.train.ema.decay < 1.0:
        raise ConfigError(f"config key 'train.ema.decay' must be in [0, 1) (0: off), got {cfg.train.ema.decay}")
    if cfg.validation.use_ema and not cfg.train.ema.decay:
        raise ConfigError("config key 'validation.use_ema' needs an EMA: set train.ema.decay, e.g. 0.999")


def _positive(cfg: Config, key: str, allow_zero: bool = False) -> None:
    value = get_key(cfg, key)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_ranges(cfg: Config) -> None:
    """The numbers that must be positive (or not negative), the mesh's `dp_shard`, AdamW's betas and the
    schedule's floor; the older spelling of full recompute against the newer key."""
    for key in (
        "train.steps",
        "train.grad_accum",
        "parallel.sp",
        "parallel.dp_replicate",
        "parallel.timeout_s",
        "optim.lr",
        "optim.eps",
        "train.timestep.video_shift",
        "train.timestep.audio_shift",
        "train.timestep.logit_std",
        "data.synthetic.num_samples",
        "data.synthetic.text_len",
        "data.synthetic.num_latent_frames",
    ):
        _positive(cfg, key)
    if cfg.model.gradient_checkpointing and cfg.model.activation_checkpointing != "full":
        raise ConfigError(
            "config key 'model.gradient_checkpointing' is the older spelling of model.activation_checkpointing=full; "
            f"it conflicts with '{cfg.model.activation_checkpointing}': set only one"
        )
    for key in (
        "optim.warmup_steps",
        "optim.weight_decay",
        "train.max_grad_norm",
        "train.loss_weights.video",
        "train.loss_weights.audio",
        "data.prefetch",
        "data.bucket_size",
        "data.max_rows",
        "data.pack",
    ):
        _positive(cfg, key, allow_zero=True)
    if cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        raise ConfigError(f"config key 'parallel.dp_shard' must be -1 (infer) or > 0, got {cfg.parallel.dp_shard}")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"config key 'optim.betas' must be two numbers in [0, 1), got {cfg.optim.betas}")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"config key 'optim.min_lr_ratio' must be in [0, 1], got {cfg.optim.min_lr_ratio}")


def _check_model_and_debug(cfg: Config) -> None:
    """One model source; `auto`-or-bool keys; the step dump and profile windows; packs against a dump and
    against a compile the values alone rule out."""
    if cfg.model.pretrained is None and not cfg.model.config:
        raise ConfigError(
            "config key 'model' needs either 'model.pretrained' (a diffusers folder) or "
            "'model.config' (constructor kwargs for a random init)"
        )
    if cfg.model.pretrained is not None and cfg.model.config:
        raise ConfigError(
            "config keys 'model.pretrained' and 'model.config' are exclusive: set one of them (an override of "
            "either on the command line replaces the other from the file)"
        )
    if cfg.debug.dump_step is not None and not 1 <= cfg.debug.dump_step <= cfg.train.steps:
        raise ConfigError(
            f"config key 'debug.dump_step' must be in [1, train.steps={cfg.train.steps}], got {cfg.debug.dump_step}"
        )
    for key, value in (("model.compile", cfg.model.compile), ("parallel.adaln_tables", cfg.parallel.adaln_tables)):
        if not isinstance(value, bool) and value != "auto":
            raise ConfigError(auto_choice_error(key, value))
    if cfg.data.pack and cfg.debug.dump_step is not None:
        # A dump replays one sequence.
        raise ConfigError(
            f"config key 'debug.dump_step' does not take packed micro-batches (data.pack={cfg.data.pack}): "
            "unset one of them"
        )
    if cfg.data.pack and cfg.model.compile is True and (missing := packed_compile_missing(cfg, None)):
        # What the values alone rule out; the device and torch are asked when the run is built.
        raise ConfigError(packed_compile_refusal(cfg, missing))
    prof = cfg.debug.profile_steps
    if prof and (len(prof) != 2 or not 1 <= prof[0] <= prof[1]):
        raise ConfigError(
            f"config key 'debug.profile_steps' must be [first, last] with 1 <= first <= last, got {list(prof)}"
        )


def _check_synthetic(cfg: Config) -> None:
    """`data.synthetic`'s keyframe anchors and its vision tokens within its text."""
    syn = cfg.data.synthetic
    for anchor in syn.keyframe_anchors:
        if anchor not in ("first", "last"):
            raise ConfigError(
                f"config key 'data.synthetic.keyframe_anchors' holds {anchor!r}; use 'first' or 'last'"
                f"{did_you_mean(str(anchor), ('first', 'last'))}"
            )
    if syn.vision_tokens > syn.text_len:
        raise ConfigError("config key 'data.synthetic.vision_tokens' must not exceed 'data.synthetic.text_len'")


# Seeds feed generators as `seed * constant + offset`: 32 bits leave room for the offsets in 64.
SEED_MAX = 2**32 - 1
# The longest collective timeout: the backends hold it in milliseconds in a signed 32-bit field
# on some paths; a week is far beyond any useful wait.
TIMEOUT_MAX_S = 7 * 24 * 3600
_SEED_KEYS = ("train.seed", "validation.seed")
_INT64 = 2**63 - 1
_DATASET_FIELDS = ("path", "weight", "repeats")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of `data.path`: its folder and how often an epoch draws it.

    `weight` (a positive number; 1 for a dataset without one in a list where another has one) is the
    dataset's share of each epoch's draws; an epoch draws as many samples as the datasets hold
    together. Otherwise `repeats` (a positive integer, 1 by default) draws each of its samples that
    many times per epoch.
    """

    path: str
    weight: float | None = None
    repeats: int = 1


#: The keys that take `auto`, `true` or `false` (`str | bool` in the schema).
AUTO_KEYS = ("model.compile", "parallel.adaln_tables")


def auto_choice_error(key: str, value: Any) -> str:
    """The one-line refusal of a value of `key` (one of `AUTO_KEYS`) other than auto, true or false."""
    hint = did_you_mean(str(value), ("auto", "true", "false")) if isinstance(value, str) else ""
    return f"config key '{key}' is {value!r}; it takes auto, true or false{hint}"


def torch_varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen` (torch >= 2.10), found, not imported.

    The config package imports no h3train module but `errors`, so it asks torch itself; a test holds
    the answer equal to `ops.attention.torch_varlen_available`.
    """
    import importlib.util

    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:  # no torch at all
        return False


def packed_compile_missing(cfg: Config, device_type: str | None) -> str | None:
    """Why a packed run of `cfg` (`data.pack`) cannot compile its blocks on a `device_type` device, as a
    clause, or None when it can.

    A compiled block must attend over a pack in one call, or it would compile again for each pack's
    composition: torch's `varlen_attn` does (`ops.attention.packed_attention_path`), on CUDA, in
    bfloat16 compute, with torch >= 2.10. `device_type` None: what the values alone rule out (the value
    checks, before the device is known).
    """
    if cfg.model.dtype != "bfloat16":
        return f"model.dtype is '{cfg.model.dtype}'"
    if cfg.parallel.backend == "gloo" or (device_type is not None and device_type != "cuda"):
        return "this run trains on the CPU"
    if device_type is not None and not torch_varlen_available():
        from importlib.metadata import version

        return f"this torch ({version('torch')}) has none"
    return None


def packed_compile_refusal(cfg: Config, missing: str) -> str:
    """The one-line refusal of `model.compile: true` with `data.pack`, `missing` saying why (a clause)."""
    return (
        f"config key 'model.compile' is true with data.pack={cfg.data.pack}: a packed sequence compiles as one "
        f"call only with CUDA's varlen attention (torch >= 2.10, bfloat16 compute), but {missing}; "
        "set model.compile=false"
    )


def resolve_compile(cfg: Config, device_type: str) -> bool:
    """Whether the run compiles each transformer block (`model.compile`) on a `device_type` device.

    `true` and `false` are kept as given. `auto` compiles where it pays: bfloat16 compute on CUDA
    (on one H200 the step ran 7.8 % faster and peaked 3 GiB lower), not float32 compute, not the
    CPU (inductor's C++ build there takes minutes). Packed micro-batches (`data.pack`) compile only
    where a pack attends in one call (`packed_compile_missing`): `auto` there is off, and `true` a
    one-line `ConfigError`, since per-sample attention would compile again for every composition.
    """
    choice = cfg.model.compile
    if cfg.data.pack and choice is not False:
        missing = packed_compile_missing(cfg, device_type)
        if missing is not None and choice is True:
            raise ConfigError(packed_compile_refusal(cfg, missing))
        if missing is not None:
            return False
    if choice != "auto":
        return choice is True
    return device_type == "cuda" and cfg.model.dtype == "bfloat16"


def dataset_specs(data: DataConfig) -> list[DatasetSpec]:
    """`data.path` as datasets: a folder is one dataset drawn once per epoch; a list gives several,
    each a folder or a mapping `{path: DIR, weight: W}` / `{path: DIR, repeats: R}` (a single mapping
    is a list of one). Empty for no `data.path`; a malformed entry is a `ConfigError` naming it."""
    given = data.path
    if given is None or given == "":
        return []
    if isinstance(given, str):
        return [DatasetSpec(given)]
    items = [given] if isinstance(given, dict) else given
    if not isinstance(items, list) or not items:
        raise ConfigError(
            f"config key 'data.path' is {given!r}; give a dataset folder or a list of datasets, e.g. "
            "data.path=[data/clips, {path: data/extra, weight: 0.25}]"
        )
    specs = [_dataset_spec(i, item) for i, item in enumerate(items)]
    if any(spec.weight is not None for spec in specs):
        if any(spec.repeats != 1 for spec in specs):
            at = next(i for i, spec in enumerate(specs) if spec.repeats != 1)
            raise ConfigError(
                f"config key 'data.path[{at}].repeats' is set in a list balanced by weights; "
                "balance the datasets by weight or by repeats, not both"
            )
        # A folder without a weight in a weighted list weighs 1.
        specs = [dataclasses.replace(spec, weight=1.0 if spec.weight is None else spec.weight) for spec in specs]
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        where = os.path.normpath(os.path.abspath(os.path.expanduser(spec.path)))
        if where in seen:
            raise ConfigError(
                f"config key 'data.path[{i}]' names the folder of data.path[{seen[where]}] again ('{spec.path}'); "
                "list a dataset once and give it a weight or repeats"
            )
        seen[where] = i
    return specs


def _dataset_spec(i: int, item: Any) -> DatasetSpec:
    key = f"data.path[{i}]"
    if isinstance(item, str) and item:
        return DatasetSpec(item)
    if isinstance(item, int) and not isinstance(item, bool):
        return DatasetSpec(str(item))  # a folder named by a number, unquoted in YAML
    if not isinstance(item, dict):
        raise ConfigError(
            f"config key '{key}' is {item!r}; each dataset is a folder or {{path: DIR, weight: W}} / "
            "{path: DIR, repeats: R}"
        )
    unknown = sorted(set(item) - set(_DATASET_FIELDS))
    if unknown:
        fields = ", ".join(_DATASET_FIELDS)
        raise ConfigError(
            f"config key '{key}.{unknown[0]}' is not a dataset field (fields: {fields})"
            f"{did_you_mean(str(unknown[0]), _DATASET_FIELDS)}"
        )
    path = item.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"config key '{key}.path' is {path!r}; give the dataset's folder")
    weight, repeats = item.get("weight"), item.get("repeats")
    if weight is not None and repeats is not None:
        raise ConfigError(f"config key '{key}' sets both weight and repeats; give one of them")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0
    ):
        raise ConfigError(f"config key '{key}.weight' is {weight!r}; it takes a positive number (a share of the draws)")
    whole = isinstance(repeats, int) and not isinstance(repeats, bool)
    if repeats is not None and not (whole and 1 <= repeats <= _INT64):
        raise ConfigError(f"config key '{key}.repeats' is {repeats!r}; it takes a whole number of at least 1")
    return DatasetSpec(path, None if weight is None else float(weight), 1 if repeats is None else repeats)


def _check_numbers(cfg: Config) -> None:
    """Every number of the config is finite and representable; seeds and timeouts within their ranges."""
    for key in leaf_types():
        value = get_key(cfg, key)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config key '{key}' is {v}; it takes a finite number")
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _INT64:
                raise ConfigError(f"config key '{key}' is {v}; it takes an integer of at most 64 bits")
    for key in _SEED_KEYS:
        _in_range(key, get_key(cfg, key), 0, SEED_MAX)
    for i, sample in enumerate(cfg.validation.samples):
        if not isinstance(sample.seed, int) or not 0 <= sample.seed <= SEED_MAX:
            raise ConfigError(f"{sample_key(i, 'seed')} is {sample.seed!r}; choose a seed in [0, {SEED_MAX}]")
    _in_range("parallel.timeout_s", cfg.parallel.timeout_s, 1, TIMEOUT_MAX_S)
    _in_range("logging.wandb.init_timeout_s", cfg.logging.wandb.init_timeout_s, 0, TIMEOUT_MAX_S)


def _in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"config key '{key}' is {value}; choose a value in [{low}, {high}]")


def measures_held_out_loss(v: ValidationConfig) -> bool:
    """Whether the run measures the held-out loss, which needs `validation.dataset`.

    `at_start` with samples and no dataset only renders them.
    """
    return bool(v.every or (v.at_start and (v.dataset or not v.samples)))


def _validate_validation(v: ValidationConfig) -> None:
    """`validation.*` values; whether the dataset is there is `run.checks.check`'s."""
    if v.every < 0 or v.num_samples < 0:
        raise ConfigError("config keys 'validation.every' and 'validation.num_samples' must be >= 0")
    if not measures_held_out_loss(v):
        return
    if not v.dataset:
        raise ConfigError("config key 'validation.dataset' must name a cached dataset folder to validate on")
    if not v.sigmas or not all(0.0 < s < 1.0 for s in v.sigmas) or len(set(v.sigmas)) != len(v.sigmas):
        raise ConfigError(f"config key 'validation.sigmas' must be distinct numbers in (0, 1), got {list(v.sigmas)}")
    g = v.guard
    limits = {
        "min_guidance_ratio": g.min_guidance_ratio,
        "min_guidance_cos": g.min_guidance_cos,
        "max_drift": g.max_drift,
    }
    for name, value in limits.items():
        if value is None:
            continue
        if not v.retention or not v.every:
            raise ConfigError(
                f"config key 'validation.guard.{name}' needs retention measured during training: "
                "validation.retention=true and validation.every > 0"
            )
        low, high = (-1.0, 1.0) if name == "min_guidance_cos" else (0.0, math.inf)
        if not low <= value <= high:
            raise ConfigError(f"config key 'validation.guard.{name}' is {value}; choose a value in [{low}, {high}]")


_VALIDATION_METRIC = re.compile(
    r"val/(?:(?P<loss>loss(?:_video|_audio)?)(?P<cfg>_cfg)?|(?P<drift>drift)_(?:video|audio)"
    r"|(?P<guidance>guidance_(?:ratio|cos))_(?:video|audio))(?P<sigma>@[0-9.]+)?"
)


def _validate_keep_best(cfg: Config) -> None:
    """`checkpoint.keep_best` names a metric the run's validation logs."""
    metric, v = cfg.checkpoint.keep_best, cfg.validation
    if metric is None:
        return
    found = _VALIDATION_METRIC.fullmatch(metric)
    example = "val/loss, val/loss_video, val/drift_video, val/guidance_ratio_video, val/guidance_cos_audio"
    by_sigma = found is not None and (found["guidance"] or found["loss"] in ("loss_video", "loss_audio"))
    if found is None or (found["sigma"] and not (by_sigma and not found["cfg"])):
        raise ConfigError(
            f"config key 'checkpoint.keep_best' is {metric!r}; name a validation metric such as {example}"
        )
    if not (v.dataset and v.every):
        raise ConfigError(
            "config key 'checkpoint.keep_best' needs a held-out loss during training: set validation.dataset "
            "and validation.every"
        )
    if (found["drift"] or found["guidance"]) and not v.retention:
        raise ConfigError(f"config key 'checkpoint.keep_best' is {metric!r}, which needs validation.retention=true")
    scales = (cfg.cfg.scale, cfg.cfg.video_scale, cfg.cfg.audio_scale)
    if found["cfg"] and all(s in (None, 1.0) for s in scales):
        raise ConfigError(f"config key 'checkpoint.keep_best' is {metric!r}, logged only with cfg.scale other than 1")


def _validate_export(cfg: Config) -> None:
    """`checkpoint.export` writes LoRA files: a LoRA run whose trained weights a LoRA file holds.

    Which adapter kinds and modules a format holds is the adapter-kind table's: `run.checks.check`
    asks it once the modules are resolved.
    """
    fmt, lora = cfg.checkpoint.export, cfg.lora
    if fmt == "none":
        return
    if lora.rank == 0:
        raise ConfigError(
            f"config key 'checkpoint.export' is {fmt!r}, which writes LoRA files, and this run is a full fine-tune "
            "(lora.rank=0): set checkpoint.export=none and export its checkpoints with 'h3train export'"
        )
    if lora.train_modules:
        raise ConfigError(
            f"config key 'checkpoint.export' is {fmt!r}, and lora.train_modules trains weights in full, which a LoRA "
            "file cannot hold: set checkpoint.export=none and export with 'h3train export --merge'"
        )


def _validate_lora(lora: LoraConfig) -> None:
    """`lora.*` values; the module names, the `init_from` file and what the
    adapter kind refuses are `run.checks.check`'s."""
    if lora.rank < 0:
        raise ConfigError(f"config key 'lora.rank' must be >= 0 (0 = full fine-tuning), got {lora.rank}")
    if lora.rank == 0:
        for key, value in (
            ("init_from", lora.init_from),
            ("train_modules", lora.train_modules),
            ("use_dora", lora.use_dora),
            ("kind", lora.kind != "lora"),
            ("base_quant", lora.base_quant != "none"),
        ):
            if value:
                raise ConfigError(f"config key 'lora.{key}' needs LoRA: set lora.rank > 0 (rank 0 is full fine-tuning)")
        return
    if lora.alpha is not None and lora.alpha <= 0:
        raise ConfigError(f"config key 'lora.alpha' must be > 0 (default: lora.rank), got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"config key 'lora.dropout' must be in [0, 1), got {lora.dropout}")


def _validate_cfg(c: CfgConfig) -> None:
    """`cfg.*` values; whether `cfg.shared_negative_path` exists is `run.checks.check`'s."""
    for key, value in (("cfg.scale", c.scale), ("cfg.video_scale", c.video_scale), ("cfg.audio_scale", c.audio_scale)):
        if value is not None and value < 1.0:
            raise ConfigError(f"config key '{key}' must be >= 1 (1 = no guidance), got {value}")
    if not 0.0 <= c.text_dropout < 1.0:
        raise ConfigError(f"config key 'cfg.text_dropout' must be in [0, 1), got {c.text_dropout}")
    if c.negative == "shared":
        if not c.shared_negative_path:
            raise ConfigError(
                "config key 'cfg.shared_negative_path' must name a safetensors file when cfg.negative is 'shared'"
            )
        if c.negative_visual == "keep":
            raise ConfigError(
                "config key 'cfg.negative_visual' must be 'drop' with cfg.negative=shared: vision blocks are per sample"
            )
