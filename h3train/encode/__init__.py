"""Stage-1 encoding: media files and prompts -> cached samples, with diffusers' own pipeline blocks.

Per clip (`encode_entry`):

    target video  [T, H, W, 3] uint8, T = 17 n + 5 at 24 fps  -> video_latents [24, 5 n + 2, H/16, W/16]
                  the video VAE's posterior mean, ImageNet-normalized pixels in, latents normalized by
                  the VAE's `latents_mean` / `latents_std` (the inverse of `MiniMaxH3VideoDecodeStep`)
    target audio  [2, N] at 32 kHz                           -> audio_latents [2, 32, round(T / 24 * 40)]
                  as `MiniMaxH3Ref2VAReferenceEncoderStep` encodes a soundtrack (posterior mean,
                  normalized); zeros and `has_audio = False` for a clip without an audio track
    fl2va         `MiniMaxH3ResizeStep` puts the keyframes on the canvas, `MiniMaxH3KeyframeVaeEncoderStep`
                  encodes them (`encode_vae_condition`), `MiniMaxH3FL2VATextEncoderStep` presents them
    ref2va        `MiniMaxH3Ref2VASetupStep` normalizes the references, `MiniMaxH3Ref2VAReferenceEncoderStep`
                  encodes them, `MiniMaxH3Ref2VATextEncoderStep` presents them
    t2va          `MiniMaxH3TextEncoderStep`
    negatives     the negative prompt through `MiniMaxH3TextEncoderStep` (text only) and through the task's
                  own text step with the same vision blocks (`negative_visual_*`; for t2va the two agree)

The blocks run on a `MiniMaxH3ModularPipeline` holding the loaded components, so the canvas rules,
the prompt presentations (labels, vision blocks tagged 0) and the conditioning recipes are the
pipeline's, not a copy of them.

References reach the pipeline at their own rates (`MiniMaxH3AudioReference.from_file`, a video
reference's frames at their fps and its soundtrack at its own sample rate), so the setup step's
`_normalize_audio_condition` / `_normalize_video_condition` run as at inference. Resampling a
soundtrack that is not at the audio VAE's 32 kHz needs torchaudio there; without it the clip is
recorded in `errors.jsonl` rather than resampled another way.

`Windowing` (`windows.py`) says which spans of a clip become samples: its first window (the default),
windows spread evenly over it, or windows at a stride; each window is a sample of its own, decoded from
its first frame on (`load_clip`'s `start`), and a held-out clip keeps all its windows out of training.

`encode_manifest` runs a whole manifest, alone or under torchrun (`accelerate.PartialState` splits the
manifest into contiguous shares and gathers the counts): a sample already written from the same inputs
and settings is skipped (`<id>.inputs.json` beside it holds the digest), a failing clip is appended to
`errors.jsonl` and the run goes on, samples are written atomically, and `index.jsonl` is rebuilt at the end.
"""

from __future__ import annotations

from .clip import (
    CANVAS_MULTIPLE,
    ENCODER_VERSION,
    EncodeSettings,
    EncodingPipeline,
    audio_rows_to_latents,
    build_pipeline,
    encode_audio_latents,
    encode_entry,
    encode_video_latents,
    torchaudio_available,
)
from .manifest_run import (
    ERRORS_NAME,
    HELDOUT_NAME,
    INPUTS_SUFFIX,
    TABLE_NAME,
    ClipRow,
    EncodeSummary,
    default_device,
    encode_manifest,
    input_digest,
    split_heldout,
    write_table,
)
from .windows import WINDOW_MODES, ClipPlan, Window, Windowing, footage_used, plan_clips, window_id

__all__ = [
    "ENCODER_VERSION",
    "CANVAS_MULTIPLE",
    "EncodeSettings",
    "EncodingPipeline",
    "build_pipeline",
    "encode_video_latents",
    "audio_rows_to_latents",
    "encode_audio_latents",
    "torchaudio_available",
    "encode_entry",
    "ERRORS_NAME",
    "INPUTS_SUFFIX",
    "TABLE_NAME",
    "HELDOUT_NAME",
    "ClipRow",
    "write_table",
    "EncodeSummary",
    "input_digest",
    "split_heldout",
    "default_device",
    "encode_manifest",
    "ClipPlan",
    "plan_clips",
    "footage_used",
    "WINDOW_MODES",
    "Window",
    "Windowing",
    "window_id",
]
