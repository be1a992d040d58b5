"""The run configuration's schema: one dataclass per section, and the choices of each enumerated key."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar


@dataclass
class ModelConfig:
    """The transformer: where its weights come from, its compute dtype, what it recomputes or compiles."""

    # Diffusers folder holding the transformer (local path; nothing is downloaded).
    pretrained: str | None = None
    # Subfolder inside `pretrained`; default `transformer` (fl2va) or `transformer_ref` (ref2va).
    subfolder: str | None = None
    # Constructor kwargs of `MiniMaxH3Transformer3DModel` for a randomly initialised model.
    config: dict[str, Any] = field(default_factory=dict)
    # Compute dtype. Master weights stay float32; bfloat16 computes the blocks in bf16 and keeps
    # the `_keep_in_fp32_modules` islands in float32.
    dtype: str = "float32"
    # Older spelling of `activation_checkpointing: full` (true turns `none` or `auto` into `full`).
    gradient_checkpointing: bool = False
    # What each transformer block recomputes in backward: auto (the memory plan picks, block by block,
    # the least recompute whose peak fits the device; nothing on the CPU) | none | selective (keeps the
    # attention output, recomputes the rest) | full (keeps only each block's input; the text refiner too).
    activation_checkpointing: str = "auto"
    # Attention kernel (`ops/attention.py`); `auto`: flash-attn where it runs (CUDA, installed, bf16), else native.
    attention_backend: str = "native"
    # Regional torch.compile of each transformer block, with `compile_backend` (inductor, aot_eager, ...):
    # auto (on for bfloat16 compute on CUDA; off in float32 and on the CPU) | true | false
    # (`config.values.resolve_compile`). With `data.pack` each pack then attends in one varlen call: CUDA,
    # bfloat16 and torch >= 2.10 only (`auto` is off elsewhere, `true` refused). One of `auto`, `true`, `false`.
    compile: str | bool = "auto"
    # The `torch.compile` backend of `compile`.
    compile_backend: str = "inductor"


@dataclass
class TaskConfig:
    """What the run trains: the task, and so the pretrained partition and the samples it takes."""

    # A training task of `h3train/tasks/table.py` (`TRAINING_TASKS`), checked by `run.checks.check`.
    name: str = "fl2va"


@dataclass
class SyntheticDataConfig:
    """Random latents and text embeddings of a real FL2VA geometry (no files needed)."""

    # Samples in the synthetic dataset.
    num_samples: int = 64
    # Prompt tokens per sample.
    text_len: int = 12
    # Positions in the prompt tagged as vision tokens (0) instead of text (1).
    vision_tokens: int = 4
    # Target video latent frames.
    num_latent_frames: int = 2
    # Target video latent height, in latent pixels.
    latent_height: int = 4
    # Target video latent width, in latent pixels.
    latent_width: int = 4
    # Target audio latents (40 a second in the released audio VAE).
    num_audio_latents: int = 6
    # The keyframes each fl2va sample holds: `first`, `last` or both.
    keyframe_anchors: list[str] = field(default_factory=lambda: ["first"])
    # Whether the samples have sound (false: no audio loss).
    has_audio: bool = True


@dataclass
class DataConfig:
    """The training samples: their source, folders, and how they are read."""

    # Where samples come from: random ones of a real geometry, or cached files (`h3train encode`).
    source: str = "synthetic"
    # A cached dataset folder, or a list of them, each a folder or {path, weight} / {path, repeats}:
    # see `dataset_specs`.
    path: Any = None
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    # Micro-batches (a sample each, or a pack) loaded ahead, this many at once on background threads.
    prefetch: int = 2
    # Sort windows of this many samples by packed length (0: off), so DP ranks step together.
    bucket_size: int = 0
    # Longest packed sequence trained, in rows (0: no bound). Longer cached samples are dropped when
    # the dataset loads, and the memory plan takes this as the longest sample.
    max_rows: int = 0
    # Packed micro-batches: each trains several samples in one sequence of at most this many rows,
    # each sample attending over its own rows (0: one sample per micro-batch). See docs/training.md.
    pack: int = 0
    # A sample longer than `pack` rows: refuse (a one-line error before training) or alone (a
    # micro-batch of its own, planned for memory at its length).
    pack_oversize: str = "refuse"
    # Assign each step's samples to DP ranks (and packs) by their compute (linear rows plus
    # attention rows squared), so the ranks finish their micro-batches together.
    balance: bool = False
    # raise: stop on a corrupt sample, naming the file and field; skip: log it and take the next.
    on_error: str = "raise"
    # Tiny configs and demos: when `path` holds no dataset yet, write a synthetic one of
    # `synthetic.num_samples` samples of `task.name` there first.
    create_synthetic: bool = False


@dataclass
class ParallelConfig:
    """The device mesh `dp_replicate x dp_shard x sp` and the process group."""

    # HSDP replicas: each holds a whole sharded copy of the model (1: plain FSDP2).
    dp_replicate: int = 1
    # Ranks the weights, gradients and optimizer state are sharded over (-1: what the world size leaves).
    dp_shard: int = -1
    # Ulysses sequence parallelism: ranks that split each packed sequence; must divide the heads.
    sp: int = 1
    # gloo on CPU, nccl on CUDA.
    backend: str = "auto"
    # Collective timeout in seconds: a dead rank stops the others after this long.
    timeout_s: int = 600
    # FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer step live in host
    # memory; each unit is copied to the device for its forward and backward.
    cpu_offload: bool = False
    # Every transformer block's AdaLN projection computed where its weights live: each rank projects the
    # timestep embeddings of its shard group with the weight rows it holds and the ranks exchange table
    # slices (every block's in one exchange a forward), so those weights (40 % of a block) are never
    # all-gathered and their gradient never reduce-scattered. auto (on where `check`'s step-time estimate
    # says the step is faster with them, or where they are what makes the run fit; off elsewhere and on
    # the CPU: `plan.tables.choose_tables`) | true | false (FSDP2 gathers them as any weight).
    adaln_tables: str | bool = "auto"


@dataclass
class LossWeights:
    """`loss = video * MSE_video + audio * MSE_audio` over the target rows."""

    # Weight of the video term.
    video: float = 1.0
    # Weight of the audio term.
    audio: float = 1.0


@dataclass
class TimestepConfig:
    """How each sample's base sigma is drawn, and its shift per modality (the scheduler's)."""

    # Base sigma distribution; uniform matches H3's inference grid (uniform base index, then shift).
    sampling: str = "uniform"
    # Mean of the normal under the logit of `logit_normal`.
    logit_mean: float = 0.0
    # Standard deviation of the normal under the logit of `logit_normal`.
    logit_std: float = 1.0
    # Shift of the video sigma (the video scheduler's, 12 in the released pipeline).
    video_shift: float = 12.0
    # Shift of the audio sigma (the audio scheduler's, 3 in the released pipeline).
    audio_shift: float = 3.0
    # Per-sample loss weighting as a function of the base sigma: none | cosmap.
    weighting: str = "none"


@dataclass
class EmaConfig:
    """An exponential moving average of the trainable weights, sharded like them."""

    # `ema <- decay * ema + (1 - decay) * param` after every taken update (0: no EMA).
    decay: float = 0.0


@dataclass
class TrainConfig:
    """The loop: steps, micro-batches, seeds, clipping, skips, the loss and its sigmas, the EMA."""

    # Optimizer steps the run ends at (a resume continues to this step).
    steps: int = 10
    # Micro-batches (one packed sequence each) per optimizer step on each DP rank.
    grad_accum: int = 1
    # With data.pack: samples per optimizer step over all DP ranks, packed into the dp x grad_accum
    # micro-batches (fewer when their rows do not fit the packs; 0: as many as the packs' rows hold).
    # A step never holds a sample twice nor reaches into the next epoch. Without data.pack a step
    # trains dp x grad_accum samples.
    global_batch: int = 0
    # Start on a GPU, and pass `h3train check`, even when the memory plan says the run does not fit.
    ignore_memory_plan: bool = False
    # Seeds the model's random init, the noise, timesteps and data order of every step.
    seed: int = 0
    # Gradients are clipped to this global norm (0: no clipping).
    max_grad_norm: float = 1.0
    # A step with a non-finite loss or gradient on any rank is skipped by every rank; this many in a
    # row stop the run, naming the step and the samples.
    max_consecutive_skips: int = 5
    # Loss-spike report: a micro-batch loss above `spike_factor` x the running median of the last
    # `spike_window` step losses is logged with its sample id to <logging.dir>/loss_spikes.jsonl (0: off).
    spike_factor: float = 0.0
    # Steps in the running median of `spike_factor`.
    spike_window: int = 50
    loss_weights: LossWeights = field(default_factory=LossWeights)
    timestep: TimestepConfig = field(default_factory=TimestepConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)


@dataclass
class OptimConfig:
    """AdamW (decoupled weight decay, none on norms and biases) and its learning-rate schedule."""

    # Peak learning rate.
    lr: float = 1e-5
    # AdamW's moment decays.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # AdamW's epsilon.
    eps: float = 1e-8
    # Decoupled weight decay (not on norms and biases).
    weight_decay: float = 0.01
    # Learning rate after warmup: constant, or a cosine or linear decay to `min_lr_ratio` at `train.steps`.
    schedule: str = "constant"
    # Steps of linear warmup up to `lr`.
    warmup_steps: int = 0
    # Floor of cosine / linear decay, as a fraction of `lr`.
    min_lr_ratio: float = 0.0
    # What AdamW keeps per trainable parameter (`optim/kinds.py`): `adamw` float32 weights and moments
    # (16 B with the gradient); `adamw8bit` / `adamw4bit` torchao's block-wise quantized moments
    # (about 10 / 9 B); `adamw_bf16` bfloat16 weights, gradients and moments, the update stochastically
    # rounded onto the weights (8 B). The float32 islands keep float32 weights under every choice.
    name: str = "adamw"
    # Kernel of `adamw`: `fused` (one kernel over all parameters of a device and dtype), `foreach`
    # (batched ops) or `for-loop` (one parameter at a time). All three compute the same update.
    implementation: str = "fused"


@dataclass
class WandbConfig:
    """Weights & Biases, from rank 0, offline unless asked; never holds up training."""

    # Also log to wandb.
    enabled: bool = False
    # The wandb project.
    project: str = "h3train"
    # The wandb run's name (default: wandb's).
    run_name: str | None = None
    # `offline` writes locally for a later `wandb sync`; `online` sends as it goes.
    mode: str = "offline"
    # Seconds wandb may take to start before a warning and going on without it.
    init_timeout_s: float = 60.0


@dataclass
class LoggingConfig:
    """The run folder and what is written to it besides checkpoints."""

    # The run folder: metrics.jsonl, config.yaml, samples, checkpoints (by default), the run lock.
    dir: str = "runs/default"
    # A progress bar on a TTY (false: a line every few steps, as without a TTY).
    progress: bool = True
    # Also write metrics.jsonl's numbers and the rendered samples to TensorBoard, in <dir>/tensorboard.
    tensorboard: bool = False
    # Record every micro-batch's sample ids under <dir>/trained_samples/, per start of the run (a data-order
    # audit; read back with h3train.data.trained_samples.trained_samples).
    sample_ids: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CfgConfig:
    """CFG-calibrated target: train the conditional prediction toward `u + s (v - u)`.

    Per modality `L = s^(2-k) * MSE((p + (s-1) u) / s, v)`, `u` the no-grad prediction under the
    negative prompt. `scale = 1` is plain flow matching with a single forward.
    """

    # The guidance scale s of the target (1: plain flow matching, one forward).
    scale: float = 1.0
    # The video's override of `scale`.
    video_scale: float | None = None
    # The audio's override of `scale`.
    audio_scale: float | None = None
    # constant, or sigma: `1 + (s - 1) * sigma_m` with the modality's own (shifted) sigma.
    schedule: str = "constant"
    # k of the loss's `s^(2-k)` factor (0: the plain MSE to `u + s (v - u)`).
    curvature_power: float = 0.0
    # per_sample: the cached sample's negative embeddings; shared: one file for the whole dataset.
    negative: str = "per_sample"
    # The negative embeddings file of `negative: shared`.
    shared_negative_path: str | None = None
    # keep: the negative presentation keeps the keyframe / reference vision blocks; drop: plain text.
    negative_visual: str = "keep"
    # Fraction of samples whose prompt is replaced by the negative one (classic condition dropout).
    text_dropout: float = 0.0


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints: where, how often, how many are kept, and what a run resumes."""

    # The checkpoint folder: a path, or a URL on object storage (`s3://bucket/prefix`); default
    # `<logging.dir>/checkpoints`.
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
    # A LoRA run's adapter file(s) beside each checkpoint, in `<step folder>/lora/`, written by rank 0
    # once the checkpoint commits (pruned and kept with it): none; diffusers
    # (`pytorch_lora_weights.safetensors`); comfyui (`lora_comfyui.safetensors`); both. Each file is
    # what `h3train export --format <format>` writes from that checkpoint.
    export: str = "none"


