"""The released model's clips, in every unit the trainer counts them in: the one source of these facts.

The longest released clip is 15 s at 24 fps (diffusers' `MINIMAX_H3_FPS`) on the 768x1344 canvas:
362 = 17 x 21 + 5 pixel frames, which the VAE encodes to 107 latent frames of 48 x 84 latents (24 x 42
rows a frame after the 2 x 2 patches) and 603 audio latents per channel, under a 2,048-token text
prefix (the prompt and, for FL2VA, the two keyframes' Qwen3-VL vision blocks, 1,024 tokens of it). The
5 s clip on the same canvas is 124 pixel frames: 37 latent frames, 207 audio latents. As FL2VA packs
them (first and last keyframes, 1,008 rows each; stereo audio) they are 113,126 and 41,774 rows.

The synthetic data (`data/synthetic_dataset.py`), the memory plan (`plan/`), the rehearsal, the base-prediction store
and the configs' tests read them here; a test holds them to diffusers' frame rules and layout builders
(`tests/unit/test_released_clips.py`).
"""

from __future__ import annotations

#: The released canvas, pixels (height, width).
CANVAS = (768, 1344)
#: The canvas in latents (height, width): the video VAE's 16x spatial compression.
LATENT_SIZE = (48, 84)

#: Pixel frames of the longest released clip (15 s) and of the 5 s one.
LONGEST_PIXEL_FRAMES = 362
SHORT_PIXEL_FRAMES = 124
#: `(latent frames, latent height, latent width, audio latents per channel)` of each: `tasks.layout.Geometry`'s
#: arguments.
LONGEST_GEOMETRY = (107, *LATENT_SIZE, 603)
SHORT_GEOMETRY = (37, *LATENT_SIZE, 207)

#: The text prefix of both, in rows: the rows the text refiner runs over.
TEXT_ROWS = 2_048
#: Of the prefix, the vision tokens of an FL2VA clip's two keyframes.
VISION_TOKENS = 1_024
#: Rows of the two keyframes of an FL2VA clip on the canvas.
KEYFRAME_ROWS = 2 * 1_008

#: Packed rows of each as FL2VA (first and last keyframes, stereo audio, the text prefix).
LONGEST_ROWS = 113_126
SHORT_ROWS = 41_774
