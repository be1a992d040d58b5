"""A synthetic cached dataset: random latents and embeddings with real H3 geometry rules, tiny sizes.

Geometry follows the pipeline: `17 n + 5` pixel frames (5 or 22 here) give `5 n + 2` latent frames
(2 or 7) and `round(frames / 24 * 40)` audio latents per channel (8 or 37); latents are 4x4 or 4x6.
A dataset for `task.name=X` holds only the sample tasks X trains (`TRAINING_TASKS[X].sample_tasks`).
Conditioning varies over samples so that every layout branch is exercised: fl2va anchors first /
last / both / none (t2va; a t2va dataset holds only those), ref2va references image, video with and
without soundtrack, audio, and several mixed, some samples without target audio. Reference media
follow the pipeline's rules too: video references are at most as long as the target and soundtracks
and audio references are truncated to the target duration. Text token tags mimic the prompt
presentations (labels as text, vision blocks tagged 0).

Sample `i` is a pure function of `(seed, i)`. Written to disk and read back as any cached dataset
(`h3train synth`, `data.create_synthetic`); `tasks/synthetic.py` is the in-memory source of one
fixed geometry (`data.source=synthetic`).

`released=True` writes the longest released clip instead (`released_sample`): 15 s at 768x1344 with
a 2,048-token prompt prefix, the sample the memory plan and the step-time estimate assume, so that a
first run on a new cluster measures that sample before any real data is encoded.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    audio_latent_num_frames,
    video_latent_num_frames,
)

from ..errors import DatasetError
from ..tasks.conditioning import ReferenceLatents, ReferencesKind, conditioning_of
from ..tasks.layout import AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS
from ..tasks.released import LATENT_SIZE, LONGEST_PIXEL_FRAMES, TEXT_ROWS
from ..tasks.table import TRAINING_TASKS, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK, sample_task_of
from .dataset_index import write_index
from .location import INDEX_NAME, SAMPLE_SUFFIX
from .sample_file import CachedSample, write_sample

PIXEL_FRAMES = (5, 22)
LATENT_SIZES = ((4, 4), (4, 6))
REFERENCE_SIZES = ((4, 4), (6, 4), (4, 6))
ANCHOR_CYCLE: tuple[tuple[str, ...], ...] = (("first",), ("last",), ("first", "last"), ())
# (kind, has_audio) per reference, in request order.
REFERENCE_CYCLE: tuple[tuple[tuple[str, bool], ...], ...] = (
    (("image", False),),
    (("video", True),),
    (("video", False),),
    (("image", False), ("audio", True)),
    (("audio", True), ("video", True), ("image", False), ("video", False), ("image", False)),
    (("image", False), ("image", False)),
)
# Presentation token counts: a "<Picture i>: " style label, a vision block (start, pads, end), the
# timestamped blocks of a reference video, the prompt, and the negative prompt " ".
LABEL_TOKENS = 3
VISION_BLOCK_TOKENS = 6
VIDEO_BLOCKS = 2
PROMPT_TOKENS = (6, 12)
NEGATIVE_TOKENS = 1
TEXT_TAG, VISION_TAG = 1, 0


def write_synthetic_dataset(
    out_dir: str | os.PathLike,
    task: str = "mixed",
    num_samples: int = 16,
    seed: int = 0,
    text_dim: int = 16,
    overwrite: bool = False,
    released: bool = False,
) -> Path:
    """Write `num_samples` synthetic samples and their `index.jsonl` into `out_dir`; return the folder.

    `task` is a `task.name`: `fl2va` (t2va + fl2va samples), `t2va`, `ref2va` or `mixed` (packed and
    ref2va samples alternating). `text_dim` is the
    width of the prompt embeddings (the model's `text_dim`). A folder that already holds samples or
    an index is refused unless `overwrite`, which first removes those files (and nothing else).
    `released`: every sample is the longest released clip (`released_sample`, about 60 MiB each)
    rather than a tiny one of the cycles above.
    """
    if task not in TRAINING_TASKS:
        raise DatasetError(f"synthetic task '{task}' is not one of {', '.join(TRAINING_TASKS)}")
    if num_samples < 1 or text_dim < 1:
        raise DatasetError(f"need num_samples >= 1 and text_dim >= 1, got {num_samples} and {text_dim}")
    out = Path(out_dir)
    _prepare_folder(out, overwrite)
    make = released_sample if released else synthetic_sample
    for i in range(num_samples):
        sample = make(task, i, seed, text_dim)
        write_sample(out / f"{sample.sample_id}{SAMPLE_SUFFIX}", sample)
    write_index(out)
    return out


def _prepare_folder(out: Path, overwrite: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.rglob(f"*{SAMPLE_SUFFIX}")) + [p for p in (out / INDEX_NAME,) if p.exists()]
    if existing and not overwrite:
        raise DatasetError(
            f"dataset folder '{out}' already holds {len(existing)} sample/index files; "
            "choose an empty folder or overwrite it"
        )
    for path in existing:
        path.unlink()


def _anchor_cycle(trained: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The anchor sets of `ANCHOR_CYCLE` whose sample task (fl2va with anchors, t2va without) is in `trained`."""
    return tuple(a for a in ANCHOR_CYCLE if sample_task_of("keyframes" if a else None) in trained)


def synthetic_sample(task: str, i: int, seed: int, text_dim: int) -> CachedSample:
    """Sample `i` of a synthetic dataset of `task` (a `task.name`), one of the sample tasks it trains.

    The layouts of those tasks (diffusers' packed one for t2va / fl2va, the ref2va one) take turns, in
    table order.
    """
    rng = random.Random(seed * 1_000_003 + i)
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    trained = TRAINING_TASKS[task].sample_tasks
    # Whether a turn's sample has references: t2va and fl2va samples share the packed layout's turns.
    turns = tuple(dict.fromkeys(isinstance(conditioning_of(t), ReferencesKind) for t in trained))
    with_references = turns[i % len(turns)]
    turn = i // len(turns)

    num_frames = rng.choice(PIXEL_FRAMES)
    frames = video_latent_num_frames(num_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    num_audio = audio_latent_num_frames(num_frames)
    height, width = rng.choice(LATENT_SIZES)
    has_audio = i % 3 != 2
    video = torch.randn(VIDEO_LATENT_CHANNELS, frames, height, width, generator=g)
    audio = torch.randn(2, AUDIO_LATENT_CHANNELS, num_audio, generator=g) * float(has_audio)

    anchors: tuple[str, ...] = ()
    references: tuple[ReferenceLatents, ...] = ()
    if with_references:
        plan = REFERENCE_CYCLE[turn % len(REFERENCE_CYCLE)]
        references = tuple(_reference(kind, with_sound, num_frames, rng, g) for kind, with_sound in plan)
        blocks = _reference_blocks(references)
    else:
        cycle = _anchor_cycle(trained)
        anchors = cycle[turn % len(cycle)]
        # "<Picture i>: " and a vision block per keyframe.
        blocks = [1] * len(anchors)
    # Keyframe latents are the target's own first / last latent frame, as when encoded from the clip.
    frame_of = {"first": 0, "last": frames - 1}
    keyframes = tuple(video[:, frame_of[a] : frame_of[a] + 1] for a in anchors)

    prompt_len = rng.randint(*PROMPT_TOKENS)
    return _sample(
        i,
        f"synthetic(seed={seed}, index={i})",
        num_frames,
        (video, audio, has_audio),
        (anchors, keyframes, references, blocks),
        prompt_len,
        lambda rows: torch.randn(rows, text_dim, generator=g),
    )


def _sample(
    i: int,
    source: str,
    num_frames: int,
    media: tuple[torch.Tensor, torch.Tensor, bool],
    conditioning: tuple[tuple[str, ...], tuple[torch.Tensor, ...], tuple[ReferenceLatents, ...], list[int]],
    prompt_len: int,
    embeds: Callable[[int], torch.Tensor],
) -> CachedSample:
    """Sample `i`: its `(video, audio, has_audio)` latents, `(anchors, keyframes, references, vision blocks)`,
    and prompts of `prompt_len` text tokens whose embeddings `embeds(rows)` draws (prompt, negative, then
    the visual negative, as the encoder writes them: without vision blocks the visual negative is the
    text one)."""
    video, audio, has_audio = media
    anchors, keyframes, references, blocks = conditioning
    tags = _presentation_tags(blocks, prompt_len)
    negative_tags = _presentation_tags([], NEGATIVE_TOKENS)
    prompt = embeds(len(tags))
    negative = embeds(len(negative_tags))
    visual_tags = _presentation_tags(blocks, NEGATIVE_TOKENS) if blocks else negative_tags
    return CachedSample(
        sample_id=f"synth-{i:06d}",
        task=sample_task_of("references" if references else "keyframes" if anchors else None),
        num_frames=num_frames,
        video_latents=video,
        audio_latents=audio,
        prompt_embeds=prompt,
        text_token_tags=tags,
        negative_prompt_embeds=negative,
        negative_text_token_tags=negative_tags,
        has_audio=has_audio,
        keyframe_anchors=anchors,
        keyframes=keyframes,
        references=references,
        negative_visual_prompt_embeds=embeds(len(visual_tags)) if blocks else negative,
        negative_visual_text_token_tags=visual_tags,
        source=source,
    )


def released_sample(task: str, i: int, seed: int, text_dim: int) -> CachedSample:
    """Sample `i` of `task` (a `task.name`) at the longest released clip's geometry, random values.

    The packed layout's turn (t2va / fl2va) has first and last keyframes when the task trains fl2va
    samples, none for t2va alone; the ref2va turn has two image references on the canvas, whose rows
    are those of the two keyframes. Either packs to the plan's longest released clip. Prompt
    embeddings are bfloat16 (the format takes it), which halves the largest tensor beside the video.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    trained = TRAINING_TASKS[task].sample_tasks
    turns = tuple(dict.fromkeys(isinstance(conditioning_of(t), ReferencesKind) for t in trained))
    with_references = turns[i % len(turns)]
    num_frames = LONGEST_PIXEL_FRAMES
    frames = video_latent_num_frames(num_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    height, width = LATENT_SIZE
    video = torch.randn(VIDEO_LATENT_CHANNELS, frames, height, width, generator=g)
    audio = _audio(audio_latent_num_frames(num_frames), g)
    anchors: tuple[str, ...] = ()
    references: tuple[ReferenceLatents, ...] = ()
    if with_references:
        references = tuple(
            ReferenceLatents("image", video=torch.randn(VIDEO_LATENT_CHANNELS, 1, height, width, generator=g))
            for _ in range(2)
        )
        blocks = _reference_blocks(references)
    else:
        anchors = ("first", "last") if sample_task_of("keyframes") in trained else ()
        blocks = [1] * len(anchors)
    keyframes = (video[:, :1], video[:, -1:])[: len(anchors)]
    # The prompt fills the prefix the presentation's labels and vision blocks leave.
    prompt_len = TEXT_ROWS - len(_presentation_tags(blocks, 0))
    return _sample(
        i,
        f"synthetic released clip(seed={seed}, index={i})",
        num_frames,
        (video, audio, True),
        (anchors, keyframes, references, blocks),
        prompt_len,
        lambda rows: torch.randn(rows, text_dim, generator=g).to(torch.bfloat16),
    )


def _reference(
    kind: str, with_sound: bool, target_frames: int, rng: random.Random, g: torch.Generator
) -> ReferenceLatents:
    """Random latents of one reference, no longer than the target (the pipeline truncates to it)."""
    target_audio = audio_latent_num_frames(target_frames)
    if kind == "audio":
        return ReferenceLatents("audio", audio=_audio(rng.randint(1, target_audio), g))
    height, width = rng.choice(REFERENCE_SIZES)
    if kind == "image":
        return ReferenceLatents("image", video=torch.randn(VIDEO_LATENT_CHANNELS, 1, height, width, generator=g))
    ref_frames = rng.choice([f for f in PIXEL_FRAMES if f <= target_frames])
    latent_frames = video_latent_num_frames(ref_frames, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK)
    video = torch.randn(VIDEO_LATENT_CHANNELS, latent_frames, height, width, generator=g)
    sound = _audio(audio_latent_num_frames(ref_frames), g) if with_sound else None
    return ReferenceLatents("video", video=video, audio=sound)


def _audio(num_latents: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(2, AUDIO_LATENT_CHANNELS, num_latents, generator=g)


def _reference_blocks(references: tuple[ReferenceLatents, ...]) -> list[int]:
    """The labels of the ref2va presentation, as the number of vision blocks following each label.

    As in diffusers' `_build_presentation`: a sound-carrying reference is labelled "<Audio j>" first,
    an image gets a label and one vision block, a video a label and timestamped vision blocks.
    """
    blocks = []
    for ref in references:
        if ref.has_audio:
            blocks.append(0)  # "<Audio j>: "
        if ref.kind == "image":
            blocks.append(1)  # "<Picture i>: " + vision block
        elif ref.kind == "video":
            blocks.append(0)  # "<Video k>: "
            blocks += [1] * VIDEO_BLOCKS  # "<t seconds>" + vision block, per block
    return blocks


def _presentation_tags(blocks: list[int], prompt_len: int) -> torch.Tensor:
    """Token tags `[L]`: each label as text, the vision blocks after it as video (0), then the prompt."""
    tags: list[int] = []
    for vision_blocks in blocks:
        tags += [TEXT_TAG] * LABEL_TOKENS + [VISION_TAG] * (VISION_BLOCK_TOKENS * vision_blocks)
    tags += [TEXT_TAG] * prompt_len
    return torch.tensor(tags, dtype=torch.long)