@dataclass
class DebugConfig:
    """Tools for finding out what a step did."""

    # Dump that step's inputs, weights and gradients to <logging.dir>/dump/step_N/ (null: none).
    dump_step: int | None = None
    # Fault injection for tests: `nan_loss@STEP`, `nan_grad@STEP:RANK`, `kill@STEP:RANK`,
    # `sigterm@STEP`, `sigint@STEP`, `kill_in_save@STEP`, `sigint_in_save@STEP`, `corrupt_sample@ID`,
    # `rank_branch@STEP:RANK` (that rank runs one forward more than its peers), `sigterm_after_step@STEP`
    # (while the step validates and saves).
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

    # Adapter rank (0: full fine-tuning, no adapters).
    rank: int = 0
    # Scale of the adapters' output is alpha / rank; default: rank (scale 1).
    alpha: float | None = None
    # Dropout on the adapters' input (plain LoRA and DoRA only).
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
    # weight-only with one scale per output row (`model/quant.py`); 1 byte per weight instead of 2.
    base_quant: str = "none"


@dataclass
class SampleRequestConfig:
    """One rendered sample: a request in the encoder manifest's schema (`h3train/encode/manifest.py`), no clip.

    Media paths (keyframe images, references) that are relative are taken relative to the folder of the
    config file that names them (the working directory for command-line overrides), as a manifest's are
    relative to the manifest's folder; they are stored absolute, so the run folder's `config.yaml` and a
    resume read the same files.
    """

    # Names the file `<logging.dir>/samples/step_N/<id>.mp4`; default `sample_<i>` (position in the list).
    id: str = ""
    # The prompt, as an inference user writes it.
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

    # Lowest `val/guidance_ratio_<modality>` allowed.
    min_guidance_ratio: float | None = None
    # Lowest `val/guidance_cos_<modality>` allowed.
    min_guidance_cos: float | None = None
    # Highest `val/drift_<modality>` allowed.
    max_drift: float | None = None
    # What a threshold crossed does.
    action: str = "warn"


