"""Two renders of one request side by side, each half under a bar that names it: `h3train generate --compare`.

The bar is drawn with numpy from a 5x7 bitmap font of the few letters the labels use, so the output
is the same on every machine and nothing is downloaded. Each half is a render's frames unchanged below
its bar: `halves` gives them back exactly.
"""

from __future__ import annotations

import numpy as np

# 5 columns x 7 rows per glyph, a row per string, '#' lit.
_GLYPHS: dict[str, tuple[str, ...]] = {
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "I": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "#####"),
    "N": ("#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "-": (".....", ".....", ".....", "#####", ".....", ".....", "....."),
    " ": (".....", ".....", ".....", ".....", ".....", ".....", "....."),
}
LABELS = ("BASE", "FINE-TUNE")
# Bar colours (RGB) of the base and the fine-tune half; the text is white.
_BAR_COLOURS = ((40, 40, 40), (20, 60, 120))
# Bar height in pixels per unit of text scale: a 7-row glyph with margins, even for yuv420.
_BAR_UNIT = 16


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """`[7 scale, (6 len - 1) scale]` bool: `text` in the bitmap font, one blank column between letters."""
    columns = []
    for i, char in enumerate(text.upper()):
        if i:
            columns.append(np.zeros((7, 1), dtype=bool))
        columns.append(np.array([[c == "#" for c in row] for row in _GLYPHS[char]], dtype=bool))
    mask = np.concatenate(columns, axis=1)
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def bar_height(width: int) -> int:
    return _BAR_UNIT * _scale(width)


def _scale(width: int) -> int:
    # The longest label fills at most about half the half's width.
    return max(1, width // (2 * 6 * max(map(len, LABELS))))


def label_bar(text: str, width: int, colour: tuple[int, int, int]) -> np.ndarray:
    """`[bar_height(width), width, 3]` uint8: a bar of `colour` with `text` in white, left-aligned."""
    scale = _scale(width)
    bar = np.empty((bar_height(width), width, 3), dtype=np.uint8)
    bar[:] = colour
    mask = text_mask(text, scale)[:, : max(0, width - 4 * scale)]
    top, left = (bar.shape[0] - mask.shape[0]) // 2, 4 * scale
    bar[top : top + mask.shape[0], left : left + mask.shape[1]][mask] = 255
    return bar


def side_by_side(base: np.ndarray, tuned: np.ndarray) -> np.ndarray:
    """`[T, B + H, 2 W, 3]` uint8: `base` `[T, H, W, 3]` left and `tuned` right, each below its labelled bar."""
    if base.shape != tuned.shape:
        raise ValueError(f"the two renders differ in shape: {base.shape} and {tuned.shape}")
    frames, _, width, _ = base.shape
    halves = []
    for clip, text, colour in zip((base, tuned), LABELS, _BAR_COLOURS):
        bar = np.broadcast_to(label_bar(text, width, colour), (frames, bar_height(width), width, 3))
        halves.append(np.concatenate([bar, clip], axis=1))
    return np.concatenate(halves, axis=2)


def halves(composite: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two renders `side_by_side` put together, without their bars."""
    width = composite.shape[2] // 2
    top = bar_height(width)
    return composite[:, top:, :width], composite[:, top:, width:]
