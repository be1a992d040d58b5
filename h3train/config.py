"""Typed run configuration: dataclass schema, YAML loading, `key=value` overrides, validation.

Every error here is a `ConfigError` whose message is one line naming the key and what to do;
the CLI turns it into exit code 2 before any process group or model exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError


@dataclass
class ModelConfig:
    # Diffusers folder holding the transformer (local path; nothing is downloaded).
    pretrained: str | None = None
    # Subfolder inside `pretrained`; default `transformer` (fl2va) or `transformer_ref` (ref2va).
    subfolder: str | None = None
    # Constructor kwargs of `MiniMaxH3Transformer3DModel` for a randomly initialised model.
    config: dict[str, Any] = field(default_factory=dict)
    # Compute dtype. Master weights stay float32; bfloat16 computes the blocks in bf16 and keeps
    # the `_keep_in_fp32_modules` islands in float32.
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    attention_backend: str = "native"


@dataclass
class TaskConfig:
    name: str = "fl2va"


@dataclass
class SyntheticDataConfig:
    """Random latents and text embeddings of a real FL2VA geometry (no files needed)."""

    num_samples: int = 64
    text_len: int = 12
    # Positions in the prompt tagged as vision tokens (0) instead of text (1).
    vision_tokens: int = 4
    num_latent_frames: int = 2
    latent_height: int = 4
    latent_width: int = 4
    num_audio_latents: int = 6
    keyframe_anchors: list[str] = field(default_factory=lambda: ["first"])
    has_audio: bool = True


@dataclass
class DataConfig:
    source: str = "synthetic"
    path: str | None = None
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    # Samples loaded ahead in a background thread.
    prefetch: int = 2
    # Sort windows of this many samples by packed length (0: off), so DP ranks step together.
    bucket_size: int = 0
    # raise: stop on a corrupt sample, naming the file and field; skip: log it and take the next.
    on_error: str = "raise"
    # Tiny configs and demos: when `path` holds no dataset yet, write a synthetic one of
    # `synthetic.num_samples` samples of `task.name` there first.
    create_synthetic: bool = False


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    # gloo on CPU, nccl on CUDA.
    backend: str = "auto"
    timeout_s: int = 600


@dataclass
class LossWeights:
    video: float = 1.0
    audio: float = 1.0


@dataclass
class TimestepConfig:
    # Base sigma distribution; uniform matches H3's inference grid (uniform base index, then shift).
    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    video_shift: float = 12.0
    audio_shift: float = 3.0
    # Per-sample loss weighting as a function of the base sigma: none | cosmap.
    weighting: str = "none"


@dataclass
class TrainConfig:
    steps: int = 10
    # Micro-batches (one packed sequence each) per optimizer step on each DP rank.
    grad_accum: int = 1
    seed: int = 0
    max_grad_norm: float = 1.0
    # A step with a non-finite loss or gradient on any rank is skipped by every rank; this many in a
    # row stop the run, naming the step and the samples.
    max_consecutive_skips: int = 5
    # Loss-spike report: a micro-batch loss above `spike_factor` x the running median of the last
    # `spike_window` step losses is logged with its sample id to <logging.dir>/loss_spikes.jsonl (0: off).
    spike_factor: float = 0.0
    spike_window: int = 50
    loss_weights: LossWeights = field(default_factory=LossWeights)
    timestep: TimestepConfig = field(default_factory=TimestepConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: str = "constant"
    warmup_steps: int = 0
    # Floor of cosine / linear decay, as a fraction of `lr`.
    min_lr_ratio: float = 0.0


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "h3train"
    run_name: str | None = None
    mode: str = "offline"
    init_timeout_s: float = 60.0


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    progress: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CfgConfig:
    """CFG-calibrated target: train the conditional prediction toward `u + s (v - u)`.

    Per modality `L = s^(2-k) * MSE((p + (s-1) u) / s, v)`, `u` the no-grad prediction under the
    negative prompt. `scale = 1` is plain flow matching with a single forward.
    """

    scale: float = 1.0
    # Per-modality overrides of `scale`.
    video_scale: float | None = None
    audio_scale: float | None = None
    # constant, or sigma: `1 + (s - 1) * sigma_m` with the modality's own (shifted) sigma.
    schedule: str = "constant"
    curvature_power: float = 0.0
    # per_sample: the cached sample's negative embeddings; shared: one file for the whole dataset.
    negative: str = "per_sample"
    shared_negative_path: str | None = None
    # keep: the negative presentation keeps the keyframe / reference vision blocks; drop: plain text.
    negative_visual: str = "keep"
    # Fraction of samples whose prompt is replaced by the negative one (classic condition dropout).
    text_dropout: float = 0.0


@dataclass
class CheckpointConfig:
    # Default: `<logging.dir>/checkpoints`.
    dir: str | None = None
    # Save every N optimizer steps and at the last step (0: only on preemption).
    every: int = 0
    # Complete checkpoints kept; older ones are deleted after each commit (0: keep all).
    keep_last: int = 2
    # auto: newest complete checkpoint in `dir` (a fresh start when there is none); none; or a path.
    resume: str = "auto"


@dataclass
class DebugConfig:
    dump_step: int | None = None
    # Fault injection for tests: `nan_loss@STEP`, `nan_grad@STEP:RANK`, `kill@STEP:RANK`,
    # `sigterm@STEP`, `kill_in_save@STEP`, `corrupt_sample@ID`.
    fault: list[str] = field(default_factory=list)
    # `[first, last]`: a torch.profiler trace of steps first..last per rank under <logging.dir>/profile.
    profile_steps: list[int] = field(default_factory=list)


@dataclass
class LoraConfig:
    """Low-rank adapters (peft LoRA) on a frozen base; `rank: 0` is full fine-tuning.

    `target_modules` and `train_modules` entries each select modules by their diffusers path: the
    full path (`transformer_blocks.0.attn.to_q`), a dotted suffix of it (`to_q`: every attention's
    query, refiner included), or a regular expression matched against the full path. A single
    string is a one-item list. The base is stored in bfloat16 except the float32 islands.
    """

    rank: int = 0
    # Scale of the adapters' output is alpha / rank; default: rank (scale 1).
    alpha: float | None = None
    dropout: float = 0.0
    # Default: every transformer block's attention projections and feed-forward (not the refiner).
    target_modules: list[str] = field(
        default_factory=lambda: [
            r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
            r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
        ]
    )
    # A LoRA file in any format diffusers' H3 loader reads, to continue from.
    init_from: str | None = None
    # Modules trained in full (float32) beside the adapters, e.g. norms.
    train_modules: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cfg: CfgConfig = field(default_factory=CfgConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "model.attention_backend": ("auto", "native", "flash", "cudnn"),
    "task.name": ("fl2va", "ref2va", "mixed"),
    "data.source": ("synthetic", "cached"),
    "data.on_error": ("raise", "skip"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "train.timestep.sampling": ("uniform", "logit_normal"),
    "train.timestep.weighting": ("none", "cosmap"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
    "cfg.schedule": ("constant", "sigma"),
    "cfg.negative": ("per_sample", "shared"),
    "cfg.negative_visual": ("keep", "drop"),
}


def _schema() -> DictConfig:
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    # `model.config` holds free-form constructor kwargs (checked against the model class later).
    OmegaConf.set_struct(schema.model.config, False)
    return schema


def _one_line(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0].strip()
    if "Key '" in msg and "not in" in msg:
        return f"unknown config key '{key}': remove it or check the spelling against configs/*.yaml"
    if key:
        return f"invalid value for config key '{key}': {msg}"
    return msg


def parse_overrides(overrides: list[str]) -> DictConfig:
    """`["a.b=1", "c=x"]` -> a config tree; a malformed item names itself."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {_one_line(exc)}") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Load YAML (if given) over the schema defaults, apply overrides, validate, return a `Config`."""
    schema = _schema()
    layers: list[DictConfig] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            # OmegaConf's loader is yaml.SafeLoader-based: no tags, no code execution.
            layers.append(OmegaConf.load(p))
        except Exception as exc:  # noqa: BLE001 - any YAML error becomes one line
            raise ConfigError(f"config file '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    layers.append(parse_overrides(list(overrides)))
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def get_key(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    """Value checks the type system cannot express. Raises `ConfigError` on the first problem."""
    for key, choices in _CHOICES.items():
        value = get_key(cfg, key)
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; choose one of {', '.join(choices)}")

    def positive(key: str, allow_zero: bool = False) -> None:
        value = get_key(cfg, key)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value}")

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
        positive(key)
    for key in (
        "optim.warmup_steps",
        "optim.weight_decay",
        "train.max_grad_norm",
        "train.loss_weights.video",
        "train.loss_weights.audio",
        "data.prefetch",
        "data.bucket_size",
    ):
        positive(key, allow_zero=True)
    if cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        raise ConfigError(f"config key 'parallel.dp_shard' must be -1 (infer) or > 0, got {cfg.parallel.dp_shard}")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"config key 'optim.betas' must be two numbers in [0, 1), got {cfg.optim.betas}")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"config key 'optim.min_lr_ratio' must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if cfg.model.pretrained is None and not cfg.model.config:
        raise ConfigError(
            "config key 'model' needs either 'model.pretrained' (a diffusers folder) or "
            "'model.config' (constructor kwargs for a random init)"
        )
    if cfg.model.pretrained is not None and cfg.model.config:
        raise ConfigError("config keys 'model.pretrained' and 'model.config' are exclusive: set one of them")
    if cfg.debug.dump_step is not None and not 1 <= cfg.debug.dump_step <= cfg.train.steps:
        raise ConfigError(
            f"config key 'debug.dump_step' must be in [1, train.steps={cfg.train.steps}], got {cfg.debug.dump_step}"
        )
    prof = cfg.debug.profile_steps
    if prof and (len(prof) != 2 or not 1 <= prof[0] <= prof[1]):
        raise ConfigError(
            f"config key 'debug.profile_steps' must be [first, last] with 1 <= first <= last, got {list(prof)}"
        )
    syn = cfg.data.synthetic
    for anchor in syn.keyframe_anchors:
        if anchor not in ("first", "last"):
            raise ConfigError(f"config key 'data.synthetic.keyframe_anchors' holds {anchor!r}; use 'first' or 'last'")
    if syn.vision_tokens > syn.text_len:
        raise ConfigError("config key 'data.synthetic.vision_tokens' must not exceed 'data.synthetic.text_len'")
    _validate_cfg(cfg.cfg)
    positive("checkpoint.every", allow_zero=True)
    positive("train.spike_factor", allow_zero=True)
    positive("train.spike_window")
    positive("train.max_consecutive_skips", allow_zero=True)
    positive("checkpoint.keep_last", allow_zero=True)
    from .train.faults import parse_faults

    parse_faults(cfg.debug.fault)
    if cfg.data.source == "cached" and not cfg.data.path:
        raise ConfigError("config key 'data.path' must name a cached dataset folder when data.source is 'cached'")
    _validate_model_shape(cfg)
    _validate_lora(cfg)


def _validate_lora(cfg: Config) -> None:
    """`lora.*`: values, and targets checked against the module names of the model built on meta."""
    from .lora.targets import validate_lora

    validate_lora(cfg)


def _validate_cfg(c: CfgConfig) -> None:
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
        if not Path(c.shared_negative_path).is_file():
            raise ConfigError(f"config key 'cfg.shared_negative_path': file '{c.shared_negative_path}' does not exist")
        if c.negative_visual == "keep":
            raise ConfigError(
                "config key 'cfg.negative_visual' must be 'drop' with cfg.negative=shared: vision blocks are per sample"
            )


def model_config_dict(cfg: Config) -> dict[str, Any]:
    """The transformer's constructor kwargs: `model.config`, or the pretrained folder's config.json."""
    import json

    from diffusers import MiniMaxH3Transformer3DModel

    if cfg.model.config:
        known = set(MiniMaxH3Transformer3DModel._get_init_keys(MiniMaxH3Transformer3DModel)) - {"self"}
        unknown = sorted(set(cfg.model.config) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key 'model.config.{unknown[0]}': not a "
                "MiniMaxH3Transformer3DModel constructor argument"
            )
        return dict(cfg.model.config)
    folder = Path(cfg.model.pretrained) / (cfg.model.subfolder or default_subfolder(cfg))
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"config key 'model.pretrained': no transformer config at '{cfg_file}'; point it at a "
            "local diffusers folder (nothing is downloaded)"
        )
    data = json.loads(cfg_file.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def default_subfolder(cfg: Config) -> str:
    return "transformer_ref" if cfg.task.name == "ref2va" else "transformer"


def model_dims(cfg: Config) -> dict[str, Any]:
    """The architecture numbers the plan needs, with the diffusers defaults filled in."""
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel

    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    dims = {name: p.default for name, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    dims.update(model_config_dict(cfg))
    return dims


def _validate_model_shape(cfg: Config) -> None:
    dims = model_dims(cfg)
    heads = int(dims["num_attention_heads"])
    if heads % cfg.parallel.sp:
        raise ConfigError(
            f"config key 'parallel.sp' = {cfg.parallel.sp} does not divide the model's "
            f"{heads} attention heads; choose a divisor of {heads}"
        )