@dataclass
class ValidationConfig:
    """Held-out loss at fixed base sigmas with fixed noise, comparable from step to step and run to run,
    and rendered samples (`samples`) through diffusers' H3 pipeline with the live model."""

    # Every N optimizer steps (0: off); `at_start` also measures the step-0 baseline.
    every: int = 0
    # Also validate (and render) before the first step: the step-0 baseline.
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
    # Render the samples every N optimizer steps (0: off) and after the last.
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
    """A run's whole configuration: one section per concern."""

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


# The values of each enumerated key. Those of an extension table (`lora.kind`: `lora/adapter_kinds.py`,
# `optim.name`: `optim/kinds.py`, `data.source`: `data/source.py`, `model.attention_backend`:
# `ops/attention.py`) are listed here so the config validates alone; each table registers its entries
# (`register_entry`), so a kind added from outside the package is a valid choice, and a test holds the
# built-in lists equal to the tables.
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "model.attention_backend": ("auto", "native", "flash", "cudnn"),
    "model.activation_checkpointing": ("auto", "none", "selective", "full"),
    "data.source": ("synthetic", "cached"),
    "data.on_error": ("raise", "skip"),
    "data.pack_oversize": ("refuse", "alone"),
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
    "checkpoint.export": ("none", "diffusers", "comfyui", "both"),
}


