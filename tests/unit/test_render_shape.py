"""The shape `h3train generate` renders a run at when no flag says: the canvas and clip length its data had."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.render.requests import latent_shape
from h3train.render.weights import training_shape


@pytest.mark.parametrize(
    ("latent", "frames", "resolution"),
    [
        ((7, 4, 6), 22, "96x64"),  # 5 n + 2 latent frames are 17 n + 5 pixel frames
        ((12, 48, 84), 39, "1344x768"),
        ((2, 4, 6), 22, "96x64"),  # fewer than the decoder takes: its fewest, 22
        ((8, 4, 6), 39, "96x64"),  # between two counts: the next, which holds what was trained
        ((7, 3, 5), 22, "96x64"),  # an odd latent edge rounds up to the 32-pixel canvas multiple
    ],
)
def test_a_latent_shape_is_the_pixel_request_the_pipeline_renders(latent, frames, resolution) -> None:
    assert latent_shape(*latent) == {"frames": frames, "resolution": resolution}


def test_a_synthetic_run_renders_at_its_geometry() -> None:
    saved = {
        "data": {"source": "synthetic", "synthetic": {"num_latent_frames": 2, "latent_height": 4, "latent_width": 6}},
        "task": {"name": "t2va"},
    }
    found = training_shape(saved)
    assert found is not None and found.values == {"frames": 22, "resolution": "96x64"}
    assert "data.synthetic" in found.origin


def test_a_cached_run_renders_at_its_most_common_canvas(tmp_path: Path) -> None:
    # Five t2va samples: three 2 x 4 x 4 latents, two 4 x 6 canvases (one of 7 frames, one of 2).
    data = write_synthetic_dataset(tmp_path / "data", task="t2va", num_samples=5)
    for path in (str(data), [{"path": str(data), "weight": 1}]):
        found = training_shape({"data": {"source": "cached", "path": path}, "task": {"name": "t2va"}})
        assert found is not None and found.values == {"frames": 22, "resolution": "64x64"}, path
        assert "dataset index" in found.origin
    assert training_shape({"data": {"source": "cached", "path": str(tmp_path / "elsewhere")}}) is None
