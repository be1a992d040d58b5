"""A whole manifest -> a dataset folder: windows of each clip, skipping what is up to date, the held-out
split (by clip), the table, the footage used, errors."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

from ..data.components import check_components_folder, components_fingerprint, load_components
from ..data.dataset_index import write_index
from ..data.location import INDEX_NAME, INPUTS_SUFFIX, SAMPLE_SUFFIX
from ..data.sample_file import verify_sample, write_sample
from ..errors import ConfigError
from ..infra.atomic import atomic_write_text, is_temporary, set_aside
from ..infra.diskspace import no_space
from ..infra.runlock import RunLock
from ..tasks.table import VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK
from .clip import ENCODER_VERSION, EncodeSettings, EncodingPipeline, build_pipeline, encode_entry
from .manifest import CAPTION_SUFFIX, VIDEO_SUFFIXES, ManifestEntry, read_clip_folder, read_manifest
from .media import FPS, ClipTooShort, MediaError, aligned_down, aligned_frame_count, shortest_kept
from .windows import Window, Windowing, footage_used, plan_clips

ERRORS_NAME = "errors.jsonl"
# One line per sample (a window of a clip): what its clip's file held and what became of it (`ClipRow`).
TABLE_NAME = "clips.tsv"
# The held-out split (`--heldout`): a dataset of its own inside the output folder.
HELDOUT_NAME = "heldout"
# Still images are no training samples: a clip folder's are skipped by name, a manifest's `video` fails
# as one (see docs/encoding.md). Images serve as keyframes and references.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# The fewest frames the pipeline renders, one VAE chunk (`render/requests.py`, MIN_CHUNKS): a shorter
# sample trains on a length inference never produces.
SHORTEST_RENDERED = VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK
# How far a clip may be scaled up onto the canvas before the summary warns that it trains on blur.
UPSCALE_WARNED = 2.0
# Names a summary line lists before it counts the rest.
NAMED = 5


class NotAClip(MediaError):
    """A manifest's `video` that is a still image: the encoder trains on clips only."""

    kind = "image, not a clip"


