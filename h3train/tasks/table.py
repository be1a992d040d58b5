"""The one task table: what each H3 task is, read by every part that needs to know.

Two kinds of task, as in diffusers' MiniMax-H3 pipeline:

- a **sample task** (`SAMPLE_TASKS`) is what one clip is: `t2va` (prompt only), `fl2va` (first /
  last keyframes) or `ref2va` (image / video / audio references). It fixes its conditioning kind
  (`tasks/conditioning.py`: the manifest fields, the encoder's recipe, the layout builder), the partition
  inference serves it from and the core denoise block that renders it;
- a **training task** (`TRAINING_TASKS`, `task.name`) is which sample tasks a run trains on and
  which released partition (`transformer` or `transformer_ref`) it fine-tunes. diffusers runs
  `t2va` and `fl2va` requests on `transformer` and `ref2va` on `transformer_ref`, so a fine-tune of
  one partition only helps the tasks inference routes to it.

A new task is one entry here (and, for a sample task with a new kind of conditioning, that kind in
`tasks/conditioning.py`).
This module imports nothing from h3train, so the config, the data and the renderer can all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every clip is `17 n + 5` frames at 24 fps: the video VAE turns each chunk of 17 frames into 5
# latent frames (`diffusers ... modular_pipeline.align_num_frames`), so `17 n + 5` -> `5 n + 2`.
VAE_FRAMES_PER_CHUNK = 17
VAE_LATENTS_PER_CHUNK = 5
FRAME_RULE = "17 n + 5"
# Where every `SampleTask.denoise_block` class lives.
DENOISE_BLOCKS_MODULE = "diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3"


@dataclass(frozen=True)
class SampleTask:
    """One kind of clip.

    `partition`: the checkpoint partition diffusers runs it on. `denoise_block`: the class name of
    its core denoise step in `DENOISE_BLOCKS_MODULE`. `conditioning`: the manifest (and render
    request) field holding its conditioning, `keyframes`, `references` or None (prompt only); a
    cached sample carries anchors / references exactly when its task takes that field. The kind
    lays the sample out; a prompt-only one takes diffusers' packed layout without conditioning rows.
    """

    name: str
    partition: str
    denoise_block: str
    conditioning: str | None


@dataclass(frozen=True)
class TrainingTask:
    """One value of `task.name`: the sample tasks it trains and the partition it fine-tunes.

    `sample_tasks` is also what the run reads: a cached dataset's other samples are filtered out,
    `data.source=synthetic` and `data.create_synthetic` make only these. `partition` None (mixed)
    means the run must name it (`model.subfolder`) when it loads a pretrained folder; a model built
    from `model.config` trains every task into one model.
    """

    name: str
    sample_tasks: tuple[str, ...]
    partition: str | None


SAMPLE_TASKS: dict[str, SampleTask] = {
    t.name: t
    for t in (
        SampleTask("t2va", "transformer", "MiniMaxH3CoreDenoiseStep", None),
        SampleTask("fl2va", "transformer", "MiniMaxH3FL2VACoreDenoiseStep", "keyframes"),
        SampleTask("ref2va", "transformer_ref", "MiniMaxH3Ref2VACoreDenoiseStep", "references"),
    )
}

TRAINING_TASKS: dict[str, TrainingTask] = {
    t.name: t
    for t in (
        # fl2va training keeps the text-only clips of its data: the same partition serves them.
        TrainingTask("fl2va", ("t2va", "fl2va"), "transformer"),
        TrainingTask("t2va", ("t2va",), "transformer"),
        TrainingTask("ref2va", ("ref2va",), "transformer_ref"),
        TrainingTask("mixed", ("t2va", "fl2va", "ref2va"), None),
    )
}

PARTITIONS: tuple[str, ...] = tuple(dict.fromkeys(t.partition for t in SAMPLE_TASKS.values()))


def partition_tasks(partition: str) -> tuple[str, ...]:
    """The sample tasks inference serves from `partition` (`transformer`: t2va, fl2va)."""
    return tuple(name for name, t in SAMPLE_TASKS.items() if t.partition == partition)


def sample_task_of(conditioning: str | None) -> str:
    """The sample task whose clips take `conditioning` (`keyframes`: fl2va, `references`: ref2va, None: t2va)."""
    return next(name for name, t in SAMPLE_TASKS.items() if t.conditioning == conditioning)


def training_task_for(sample_tasks: set[str]) -> str:
    """The narrowest `task.name` that trains every sample task in `sample_tasks`."""
    fitting = [t for t in TRAINING_TASKS.values() if sample_tasks <= set(t.sample_tasks)]
    return min(fitting, key=lambda t: len(t.sample_tasks)).name


def is_frame_count(frames: int, min_chunks: int = 0) -> bool:
    """Whether `frames` is `17 n + 5` with `n >= min_chunks`."""
    n, rest = divmod(frames - VAE_LATENTS_PER_CHUNK, VAE_FRAMES_PER_CHUNK)
    return rest == 0 and n >= min_chunks


def frame_counts_around(frames: int, min_chunks: int = 0) -> tuple[int, int]:
    """The valid frame counts just below and just above `frames`, for a hint in an error message.

    Both are `frames` when it is valid, and both the floor (`n = min_chunks`) when it lies below that.
    """
    floor = VAE_FRAMES_PER_CHUNK * min_chunks + VAE_LATENTS_PER_CHUNK
    n = max(0, (frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK)
    below = max(floor, VAE_FRAMES_PER_CHUNK * n + VAE_LATENTS_PER_CHUNK)
    above = below + VAE_FRAMES_PER_CHUNK if below < frames else below
    return below, above
