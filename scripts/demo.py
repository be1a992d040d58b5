"""`make demo`: the whole path on CPU, from media files to a trained tiny H3 and its loss plot.

1. `h3train tiny-components`: a stand-in MiniMax-H3 pipeline folder of tiny random weights (video and
   audio VAEs, Qwen3-VL, tokenizer, processor, both transformers, schedulers, the pipeline index).
2. A handful of short clips made with PyAV (moving squares, most with a tone, one silent, one too short
   on purpose), two stills and a voice track: the plain clips in a folder with a `.txt` caption each
   (t2va), the others in a manifest of fl2va and ref2va clips.
3. `h3train encode` of the folder, and of the manifest under torchrun (2 ranks splitting it).
4. `h3train train` under torchrun, 2 CPU ranks with sp=2, on both datasets (the captioned clips
   drawn twice per epoch, `data.path` with repeats; CFG on), ending by
   rendering one fl2va sample of the trained model (`validation.samples`) at sp=2 into an mp4 with
   its soundtrack, through diffusers' H3 pipeline blocks with the live sharded model.
5. `h3train plot`: loss and grad_norm per step.

Everything is built locally; nothing is downloaded. Re-running reuses the encoded clips.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from h3train.encode.media import moving_pattern, sine_tone, write_audio, write_video  # noqa: E402

OUT = ROOT / "demo_out"
MEDIA = OUT / "media"
STEPS = 40
# The sample rendered after the last step: the first keyframe of one clip, on the training canvas.
SAMPLE = {"id": "dawn", "task": "fl2va", "prompt": "a square drifts over a gradient at dawn, with a steady hum",
          "frames": 22, "resolution": "96x64", "seed": 0}  # fmt: skip
SAMPLE_STEPS = 8

# (file, frames, fps, tone: (Hz, sample rate, channels) or None)
CLIPS = [
    ("orbit.mp4", 40, 30, (440, 44100, 2)),
    ("drift.mp4", 42, 24, (220, 48000, 1)),
    ("chirp.mp4", 30, 25, (660, 32000, 2)),
    ("bounce.mp4", 26, 24, (330, 44100, 2)),
]
# Plain clips with a same-named caption: a folder `h3train encode` takes as it is.
CAPTIONED = [
    ("hover.mp4", 24, 24, None, "a silent square hovers"),
    ("sweep.mp4", 60, 30, (550, 44100, 2), "a square sweeps across with a bright tone"),
    ("blink.mp4", 3, 24, None, "three frames are too short to train on"),
]
CAPTIONED_REPEATS = 2
MANIFEST = [
    {"video": "clips/orbit.mp4", "prompt": "a yellow square orbits a gradient, with a steady hum",
     "task": "fl2va", "keyframes": "both"},
    {"video": "clips/drift.mp4", "prompt": "a square drifts down and to the left over a low tone",
     "task": "fl2va", "keyframes": {"first": None, "last": "stills/dusk.png"}},
    {"video": "clips/chirp.mp4", "prompt": "the pictured square sings in the voice of the reference",
     "task": "ref2va", "references": [{"kind": "image", "path": "stills/dawn.png"},
                                      {"kind": "audio", "path": "audio/voice.wav"}]},
    {"video": "clips/bounce.mp4", "prompt": "the two pictured squares bounce", "task": "ref2va",
     "references": [{"kind": "image", "path": "stills/dawn.png"}, {"kind": "image", "path": "stills/dusk.png"}],
     "negative_prompt": "blurry, static"},
]  # fmt: skip


def run(*args: str) -> None:
    if start(*args).wait():
        raise subprocess.CalledProcessError(1, args)


def start(*args: str) -> subprocess.Popen:
    print("+", " ".join(args), flush=True)
    return subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def torchrun(*args: str) -> None:
    run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "h3train", *args)


def write_clip(path: Path, frames: int, fps: int, tone: tuple[int, int, int] | None, seed: int) -> None:
    if path.exists():
        return
    audio, rate = None, 44100
    if tone is not None:
        hz, rate, channels = tone
        audio = sine_tone(frames / fps, hz, rate, channels)
    write_video(path, moving_pattern(frames, 96, 144, seed), fps, audio, rate)


def write_media() -> Path:
    """The clips, captions, stills, voice track and manifest; returns the manifest.

    Files already there are kept: the encoder recognises unchanged media and skips them.
    """
    for folder in ("clips", "captioned", "stills", "audio"):
        (MEDIA / folder).mkdir(parents=True, exist_ok=True)
    for seed, (name, frames, fps, tone) in enumerate(CLIPS):
        write_clip(MEDIA / "clips" / name, frames, fps, tone, seed)
    for seed, (name, frames, fps, tone, caption) in enumerate(CAPTIONED, start=len(CLIPS)):
        write_clip(MEDIA / "captioned" / name, frames, fps, tone, seed)
        (MEDIA / "captioned" / name).with_suffix(".txt").write_text(caption + "\n")
    for seed, name in ((10, "dawn.png"), (11, "dusk.png")):
        if not (MEDIA / "stills" / name).exists():
            Image.fromarray(moving_pattern(1, 90, 120, seed)[0]).save(MEDIA / "stills" / name)
    if not (MEDIA / "audio" / "voice.wav").exists():
        write_audio(MEDIA / "audio" / "voice.wav", sine_tone(2.0, 300, 32000), 32000)  # at the audio VAE rate
    manifest = MEDIA / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in MANIFEST))
    return manifest


def main() -> int:
    # No options: `--help` prints this docstring rather than starting the multi-minute run.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    began = time.monotonic()
    components, data, captioned, run_dir = OUT / "components", OUT / "data", OUT / "captioned", OUT / "train"
    run(sys.executable, "-m", "h3train", "tiny-components", str(components))
    manifest = write_media()
    # The stand-in's encode preset puts 3:2 clips on a 64x96 canvas (4x6 latents), at most 2 s, no minimum.
    # The folder alongside the manifest's two ranks: the start-up of each overlaps the other's work.
    folder = start(sys.executable, "-m", "h3train", "encode", str(MEDIA / "captioned"), "--components",
                   str(components), "--out", str(captioned))  # fmt: skip
    torchrun("encode", str(manifest), "--components", str(components), "--out", str(data))
    if folder.wait():
        raise subprocess.CalledProcessError(folder.returncode, folder.args)
    # A fresh training run each time; the encoded data above is reused when its inputs are unchanged.
    shutil.rmtree(run_dir, ignore_errors=True)
    sample = {**SAMPLE, "keyframes": {"first": str(MEDIA / "stills" / "dawn.png")}}
    torchrun("train", "configs/tiny_demo.yaml", "parallel.sp=2", f"train.steps={STEPS}",
             f"data.path=[{data}, {{path: {captioned}, repeats: {CAPTIONED_REPEATS}}}]", f"logging.dir={run_dir}",
             f"validation.samples=[{json.dumps(sample)}]", f"validation.components={components}",
             f"validation.sample_every={STEPS}", f"validation.num_inference_steps={SAMPLE_STEPS}")  # fmt: skip
    clip = run_dir / "samples" / f"step_{STEPS}" / f"{SAMPLE['id']}.mp4"
    plot = run_dir / "loss.png"
    run(sys.executable, "-m", "h3train", "plot", str(run_dir / "metrics.jsonl"), "--out", str(plot))

    errors = (captioned / "errors.jsonl").read_text().splitlines()
    print(f"\ndemo finished in {time.monotonic() - began:.0f} s")
    print(f"components: {components}  (a tiny random MiniMax-H3 pipeline folder: encoders, transformers, schedulers)")
    print(f"media:      {MEDIA}  (captioned/ clips with .txt captions; manifest.jsonl, clips/, stills/, audio/)")
    print(f"datasets:   {captioned}  (the captioned folder, drawn {CAPTIONED_REPEATS}x per epoch), {data} (manifest)")
    print(f"rejected:   {captioned / 'errors.jsonl'}  ({len(errors)} clip(s); blink.mp4 is too short on purpose)")
    print(f"metrics:    {run_dir / 'metrics.jsonl'}")
    print(f"plot:       {plot}")
    print(f"config:     {run_dir / 'config.yaml'}")
    print(f"sample:     {clip}  (rendered after step {STEPS} at sp=2, {SAMPLE['frames']} frames with sound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