def register_choice(key: str, value: str) -> None:
    """Make `value` a valid choice of the enumerated config key `key` (an extension table's new kind)."""
    if key not in _CHOICES:
        raise KeyError(f"config key '{key}' takes no enumerated choices")
    if value not in _CHOICES[key]:
        _CHOICES[key] = (*_CHOICES[key], value)


class Named(Protocol):
    """An extension table's entry: the name the table, and a config key's choices, know it by."""

    @property
    def name(self) -> str: ...


_Entry = TypeVar("_Entry", bound=Named)


def register_entry(table: dict[str, _Entry], entry: _Entry, what: str, key: str | None) -> _Entry:
    """Add `entry` to an extension table under its name, which becomes a choice of config key `key`.

    `what` names the table's entries in the error a second entry of the same name raises; `key` is None
    for an entry no enumerated key names (one another key selects, one only the benchmark runs).
    """
    # Refused, not replaced: a run's config, checkpoints and exports would silently change meaning.
    if entry.name in table:
        raise ValueError(f"{what} {entry.name!r} is already registered")
    table[entry.name] = entry
    if key is not None:
        register_choice(key, entry.name)
    return entry


def choices(key: str) -> tuple[str, ...]:
    """The values the enumerated config key `key` takes."""
    return _CHOICES[key]


def get_key(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


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


# `validation.samples`: requests in the encoder manifest's schema (`h3train/render/requests.py` checks
# their values). Their shape and media paths are settled here, per layer, before the layers merge.
SAMPLES_KEY = "validation.samples"
SAMPLE_FIELDS = ("id", "prompt", "task", "keyframes", "references", "frames", "resolution", "seed")


def sample_key(i: int, name: str | None = None) -> str:
    """`config key 'validation.samples[i].name'`, the prefix of every message about request `i`."""
    return f"config key '{SAMPLES_KEY}[{i}]" + (f".{name}'" if name else "'")
