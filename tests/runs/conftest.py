"""Fixtures the multi-rank step tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3train.data.synthetic_dataset import write_synthetic_dataset


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> Path:
    """16 synthetic samples of every sample task (fl2va and ref2va alternating, two t2va), some silent: the
    DP ranks of a step get different tasks, lengths and timesteps."""
    return write_synthetic_dataset(tmp_path_factory.mktemp("mixed") / "data", "mixed", 16, text_dim=16)
