"""TensorBoard (`logging.tensorboard`), best effort: event files in `<logging.dir>/tensorboard`.

The same numbers as `metrics.jsonl`, under its keys, and the rendered clips: a resumed run hides
the earlier events of the steps it redoes (TensorBoard's `purge_step`). A failure warns once and
turns TensorBoard off for the run.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .record import scalars, training_record, validation_record
from .sink import MetricSink, failure_reason

# `logging.tensorboard`'s event files, under `logging.dir`.
TENSORBOARD_DIR = "tensorboard"
# Rendered clips go to TensorBoard as GIFs no longer than this on their long edge (pixels).
_TENSORBOARD_GIF_EDGE = 320


class TensorBoardSink(MetricSink):
    """Rank 0's TensorBoard writer, when `enabled`; `metrics_path` is the JSONL a warning names."""

    def __init__(self, log_dir: Path, enabled: bool, metrics_path: Path) -> None:
        self.folder = log_dir / TENSORBOARD_DIR
        self.enabled = enabled
        self.metrics_path = metrics_path
        self._board: _TensorBoard | None = None

    def open(self, start_step: int) -> None:
        if self.enabled:
            self._guarded("start", self._open_board, start_step)

    def _open_board(self, start_step: int) -> None:
        self._board = _TensorBoard(self.folder, start_step)

    def _guarded(self, what: str, action: Callable[..., None], *args: Any) -> None:
        """`action(*args)` (a TensorBoard write); a failure warns once and turns TensorBoard off."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
            board, self._board = self._board, None
            if board is not None:
                with contextlib.suppress(Exception):
                    board.close()
            warnings.warn(
                f"TensorBoard failed to {what} ({failure_reason(exc)}); TensorBoard logging is off for this run, "
                f"metrics continue in {self.metrics_path}",
                RuntimeWarning,
                stacklevel=4,
            )

    def _scalars(self, record: dict[str, Any]) -> None:
        if self._board is not None:
            self._guarded("log", self._board.scalars, record["step"], scalars(record))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        self._scalars(training_record(step, values))

    def log_validation(self, step: int, values: Mapping[str, Any]) -> None:
        self._scalars(validation_record(step, values))

    def log_videos(self, step: int, videos: Mapping[str, tuple[Path, str]]) -> None:
        """Each clip as an animated GIF (at most 320 pixels on its long edge, every frame at the clip's
        rate), its soundtrack (mono) as `samples/<name>/audio` and its prompt as text `samples/<name>/prompt`."""
        for name, (path, text) in videos.items():
            # Checked per clip: a failed one turns TensorBoard off.
            if self._board is not None:
                self._guarded(f"log clip '{path}'", self._board.clip, step, name, Path(path), text)

    def close(self, failed: bool = False) -> None:
        if self._board is not None:
            board, self._board = self._board, None
            self._guarded("close", board.close)


class _TensorBoard:
    """TensorBoard event files in one folder (`torch.utils.tensorboard`, the `tensorboard` package).

    Scalars are written under the keys of `metrics.jsonl`; a clip as the GIF image summary that
    TensorBoard's own video summary writes, encoded here with Pillow (torch's `add_video` needs
    moviepy).
    """

    def __init__(self, folder: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            missing = f"logging.tensorboard needs the tensorboard package: pip install tensorboard ({exc})"
            raise ImportError(missing) from exc

        # A resumed run redoes the steps after `start_step`: TensorBoard hides what earlier event
        # files hold for them, as the steps' earlier rows leave `metrics.jsonl`.
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(str(folder), purge_step=purge, flush_secs=10)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def clip(self, step: int, name: str, path: Path, caption: str) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        from ...encode.media import load_video

        video = load_video(path)
        gif, height, width = _gif(video.frames, video.fps)
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=f"samples/{name}", image=image)]), step)
        if video.audio is not None and video.sample_rate:
            mono = video.audio.float().mean(0, keepdim=True).clamp(-1.0, 1.0)
            self.writer.add_audio(f"samples/{name}/audio", mono, step, sample_rate=video.sample_rate)
        self.writer.add_text(f"samples/{name}/prompt", caption, step)

    def close(self) -> None:
        self.writer.close()


def _gif(frames: np.ndarray, fps: float) -> tuple[bytes, int, int]:
    """Frames `[T, H, W, 3]` uint8 as a looping GIF at most `_TENSORBOARD_GIF_EDGE` on its long edge: (bytes, h, w)."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    scale = min(1.0, _TENSORBOARD_GIF_EDGE / max(images[0].size))
    size = (max(1, round(images[0].width * scale)), max(1, round(images[0].height * scale)))
    images = [image.resize(size, Image.Resampling.BILINEAR) for image in images]
    out = io.BytesIO()
    # GIF delays are whole hundredths of a second.
    delay = max(20, 10 * round(100 / max(fps, 1e-3)))
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=delay, loop=0)
    return out.getvalue(), size[1], size[0]
