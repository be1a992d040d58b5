"""Typed run configuration: dataclass schema, YAML loading, `key=value` overrides, value checks.

Every error here is a `ConfigError` whose message is one line naming the key and what to do;
the CLI turns it into exit code 2 before any process group or model exists.

This module imports nothing from h3train but `errors`, so every other module can read the schema.
Checks that need more than the values (the task table, the model's module names, files the config
names) are `h3train.preflight.check_config`; `h3train.preflight.load_checked` loads and runs both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
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
    # Older spelling of `activation_checkpointing: full` (true turns `none` into `full`).
    gradient_checkpointing: bool = False
    # Recompute blocks in backward: none | full (every refiner and transformer block) | selective
    # (every `checkpoint_every`-th transformer block: 0, N, 2N, ...).
    activation_checkpointing: str = "none"
    checkpoint_every: int = 2
    attention_backend: str = "native"
    # Regional torch.compile of each transformer block, with `compile_backend` (inductor, aot_eager, ...).
    compile: bool = False
    compile_backend: str = "inductor"


@dataclass
class TaskConfig:
    # A training task of `h3train/tasks/table.py` (`TRAINING_TASKS`), checked by `preflight.check_config`.
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
    # A cached dataset folder, or a list of them, each a folder or {path, weight} / {path, repeats}:
    # see `dataset_specs`.
    path: Any = None
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
    # FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer step live in host
    # memory; each unit is copied to the device for its forward and backward.
    cpu_offload: bool = False


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
class EmaConfig:
    # `ema <- decay * ema + (1 - decay) * param` after every taken update (0: no EMA).
    decay: float = 0.0


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
    ema: EmaConfig = field(default_factory=EmaConfig)


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
    # What AdamW keeps per trainable parameter (`train/optim.py`): `adamw` float32 weights and moments
    # (16 B with the gradient); `adamw8bit` / `adamw4bit` torchao's block-wise quantized moments
    # (about 10 / 9 B); `adamw_bf16` bfloat16 weights, gradients and moments, the update stochastically
    # rounded onto the weights (8 B). The float32 islands keep float32 weights under every choice.
    name: str = "adamw"
    # Kernel of `adamw`: `fused` (one kernel over all parameters of a device and dtype), `foreach`
    # (batched ops) or `for-loop` (one parameter at a time). All three compute the same update.
    implementation: str = "fused"


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
    # Also write metrics.jsonl's numbers and the rendered samples to TensorBoard, in <dir>/tensorboard.
    tensorboard: bool = False
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
    # Write in the background (`torch.distributed.checkpoint.async_save`): the step waits only for
    # the copy to host memory; the commit follows when every rank's write is done.
    async_save: bool = False
    # A validation metric (`val/loss`, `val/guidance_cos_video`, ...): a validation that improves it
    # saves a checkpoint, kept as the best (never pruned by keep_last) until a better one commits.
    keep_best: str | None = None
    # min: lower is better; max: higher is better.
    keep_best_mode: str = "min"


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
    # Module paths, suffixes or expressions, or a preset: video_and_audio (the default: every block's
    # attention projections and feed-forward, which read all rows), video_only / audio_only (the one
    # output projection that moves only that modality's prediction; `lora/targets.py` PRESETS).
    target_modules: list[str] = field(default_factory=lambda: ["video_and_audio"])
    # A LoRA file in any format diffusers' H3 loader reads, to continue from.
    init_from: str | None = None
    # Modules trained in full (float32) beside the adapters, e.g. norms.
    train_modules: list[str] = field(default_factory=list)
    # Adapter kind (peft): `lora` (B A), `lokr` (a Kronecker product of two factors), `loha` (the
    # Hadamard product of two low-rank products).
    kind: str = "lora"
    # DoRA: a LoRA whose update is split into a learned per-output magnitude and a direction.
    use_dora: bool = False
    # The frozen base's Linear weights: `none` (bfloat16), `int8` (A100) or `float8` (e4m3, H100/H200),
    # weight-only with one scale per output row (`lora/quant.py`); 1 byte per weight instead of 2.
    base_quant: str = "none"


@dataclass
class SampleRequestConfig:
    """One rendered sample: a request in the encoder manifest's schema (`h3train/data/manifest.py`), no clip.

    Media paths (keyframe images, references) that are relative are taken relative to the folder of the
    config file that names them (the working directory for command-line overrides), as a manifest's are
    relative to the manifest's folder; they are stored absolute, so the run folder's `config.yaml` and a
    resume read the same files.
    """

    # Names the file `<logging.dir>/samples/step_N/<id>.mp4`; default `sample_<i>` (position in the list).
    id: str = ""
    prompt: str = ""
    # t2va | fl2va | ref2va, served by the partition the run trains (`h3train/tasks/partition.py`).
    task: str = "t2va"
    # fl2va: anchor -> keyframe image, e.g. {first: stills/a.png, last: stills/b.png}.
    keyframes: dict[str, str] = field(default_factory=dict)
    # ref2va: [{kind: image | video | audio, path: ...}], in the order the model reads them.
    references: list[dict[str, str]] = field(default_factory=list)
    # Pixel frames at 24 fps, `17 n + 5` with n >= 1 (the video VAE decodes at least 7 latent frames).
    frames: int = 124
    # WIDTHxHEIGHT in pixels, both multiples of 32.
    resolution: str = "1344x768"
    # Seeds the request's generator: the same request and seed draw the same noise at every step.
    seed: int = 0


@dataclass
class GuardConfig:
    """Thresholds on each modality's retention metrics (null: not checked), checked after every validation
    from step 1 on; `action`: `warn` (one line) or `stop` (save a checkpoint, then exit with status 3)."""

    min_guidance_ratio: float | None = None
    min_guidance_cos: float | None = None
    max_drift: float | None = None
    action: str = "warn"


@dataclass
class ValidationConfig:
    """Held-out loss at fixed base sigmas with fixed noise, comparable from step to step and run to run,
    and rendered samples (`samples`) through diffusers' H3 pipeline with the live model."""

    # Every N optimizer steps (0: off); `at_start` also measures the step-0 baseline.
    every: int = 0
    at_start: bool = False
    # A cached dataset in the training format (e.g. clips held out of training), of the run's task.
    dataset: str | None = None
    # The first N samples of that dataset (0: all of them).
    num_samples: int = 0
    # Base sigmas; each modality sees its own shift of each (video 12, audio 3 by default).
    sigmas: list[float] = field(default_factory=lambda: [0.06, 0.19, 0.31, 0.44, 0.56, 0.69, 0.81, 0.94])
    # Seed of the fixed noise of each (sample, sigma) pair.
    seed: int = 0
    # Evaluate with the EMA weights (needs train.ema.decay > 0); rendered samples too.
    use_ema: bool = False
    # Rendered samples (`h3train/render/`): every `sample_every` steps (0: off) and at start with `at_start`.
    samples: list[SampleRequestConfig] = field(default_factory=list)
    sample_every: int = 0
    # The encoder's components folder (`h3train encode --components`): vae, audio_vae, text_encoder, ...
    components: str | None = None
    # Sigma grid points of diffusers' H3 scheduler, terminal 0 included: num_inference_steps - 1 forwards.
    num_inference_steps: int = 50
    # Short edge image references are encoded at (`h3train encode --reference-short-edge`).
    reference_short_edge: int = 2048
    # Also write the generated latents beside each mp4 (`<id>.latents.safetensors`).
    save_latents: bool = False
    # Drift and guidance retention against the base, whose held-out predictions are computed before
    # the first step and stored in `<logging.dir>/base_predictions/` (one more forward per pair).
    retention: bool = True
    # What to do when a validation finds the fine-tune has lost its base's guidance or moved too far.
    guard: GuardConfig = field(default_factory=GuardConfig)


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
    validation: ValidationConfig = field(default_factory=ValidationConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "model.attention_backend": ("auto", "native", "flash", "cudnn"),
    "model.activation_checkpointing": ("none", "full", "selective"),
    "data.source": ("synthetic", "cached"),
    "data.on_error": ("raise", "skip"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "train.timestep.sampling": ("uniform", "logit_normal"),
    "train.timestep.weighting": ("none", "cosmap"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "optim.name": ("adamw", "adamw8bit", "adamw4bit", "adamw_bf16"),
    "optim.implementation": ("fused", "foreach", "for-loop"),
    "lora.kind": ("lora", "lokr", "loha"),
    "lora.base_quant": ("none", "int8", "float8"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
    "cfg.schedule": ("constant", "sigma"),
    "cfg.negative": ("per_sample", "shared"),
    "cfg.negative_visual": ("keep", "drop"),
    "validation.guard.action": ("warn", "stop"),
    "checkpoint.keep_best_mode": ("min", "max"),
}


def _schema() -> DictConfig:
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    # `model.config` holds free-form constructor kwargs (checked against the model class later).
    OmegaConf.set_struct(schema.model.config, False)
    return schema


_CONVERT = re.compile(r"Value '(?P<value>.*)' of type '\w+' could not be converted to (?P<kind>\w+)")


def _one_line(exc: OmegaConfBaseException) -> str:
    """An OmegaConf error in the user's terms: the key, what it holds, what it takes."""
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0].strip()
    if "Key '" in msg and "not in" in msg:
        return f"unknown config key '{key}': remove it or check the spelling against configs/*.yaml"
    converted = _CONVERT.search(msg)
    if key and converted:
        kind = converted["kind"].lower()
        article = "an" if kind[0] in "aeiou" else "a"
        return f"config key '{key}' is {converted['value']!r}; it takes {article} {kind}"
    if key and (boolean := re.match(r"Value '(.*)' is not a valid bool", msg)):
        return f"config key '{key}' is {boolean[1]!r}; it takes true or false"
    if key and ("is not Optional" in msg or msg.startswith("Incompatible value 'None'")):
        return f"config key '{key}' cannot be null; give it a value or leave it out for the default"
    if key:
        return f"invalid value for config key '{key}': {msg}"
    return msg


def _schema_tree() -> dict[str, Any]:
    """The schema as plain containers: a dict is a section, a list a list-valued key, anything else a value."""
    return OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)  # type: ignore[return-value]


def _conform(schema: dict[str, Any], layer: dict[str, Any], prefix: str, origin: str) -> None:
    """Check one layer's shape against the schema before merging, so errors name the key.

    A section given a value, or a value given a section or list, is a `ConfigError`. A scalar for
    a list-valued key is taken as a one-item list (`debug.fault=nan_loss@2`), and an empty section
    (`train:` with nothing under it) as no keys. Unknown keys are left for the merge to report.
    """
    for key in list(layer):
        if key not in schema:
            continue
        name, want, value = f"{prefix}{key}", schema[key], layer[key]
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation: checked once resolved
        if name in TEXT_OR_LIST_KEYS:
            continue  # checked by its own parser (`dataset_specs`)
        if isinstance(want, dict):
            if value is None:
                layer[key] = {}
            elif not isinstance(value, dict):
                example = (
                    f"{name}.num_layers: 2"
                    if name == "model.config"
                    else next((f"{name}.{k}: {v}" for k, v in want.items() if not isinstance(v, dict)), f"{name}.KEY")
                )
                raise ConfigError(
                    f"config key '{name}' ({origin}) is a section and needs keys under it (e.g. {example}), "
                    f"not {value!r}"
                )
            elif name != "model.config":
                _conform(want, value, f"{name}.", origin)
        elif isinstance(want, list):
            if value is None:
                layer[key] = []
            elif isinstance(value, dict):
                raise ConfigError(f"config key '{name}' ({origin}) takes a list, e.g. {name}=[a, b], not a section")
            elif not isinstance(value, list):
                layer[key] = [value]
        elif isinstance(value, (dict, list)):
            kind = "a section" if isinstance(value, dict) else "a list"
            raise ConfigError(f"config key '{name}' ({origin}) takes a single value, not {kind}")


@functools.cache
def leaf_types() -> dict[str, Any]:
    """Every value key of the schema (`train.seed`) -> its annotation with `None` dropped (`int`, `list[float]`).

    Sections are walked, not listed; `model.config` (free-form constructor kwargs) and the fields of
    `validation.samples` items are not keys of their own here.
    """

    def walk(cls: type, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            if dataclasses.is_dataclass(hint):
                out.update(walk(hint, f"{prefix}{f.name}."))
            else:
                out[f"{prefix}{f.name}"] = hint
        return out

    return walk(Config, "")


@functools.cache
def _optional_keys() -> set[str]:
    """Value keys whose default is null: `null` there means "unset"."""
    defaults = Config()
    return {key for key in leaf_types() if get_key(defaults, key) is None}


def parse_overrides(overrides: list[str]) -> DictConfig:
    """`["a.b=1", "c=x"]` -> a config tree; a malformed item names itself.

    The value of a text key (`logging.dir`, `data.path`, `optim.schedule`, ...) is the literal text
    after the first `=`: a ` #`, `1e3` or `on` in a folder name stays as written. A text key whose
    default is null takes `null` to unset it. Every other value is read as YAML (numbers, booleans,
    lists, sections), and the schema then checks its type. A key of `TEXT_OR_LIST_KEYS` is literal
    text unless its value starts with `[` (a list).
    """
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    types_, optional = leaf_types(), _optional_keys()
    tree = OmegaConf.create({})
    try:
        # In the order given, so that a later override of a key wins whichever way each is read.
        for item in overrides:
            key, value = item.split("=", 1)
            key = key.strip()
            if types_.get(key) is str or (key in TEXT_OR_LIST_KEYS and not value.lstrip().startswith("[")):
                OmegaConf.update(tree, key, None if value == "null" and key in optional else value, force_add=True)
            else:
                OmegaConf.update(tree, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key), force_add=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {_one_line(exc)}") from None
    return tree


def _yaml_error(path: str | os.PathLike, exc: Exception) -> ConfigError:
    """A YAML syntax error as `file:line:column: problem`, the way editors and compilers point at it."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}"
        problem = exc.problem or "syntax error"
        context = ""
        if exc.context:
            started = exc.context_mark
            at = f" started at line {started.line + 1}, column {started.column + 1}" if started is not None else ""
            context = f" ({exc.context.strip()}{at})"
        return ConfigError(f"config file '{path}' is not valid YAML: {where}: {problem}{context}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"config file '{path}' is not valid YAML: {first}")


def _read_yaml(path: str | os.PathLike) -> DictConfig:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{path}' is a folder; pass a YAML file such as configs/tiny_fl2va.yaml")
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        # OmegaConf's loader is yaml.SafeLoader-based: no tags, no code execution.
        loaded = OmegaConf.load(p)
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - any YAML error becomes one line
        raise _yaml_error(path, exc) from None
    if not isinstance(loaded, DictConfig):
        kind = "a list" if isinstance(loaded, ListConfig) else f"{type(loaded).__name__}"
        raise ConfigError(
            f"config file '{path}' holds {kind} at the top level; it must be a mapping of sections "
            "(model:, task:, data:, train:, ...) as in configs/tiny_fl2va.yaml"
        )
    return loaded


def config_layers(
    path: str | os.PathLike | None, overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two layers `load_config` merges over the defaults, as plain containers: the file's keys
    (empty without a file) and the overrides', each conformed to the schema, media paths anchored,
    an override of one exclusive key replacing the other from the file."""
    tree = _schema_tree()
    file_raw: dict[str, Any] = {}
    if path is not None:
        file_raw = OmegaConf.to_container(_read_yaml(path), resolve=False)  # type: ignore[assignment]
        _conform(tree, file_raw, "", f"in '{path}'")
        anchor_sample_paths(file_raw, Path(path).resolve().parent, f"in '{path}'")
    raw: dict[str, Any] = OmegaConf.to_container(parse_overrides(list(overrides)), resolve=False)  # type: ignore[assignment]
    _conform(tree, raw, "", "in the overrides")
    anchor_sample_paths(raw, Path.cwd(), "in the overrides")
    _override_replaces_exclusive(file_raw, raw)
    return file_raw, raw


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Load YAML (if given) over the schema defaults, apply overrides, normalise, check values, return a `Config`.

    Checks that read other files or build the model (module names, media paths, the partition) are
    `h3train.preflight.check_config`; `h3train.preflight.load_checked` runs both.
    """
    schema = _schema()
    layers = [OmegaConf.create(layer) for layer in config_layers(path, overrides)]
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    _normalise(cfg)
    validate(cfg)
    return cfg


# Pairs of keys a config sets one of: the model's weights come from a folder or from constructor kwargs.
_EXCLUSIVE_KEYS = (("model", "pretrained", "config"),)


def _override_replaces_exclusive(file_raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """An override of one of two exclusive keys drops the other from the file's layer: a tiny config's
    `model.config` gives way to `model.pretrained=DIR` on the command line, and the other way round."""
    for section, first, second in _EXCLUSIVE_KEYS:
        given, in_file = overrides.get(section), file_raw.get(section)
        if not isinstance(given, dict) or not isinstance(in_file, dict):
            continue
        for key, other in ((first, second), (second, first)):
            if given.get(key) not in (None, {}) and other not in given:
                in_file.pop(other, None)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def get_key(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _normalise(cfg: Config) -> None:
    """One spelling per setting, set once at load: nothing later rewrites the config.

    `model.gradient_checkpointing` is the older spelling of `model.activation_checkpointing: full`:
    true turns `none` into `full`, and `full` sets it back to true for readers of the bool. Any other
    pairing is left for `validate` to refuse.
    """
    if isinstance(cfg.data.path, int) and not isinstance(cfg.data.path, bool):
        cfg.data.path = str(cfg.data.path)  # a folder named by a number, unquoted in YAML
    if cfg.model.gradient_checkpointing and cfg.model.activation_checkpointing == "none":
        cfg.model.activation_checkpointing = "full"
    if cfg.model.activation_checkpointing == "full":
        cfg.model.gradient_checkpointing = True


def validate(cfg: Config) -> None:
    """Value checks the type system cannot express. Raises `ConfigError` on the first problem.

    Only the values themselves are read: no file, no model, no other h3train module, so the
    config stays a leaf every module can import (`h3train.preflight.check_config` does the rest).
    """
    _check_numbers(cfg)
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
        "model.checkpoint_every",
    ):
        positive(key)
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
        raise ConfigError(
            "config keys 'model.pretrained' and 'model.config' are exclusive: set one of them (an override of "
            "either on the command line replaces the other from the file)"
        )
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
    if cfg.data.source == "cached":
        specs = dataset_specs(cfg.data)
        if cfg.data.create_synthetic and len(specs) > 1:
            raise ConfigError(
                "config key 'data.create_synthetic' writes one dataset: give data.path one folder, "
                "or write each dataset of the list with 'h3train synth'"
            )
    _validate_lora(cfg.lora)
    _validate_validation(cfg.validation)
    _validate_keep_best(cfg)
    if not 0.0 <= cfg.train.ema.decay < 1.0:
        raise ConfigError(f"config key 'train.ema.decay' must be in [0, 1) (0: off), got {cfg.train.ema.decay}")
    if cfg.validation.use_ema and not cfg.train.ema.decay:
        raise ConfigError("config key 'validation.use_ema' needs an EMA: set train.ema.decay, e.g. 0.999")


# Seeds feed generators as `seed * constant + offset`: 32 bits leave room for the offsets in 64.
SEED_MAX = 2**32 - 1
# The longest collective timeout: the backends hold it in milliseconds in a signed 32-bit field
# on some paths; a week is far beyond any useful wait.
TIMEOUT_MAX_S = 7 * 24 * 3600
_SEED_KEYS = ("train.seed", "validation.seed")
_INT64 = 2**63 - 1


# Keys that take one text value or a list (`data.path`: a folder, or several datasets).
TEXT_OR_LIST_KEYS = frozenset({"data.path"})
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


def dataset_specs(data: DataConfig) -> list[DatasetSpec]:
    """`data.path` as datasets: a folder is one dataset drawn once per epoch; a list gives several,
    each a folder or a mapping `{path: DIR, weight: W}` / `{path: DIR, repeats: R}` (a single mapping
    is a list of one). Empty for no `data.path`; a malformed entry is a `ConfigError` naming it."""
    given = data.path
    if given is None or given == "":
        if data.source == "cached":
            raise ConfigError(
                "config key 'data.path' must name a cached dataset folder (or a list of them) when data.source is "
                "'cached'"
            )
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
        raise ConfigError(f"config key '{key}.{unknown[0]}' is not a dataset field (fields: {fields})")
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
    """`validation.*` values; whether the dataset is there is `preflight.check_config`'s."""
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


def _validate_lora(lora: LoraConfig) -> None:
    """`lora.*` values; the module names and the `init_from` file are `preflight.check_config`'s."""
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
    if lora.use_dora and lora.kind != "lora":
        raise ConfigError(
            f"config key 'lora.use_dora' is a variant of lora.kind=lora, not of {lora.kind!r}: set one of them"
        )
    if lora.alpha is not None and lora.alpha <= 0:
        raise ConfigError(f"config key 'lora.alpha' must be > 0 (default: lora.rank), got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"config key 'lora.dropout' must be in [0, 1), got {lora.dropout}")


def _validate_cfg(c: CfgConfig) -> None:
    """`cfg.*` values; whether `cfg.shared_negative_path` exists is `preflight.check_config`'s."""
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


# `validation.samples`: requests in the encoder manifest's schema (`h3train/render/requests.py` checks
# their values). Their shape and media paths are settled here, per layer, before the layers merge.
SAMPLES_KEY = "validation.samples"
SAMPLE_FIELDS = ("id", "prompt", "task", "keyframes", "references", "frames", "resolution", "seed")


def sample_key(i: int, name: str | None = None) -> str:
    """`config key 'validation.samples[i].name'`, the prefix of every message about request `i`."""
    return f"config key '{SAMPLES_KEY}[{i}]" + (f".{name}'" if name else "'")


def _absolute(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or value.startswith("${"):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def anchor_sample_paths(layer: dict[str, Any], base: Path, origin: str) -> None:
    """Shape-check one config layer's `validation.samples` and make its relative media paths absolute.

    Runs on the plain containers of one layer (the YAML file, or the overrides) before they merge, so a
    wrong shape names its item and field, and each path is taken relative to the layer it came from: the
    config file's folder, or the working directory for command-line overrides (`SampleRequestConfig`).
    """
    section = layer.get("validation")
    if not isinstance(section, dict) or section.get("samples") is None:
        return
    samples = section["samples"]
    if isinstance(samples, dict):
        raise ConfigError(f"config key '{SAMPLES_KEY}' ({origin}) takes a list of requests, not a section")
    if not isinstance(samples, list):
        samples = section["samples"] = [samples]
    for i, item in enumerate(samples):
        if not isinstance(item, dict):
            raise ConfigError(
                f"{sample_key(i)} ({origin}) is {item!r}; each request is a mapping such as "
                "{prompt: ..., task: fl2va, keyframes: {first: a.png}, frames: 124, resolution: 1344x768}"
            )
        unknown = sorted(set(item) - set(SAMPLE_FIELDS))
        if unknown:
            raise ConfigError(
                f"{sample_key(i, unknown[0])} ({origin}) is not a request field (fields: {', '.join(SAMPLE_FIELDS)})"
            )
        keyframes = item.get("keyframes")
        if keyframes is not None:
            if not isinstance(keyframes, dict):
                raise ConfigError(
                    f"{sample_key(i, 'keyframes')} ({origin}) is {keyframes!r}; it maps an anchor to an image, "
                    "e.g. {first: stills/a.png, last: stills/b.png}"
                )
            item["keyframes"] = {anchor: _absolute(image, base) for anchor, image in keyframes.items()}
        references = item.get("references")
        if references is not None:
            if not isinstance(references, list):
                references = item["references"] = [references]
            for j, ref in enumerate(references):
                if not isinstance(ref, dict) or set(ref) != {"kind", "path"}:
                    raise ConfigError(
                        f"{sample_key(i, f'references[{j}]')} ({origin}) is {ref!r}; expected "
                        "{kind: image | video | audio, path: ...}"
                    )
                ref["path"] = _absolute(ref["path"], base)