def _named(names: list[str], limit: int = NAMED) -> str:
    """`'a', 'b' and 3 more`: the first `limit` of `names`, quoted, and a count of the rest."""
    shown = ", ".join(f"'{name}'" for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


# --------------------------------------------------------------------------------------------------
# A whole manifest.


@dataclass(frozen=True)
class ClipRow:
    """One line of the encode table (`clips.tsv`): a sample, what its clip's file held and what became of it.

    `clip` the clip's id (the sample's own for `--windows first`); `source` as `Source.describe` gives
    it; `canvas` width x height; `frames` / `seconds` of the sample at 24 fps; `start` where in the clip
    it begins and `duration` the clip's whole length, in seconds (`covers`: `3.00-4.62 of 12.00 s`);
    `audio` `yes` or `none`; `outcome` `encoded`, `up to date`, or `failed: <kind>` (the reason is in
    `errors.jsonl`). Fields of a clip that failed before it was read are empty.
    """

    sample_id: str
    source: str = ""
    canvas: str = ""
    frames: int | None = None
    seconds: float | None = None
    audio: str = ""
    outcome: str = ""
    clip: str = ""
    start: float | None = None
    duration: float | None = None
    # How far the clip was scaled up onto the canvas (the larger of the two sides' ratios; None: not read).
    upscale: float | None = None

    COLUMNS = ("id", "clip", "source", "canvas", "frames", "seconds", "covers", "audio", "outcome")

    @property
    def covers(self) -> str:
        """`3.00-4.62 of 12.00 s`: the seconds of the clip the sample holds ('' before it was read)."""
        if self.seconds is None or self.start is None:
            return ""
        whole = f" of {self.duration:.2f}" if self.duration is not None else ""
        return f"{self.start:.2f}-{self.start + self.seconds:.2f}{whole} s"

    def cells(self) -> tuple[str, ...]:
        seconds = "" if self.seconds is None else f"{self.seconds:.2f}"
        frames = "" if self.frames is None else str(self.frames)
        return (
            self.sample_id,
            self.clip,
            self.source,
            self.canvas,
            frames,
            seconds,
            self.covers,
            self.audio,
            self.outcome,
        )

    def describe(self) -> str:
        """The console line of `--verbose`.

        `id: 640x360 25 fps 5.00 s -> 512x288, 107 frames (0.00-4.46 of 5.00 s), audio yes: encoded`.
        """
        if not self.canvas:
            return f"{self.sample_id}: {self.source + ' -> ' if self.source else ''}{self.outcome}"
        return (
            f"{self.sample_id}: {self.source} -> {self.canvas}, {self.frames} frames ({self.covers}), "
            f"audio {self.audio}: {self.outcome}"
        )


def write_table(folder: Path, rows: list[ClipRow]) -> Path:
    """`folder/clips.tsv`: a header and one tab-separated line per sample, in id order."""
    lines = ["\t".join(ClipRow.COLUMNS)] + ["\t".join(r.cells()) for r in sorted(rows, key=lambda r: r.sample_id)]
    path = folder / TABLE_NAME
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


@dataclass
class EncodeSummary:
    """Counts over all ranks: samples written now, already up to date, and samples that failed (by kind).

    `heldout`: samples of the held-out split (`--heldout`, in `out/heldout`), counted in the others too;
    `footage` / `used`: seconds of all the clips whose length is known, and of them held by a sample
    (overlapping windows counted once); `underused`: `(clip id, fraction used)` of each clip with a sample
    of which most goes unused; `more`: the flag that would use more of them (`Windowing.more_footage`).

    `skipped_files`: why -> the files of a clip folder that became no sample (relative paths);
    `failed_ids`: failure kind -> the sample ids that failed so; `short`: `(sample id, frames, clip seconds)`
    of the samples shorter than `SHORTEST_RENDERED`; `upscaled`: `(clip id, source, canvas, ratio)` of the
    clips scaled up more than `UPSCALE_WARNED`; `settings`: what the warnings name as the way out.
    """

    encoded: int
    skipped: int
    failed: int
    out: Path
    failures: dict[str, int] = field(default_factory=dict)
    heldout: int = 0
    footage: float = 0.0
    used: float = 0.0
    underused: list[tuple[str, float]] = field(default_factory=list)
    more: str | None = None
    skipped_files: dict[str, list[str]] = field(default_factory=dict)
    failed_ids: dict[str, list[str]] = field(default_factory=dict)
    short: list[tuple[str, int, float | None]] = field(default_factory=list)
    upscaled: list[tuple[str, str, str, float]] = field(default_factory=list)
    settings: EncodeSettings = field(default_factory=EncodeSettings)

    @property
    def ok(self) -> bool:
        """At least one sample of the manifest is in the dataset."""
        return self.encoded + self.skipped > 0

    def describe(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        line = f"encoded {self.encoded}, up to date {self.skipped}, failed {self.failed}"
        line += f" ({kinds}; reasons in {ERRORS_NAME})" if self.failed else ""
        line += f" -> {self.out}"
        if self.heldout:
            line += f", {self.heldout} of them held out in {self.out / HELDOUT_NAME}"
        line += f"; one line per sample in {self.out / TABLE_NAME}"
        if self.footage > 0:
            line += f"\nuses {self.used:.1f} s of {self.footage:.1f} s of footage ({self.used / self.footage:.0%})"
        for kind, ids in sorted(self.failed_ids.items()):
            line += f"\nfailed ({kind}): {_named(sorted(ids))}; reasons in {self.out / ERRORS_NAME}"
        for why, files in sorted(self.skipped_files.items()):
            line += f"\nskipped {_plural(len(files), 'file')}, {why}: {_named(files)}"
        return line

    def warnings(self) -> list[str]:
        """One line per thing to look at, each naming its clips and the setting that changes it: the clips of
        which most goes unused, samples shorter than the pipeline renders, clips scaled up past 2x."""
        found = []
        if self.underused:
            named = ", ".join(f"{clip} ({used:.0%} used)" for clip, used in self.underused[:NAMED])
            more = len(self.underused) - NAMED
            named += f" and {more} more (see {TABLE_NAME})" if more > 0 else ""
            count = len(self.underused)
            way = f"; {self.more} would use more" if self.more else ""
            found.append(f"most of the footage of {count} clip{'s' if count > 1 else ''} goes unused: {named}{way}")
        if self.short:
            named = ", ".join(
                f"'{sample}' ({frames} frames" + (f" of a {seconds:.2f} s clip)" if seconds else ")")
                for sample, frames, seconds in self.short[:NAMED]
            )
            more = len(self.short) - NAMED
            named += f" and {more} more (see {TABLE_NAME})" if more > 0 else ""
            # --min-seconds at this value keeps a clip of SHORTEST_RENDERED frames (rounded down) and drops shorter.
            floor = f"{SHORTEST_RENDERED / FPS:.2f}"
            found.append(
                f"{_plural(len(self.short), 'sample')} shorter than the {SHORTEST_RENDERED} frames "
                f"({floor} s) the pipeline renders at least: {named}; --min-seconds {floor} "
                f"(now {self.settings.min_seconds:g}) leaves such clips out, or give longer clips"
            )
        if self.upscaled:
            named = ", ".join(
                f"'{clip}' ({source} -> {canvas}, {ratio:.1f}x)"
                for clip, source, canvas, ratio in self.upscaled[:NAMED]
            )
            more = len(self.upscaled) - NAMED
            named += f" and {more} more (see {TABLE_NAME})" if more > 0 else ""
            found.append(
                f"{_plural(len(self.upscaled), 'clip')} scaled up more than {UPSCALE_WARNED:g}x onto the canvas: "
                f"{named}; a lower --short-edge (now {self.settings.short_edge}) keeps them sharper, or give "
                "larger clips"
            )
        return found


def input_digest(
    entry: ManifestEntry,
    settings: EncodeSettings,
    components_id: str,
    text_dtype: torch.dtype,
    window: Window | None = None,
) -> str:
    """Digest of everything a sample's content depends on, but the clip's length: the entry and its media
    files, the canvas and reference settings, components, recipe, and where a window of a longer clip
    starts and how long it is (`window`, whose sample id is not the clip's; None for a clip's only sample).

    `min_seconds` / `max_seconds` only choose the frame count of a clip's first window, which `inputs.json`
    records with the clip's length, so changing them re-encodes only the clips whose frame count they
    change (`_up_to_date`).
    """
    geometry = {k: v for k, v in asdict(settings).items() if k not in ("min_seconds", "max_seconds")}
    payload = {
        "encoder_version": ENCODER_VERSION,
        "entry": entry.fingerprint(),
        "settings": geometry,
        "components": components_id,
        "text_encoder_dtype": str(text_dtype),
    }
    if window is not None and window.sample_id != entry.sample_id:
        payload["window"] = {"start": window.start, "frames": window.frames}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def split_heldout(
    entries: list[ManifestEntry], count: int, seed: int = 0
) -> tuple[list[ManifestEntry], list[ManifestEntry]]:
    """`(training, heldout)`: `count` clips held out by a seeded rule that depends on each clip's id alone.

    The clips with the smallest `sha256(f"{seed}:{id}")` are held out, so the split is the same on
    every rank and every rerun of the same clips. Every window of a held-out clip is held out with it.
    """
    if count <= 0:
        return entries, []
    if count >= len(entries):
        raise ConfigError(f"--heldout {count} leaves no clip to train on ({len(entries)} clips); hold out fewer")
    rank = sorted(entries, key=lambda e: hashlib.sha256(f"{seed}:{e.sample_id}".encode()).hexdigest())
    held = {e.sample_id for e in rank[:count]}
    return [e for e in entries if e.sample_id not in held], [e for e in entries if e.sample_id in held]


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` where there is a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def encode_manifest(
    manifest: str | os.PathLike,
    components: str | os.PathLike,
    out: str | os.PathLike,
    settings: EncodeSettings | None = None,
    device: str | torch.device | None = None,
    text_encoder_dtype: torch.dtype | None = None,
    progress: bool = True,
    heldout: int = 0,
    caption_prefix: str = "",
    verbose: bool = False,
    windowing: Windowing | None = None,
) -> EncodeSummary:
    """Encode every clip of `manifest` into the dataset folder `out`, alone or as one rank of torchrun.

    `manifest`: a manifest file, or a folder of clips with same-named `.txt` captions
    (`read_clip_folder`). `windowing`: which spans of each clip become samples (`windows.py`; default
    its first window). `heldout`: clips held out into the dataset `out/heldout` (`split_heldout`), with
    all their windows; `caption_prefix`: text put before every prompt (a trigger word); `verbose`: each
    sample's table line on the console too. Raises `ConfigError` for a bad manifest, settings or
    components folder (before any process group); a failing sample is recorded in `errors.jsonl` and
    does not stop the run. `text_encoder_dtype` defaults to bfloat16 on a GPU and float32 on the CPU.
    """
    settings = settings or EncodeSettings()
    settings.validate()
    windowing = windowing or Windowing()
    windowing.validate(settings)
    from_folder = Path(manifest).is_dir()
    entries = read_clip_folder(manifest) if from_folder else read_manifest(manifest)
    if caption_prefix.strip():
        entries = [replace(e, prompt=f"{caption_prefix.strip()} {e.prompt}".strip()) for e in entries]
    training, held = split_heldout(entries, heldout)
    plans = plan_clips(entries, windowing, settings)
    check_components_folder(components)
    device = torch.device(device) if device is not None else default_device()
    text_dtype = text_encoder_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output '{out}' exists and is not a folder")

    # The first rank locks the folder before the process group exists: a second encode into it stops.
    lock = RunLock([(out, f"--out '{out}'")]) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        for note in lock.acquire() if lock is not None else []:
            print(note, file=sys.stderr, flush=True)
        # A held-out split from an earlier run stays a group (empty now) so its samples move back.
        keep_split = held or (out / HELDOUT_NAME / INDEX_NAME).is_file()
        groups = [
            (folder, [(entry, window) for entry in group for window in plans[entry.sample_id].windows])
            for folder, group in [(out, training)] + ([(out / HELDOUT_NAME, held)] if keep_split else [])
        ]
        durations = {clip: plan.duration for clip, plan in plans.items()}
        summary = _encode(
            groups, durations, windowing, components, out, settings, device, text_dtype, progress, verbose, from_folder
        )
        if from_folder:
            summary.skipped_files = skipped_files(Path(manifest), out)
        return summary
    finally:
        if lock is not None:
            lock.release()


Job = tuple[ManifestEntry, Window]


def _encode(
    groups: list[tuple[Path, list[Job]]],
    durations: dict[str, float | None],
    windowing: Windowing,
    components: str | os.PathLike,
    out: Path,
    settings: EncodeSettings,
    device: torch.device,
    text_dtype: torch.dtype,
    progress: bool,
    verbose: bool,
    from_folder: bool = False,
) -> EncodeSummary:
    # Alone: a single-process state. Under torchrun: one process group (gloo for a CPU encode, NCCL on
    # the GPUs), each rank a contiguous share of the samples.
    state = PartialState(cpu=device.type == "cpu")
    if state.is_main_process:
        for folder, _ in groups:
            _prepare_output(folder)
        _move_between_splits(groups)
        dropped = _drop_earlier_windows(groups, set(durations))
        if dropped:
            print(
                f"h3train encode: removed {dropped} sample{'s' if dropped > 1 else ''} of windows these settings "
                "no longer cut from their clips",
                file=sys.stderr,
                flush=True,
            )
    state.wait_for_everyone()
    pipe = build_pipeline(load_components(components, device, text_dtype), settings)
    components_id = components_fingerprint(components)
    jobs = [(folder, entry, window) for folder, group in groups for entry, window in group]
    rows: list[tuple[str, ClipRow]] = []
    with state.split_between_processes(jobs) as mine:
        bar = tqdm(
            mine,
            desc=f"encode (rank {state.process_index})",
            unit="sample",
            disable=not progress or not state.is_main_process,
        )
        for folder, entry, window in bar:
            digest = input_digest(entry, settings, components_id, text_dtype, window)
            # Where the clip came from, for its failure line: a clip folder has no manifest lines.
            origin = f"file '{entry.video.relative}'" if from_folder else f"manifest line {entry.line}"
            row = _encode_to_folder(
                pipe, entry, window, durations[entry.sample_id], settings, folder, digest, bar, origin
            )
            rows.append((str(folder), row))
            if verbose:
                bar.write(f"h3train encode: {row.describe()}", file=sys.stderr)
    every = [row for part in gather_object([rows]) for row in part]
    if state.is_main_process:
        # The held-out dataset first: `write_index` leaves out a subfolder that has an index of its own.
        for folder, _ in reversed(groups):
            write_index(folder)
            write_table(folder, [row for where, row in every if where == str(folder)])
    state.wait_for_everyone()
    if state.use_distributed:
        state.destroy_process_group()
    outcomes = [row.outcome for _, row in every]
    failures = Counter(o.removeprefix("failed: ") for o in outcomes if o.startswith("failed: "))
    kept = [row for _, row in every if row.outcome in ("encoded", "up to date")]
    spans = [(row.clip, round(row.start * FPS), row.frames) for row in kept if row.start is not None and row.frames]
    footage, used, underused = footage_used(spans, durations)
    # No flag gets a second sample out of a clip shorter than two windows: its unused footage is the
    # 17 n + 5 rule's, not the windowing's, and `more` would send the user nowhere.
    whole = 2 * aligned_down(windowing.window_frames(settings))
    underused = [(clip, share) for clip, share in underused if (durations[clip] or 0) * FPS >= whole]
    failed_ids: dict[str, list[str]] = {}
    for _, row in every:
        if row.outcome.startswith("failed: "):
            failed_ids.setdefault(row.outcome.removeprefix("failed: "), []).append(row.sample_id)
    short = sorted(
        (row.sample_id, row.frames, row.duration) for row in kept if row.frames and row.frames < SHORTEST_RENDERED
    )
    upscaled = {
        row.clip: (row.clip, row.source.split(" ")[0], row.canvas, row.upscale)
        for row in sorted(kept, key=lambda r: r.sample_id)
        if row.upscale is not None and row.upscale > UPSCALE_WARNED
    }
    return EncodeSummary(
        encoded=outcomes.count("encoded"),
        skipped=outcomes.count("up to date"),
        failed=sum(failures.values()),
        out=out,
        failures=dict(failures),
        heldout=sum(len(group) for folder, group in groups if folder != out),
        footage=footage,
        used=used,
        underused=underused,
        more=windowing.more_footage() if underused else None,
        failed_ids=failed_ids,
        short=short,
        upscaled=list(upscaled.values()),
        settings=settings,
    )


def skipped_files(folder: Path, out: Path) -> dict[str, list[str]]:
    """The files of the clip folder `folder` that became no sample, by why (paths relative to `folder`, sorted).

    Hidden files are left out, as `read_clip_folder` leaves them, and so is the output folder when it lies
    inside; a clip's caption and an image's caption are its own, not skipped files of their own.
    """
    out = out.resolve()
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".") and not p.resolve().is_relative_to(out)
    )
    suffix_of = {p.with_suffix(""): p.suffix.lower() for p in files if p.suffix.lower() != CAPTION_SUFFIX}
    found: dict[str, list[str]] = {}
    for path in files:
        suffix = path.suffix.lower()
        if suffix in VIDEO_SUFFIXES:
            continue
        if suffix == CAPTION_SUFFIX:
            if path.with_suffix("") in suffix_of:
                continue
            why = "captions without a clip of the same name"
        elif suffix in IMAGE_SUFFIXES:
            why = "image files are not clips (a sample is a video; stills serve as keyframes or references)"
        else:
            why = f"not a clip (clips are {', '.join(VIDEO_SUFFIXES)})"
        found.setdefault(why, []).append(path.relative_to(folder).as_posix())
    return found


def _encode_to_folder(
    pipe: EncodingPipeline,
    entry: ManifestEntry,
    window: Window,
    duration: float | None,
    settings: EncodeSettings,
    out: Path,
    digest: str,
    bar: tqdm,
    origin: str,
) -> ClipRow:
    """Encode and write one window of an entry unless it is up to date; its table row says which it was.

    `origin` names where the entry came from in its failure line (`manifest line 3`, `file 'a.mp4'`).
    """
    sample_path = out / f"{window.sample_id}{SAMPLE_SUFFIX}"
    inputs_path = out / f"{window.sample_id}{INPUTS_SUFFIX}"
    where = {"clip": entry.sample_id, "start": window.start / FPS, "duration": duration}
    recorded = _up_to_date(sample_path, inputs_path, digest, settings, window.frames)
    if recorded is not None:
        return replace(recorded, outcome="up to date", **where)
    try:
        if entry.video.path.suffix.lower() in IMAGE_SUFFIXES:
            raise NotAClip(
                f"image files are not clips: '{entry.video.relative}' is a still; give a video clip as 'video', "
                "and stills as keyframes or references"
            )
        sample, clip = encode_entry(pipe, entry, settings, window.start, window.frames, window.sample_id)
        write_sample(sample_path, sample)
    except Exception as exc:  # noqa: BLE001 - one bad clip must not stop the run; the reason is recorded
        if no_space(exc) is not None:
            # A full disk is no clip's fault: every later clip would fail alike. Stop, naming the file.
            raise
        # A sample left from older inputs no longer matches the manifest.
        sample_path.unlink(missing_ok=True)
        inputs_path.unlink(missing_ok=True)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0] + _way_out(exc, settings)
        kind = exc.kind if isinstance(exc, MediaError) else type(exc).__name__
        _append_error(out, entry, window.sample_id, reason, kind)
        bar.write(f"h3train encode: {window.sample_id} ({origin}): {reason}", file=sys.stderr)
        return ClipRow(window.sample_id, outcome=f"failed: {kind}", clip=entry.sample_id, duration=duration)
    file = clip.file
    assert file is not None, "load_clip describes the file of every clip"
    height, width = clip.frames.shape[1:3]
    row = ClipRow(
        window.sample_id,
        source=file.describe(),
        canvas=f"{width}x{height}",
        frames=sample.num_frames,
        seconds=sample.num_frames / FPS,
        audio="yes" if sample.has_audio else "none",
        outcome="encoded",
        upscale=max(width / file.width, height / file.height),
        **where,
    )
    # Written after the sample: a run killed in between re-encodes the clip rather than trusting it.
    # `window.clip` names the clip a sample was cut from (`_drop_earlier_windows`).
    record = {
        "digest": digest,
        "inputs": entry.fingerprint(),
        "length": {"slots": file.slots, "complete": file.complete, "frames": sample.num_frames},
        "window": {"clip": entry.sample_id, "start": window.start, "frames": window.frames},
        "row": asdict(row),
    }
    atomic_write_text(inputs_path, json.dumps(record, indent=1) + "\n")
    return row


def _way_out(exc: Exception, settings: EncodeSettings) -> str:
    """The flag that would keep a clip a setting rejected, as the end of its reason ('' if none)."""
    if isinstance(exc, ClipTooShort):
        if exc.shortest > shortest_kept(0):
            return f"; lower --min-seconds (now {settings.min_seconds:g}) to keep it"
        return f"; no setting keeps a clip under {shortest_kept(0)} frames at {FPS} fps"
    return ""


def _up_to_date(
    sample_path: Path, inputs_path: Path, digest: str, settings: EncodeSettings, max_frames: int
) -> ClipRow | None:
    """The recorded row of a sample encoded from these inputs, whose length the current `min_seconds` and
    the window's cap `max_frames` would choose again, and whose bytes are still those written; else None.

    The recorded length is the 24 fps frame count from the window's start (`slots`; all of it when
    `complete`, else decoding stopped at the then cap): the current frame count follows from it without
    decoding, except for a clip cut short before whose cap is now raised.
    """
    try:
        recorded = json.loads(inputs_path.read_text())
        if recorded.get("digest") != digest:
            return None
        length = recorded["length"]
        slots, frames = int(length["slots"]), int(length["frames"])
        if not length["complete"] and max_frames > slots:
            return None
        # The rule that chose the length, on the recorded slots (too short now raises, a ValueError).
        if aligned_frame_count(slots, settings.min_frames, max_frames) != frames:
            return None
        verify_sample(sample_path)
        return ClipRow(**recorded["row"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _prepare_output(out: Path) -> None:
    """Create the folder, drop the temporary files of an interrupted encode, start a fresh `errors.jsonl`.

    Only files named as h3train's atomic writes name their temporaries go (this encode holds the
    folder's lock, so their writer has stopped); the earlier `errors.jsonl` is kept as
    `errors.jsonl.previous` (numbered after the first).
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp"):
        if stale.is_file() and is_temporary(stale):
            stale.unlink(missing_ok=True)
    errors = out / ERRORS_NAME
    if errors.is_file() and errors.stat().st_size > 0:
        set_aside(errors, "previous")
    errors.write_text("")


def _move_between_splits(groups: list[tuple[Path, list[Job]]]) -> None:
    """Move a sample this encoder wrote into the split its clip now belongs to (a changed `--heldout`),
    with its `inputs.json`, so that no clip sits in both datasets and none is encoded twice."""
    for folder, group in groups:
        for _, window in group:
            target = folder / f"{window.sample_id}{SAMPLE_SUFFIX}"
            for other, _ in groups:
                found = other / f"{window.sample_id}{SAMPLE_SUFFIX}"
                inputs = other / f"{window.sample_id}{INPUTS_SUFFIX}"
                if other == folder or not (found.is_file() and inputs.is_file()) or target.exists():
                    continue
                # The sample first: one stopped between the two is re-encoded, never trusted without its record.
                os.replace(found, target)
                os.replace(inputs, folder / inputs.name)


def _drop_earlier_windows(groups: list[tuple[Path, list[Job]]], clips: set[str]) -> int:
    """Remove the samples this encoder cut from a clip of the manifest at windows it no longer cuts (other
    `--windows` settings); return how many. Without this the dataset would hold a span twice.

    Only a sample with its `inputs.json` (the encoder's record) naming one of `clips` goes, the sample
    first: one stopped between the two leaves a record of nothing, which is harmless.
    """
    planned = {window.sample_id for _, group in groups for _, window in group}
    dropped = 0
    for folder, _ in groups:
        for inputs in sorted(folder.glob(f"*{INPUTS_SUFFIX}")):
            sample_id = inputs.name.removesuffix(INPUTS_SUFFIX)
            if sample_id in planned:
                continue
            try:
                record = json.loads(inputs.read_text())
                clip = (record.get("window") or {}).get("clip") or record["inputs"]["id"]
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                continue
            if clip in clips:
                (folder / f"{sample_id}{SAMPLE_SUFFIX}").unlink(missing_ok=True)
                inputs.unlink(missing_ok=True)
                dropped += 1
    return dropped


def _append_error(out: Path, entry: ManifestEntry, sample_id: str, reason: str, kind: str) -> None:
    record = {"id": sample_id, "line": entry.line, "video": entry.video.relative, "kind": kind, "error": reason}
    # One write per line in append mode: ranks appending at once do not interleave within a line.
    with open(out / ERRORS_NAME, "a") as handle:
        handle.write(json.dumps(record) + "\n")
