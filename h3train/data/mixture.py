"""Several cached datasets as one sample source, each drawn by its weight or repeats.

Samples are numbered dataset after dataset in `data.path` order: sample `i` of the mixture is sample
`i - offset[d]` of dataset `d`. How often an epoch draws each dataset (`parts`, `(size, draws)` per
dataset) is decided here once, from the sizes and the config, and handed to the one
`DistributedSampler`, which keeps the order resumable and the same on every DP and SP rank.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import numpy as np

from ..config import DatasetSpec
from ..errors import ConfigError
from ..tasks.sample import TrainingSample
from .dataset import CachedDataset
from .index_table import Lengths

# The sampler holds an epoch's order in memory (8 bytes a draw, two epochs at a time).
MAX_EPOCH_DRAWS = 100_000_000


def dataset_key(specs: Sequence[DatasetSpec], i: int) -> str:
    """The config key naming dataset `i`: `data.path` for a single folder, `data.path[i]` in a list."""
    return "data.path" if len(specs) == 1 else f"data.path[{i}]"


def epoch_draws(sizes: Sequence[int], specs: Sequence[DatasetSpec]) -> list[int]:
    """Draws per epoch of each dataset of `sizes` samples.

    Repeats: `repeats * size`. Weights: an epoch draws `sum(sizes)` samples, split by the weights
    with the largest-remainder rule (ties to the earlier dataset), so the counts add up exactly and
    differ from the exact shares by less than one. A weight whose share is under one draw is refused.
    """
    if all(spec.weight is None for spec in specs):
        draws = [size * spec.repeats for size, spec in zip(sizes, specs, strict=True)]
        if sum(draws) > MAX_EPOCH_DRAWS:
            d = max(range(len(specs)), key=lambda i: draws[i])
            raise ConfigError(
                f"config key '{dataset_key(specs, d)}.repeats' makes an epoch of {sum(draws):,} draws, more than the "
                f"sampler holds ({MAX_EPOCH_DRAWS:,}); lower the repeats, or weight the datasets instead"
            )
        return draws
    # `dataset_specs` gives every dataset of a weighted list a weight.
    weights = [float(spec.weight) for spec in specs]  # type: ignore[arg-type]
    total = sum(sizes)
    shares = [total * w / sum(weights) for w in weights]
    draws = [int(share) for share in shares]
    by_remainder = sorted(range(len(specs)), key=lambda d: (-(shares[d] - draws[d]), d))
    for d in by_remainder[: total - sum(draws)]:
        draws[d] += 1
    for d, count in enumerate(draws):
        if count < 1:
            raise ConfigError(
                f"config key '{dataset_key(specs, d)}.weight' gives dataset '{specs[d].path}' {shares[d]:.2f} of the "
                f"{total} draws of an epoch, less than one sample; raise its weight"
            )
    return draws


def describe_parts(specs: Sequence[DatasetSpec], parts: Sequence[tuple[int, int]]) -> str:
    """One line for the run's start: each dataset's samples, draws per epoch, and what set them."""
    epoch = sum(draws for _, draws in parts)
    items = []
    for spec, (size, draws) in zip(specs, parts, strict=True):
        by = f"weight {spec.weight:g}" if spec.weight is not None else f"repeats {spec.repeats}"
        items.append(f"'{spec.path}' {size} samples x {draws / size:.3g} = {draws} ({by}, {draws / epoch:.1%})")
    return f"data: {len(parts)} datasets, {epoch} draws per epoch: " + "; ".join(items)


class DatasetMixture:
    """Indexable `TrainingSample`s of several `CachedDataset`s, numbered one dataset after the other.

    `parts` gives the sampler each dataset's `(size, draws per epoch)`.
    """

    def __init__(self, datasets: Sequence[CachedDataset], specs: Sequence[DatasetSpec]) -> None:
        if len(datasets) != len(specs) or not datasets:
            raise ValueError(f"{len(datasets)} datasets for {len(specs)} specs")
        self.datasets = list(datasets)
        self.specs = list(specs)
        sizes = [len(d) for d in self.datasets]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.parts = list(zip(sizes, epoch_draws(sizes, self.specs), strict=True))

    def __len__(self) -> int:
        return sum(size for size, _ in self.parts)

    @functools.cached_property
    def lengths(self) -> Lengths:
        return Lengths(np.concatenate([np.asarray(dataset.lengths) for dataset in self.datasets]))

    def locate(self, index: int) -> tuple[int, int]:
        """Mixture sample `index` -> (dataset, index within it)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside [0, {len(self)})")
        d = bisect.bisect_right(self.offsets, index) - 1
        return d, index - self.offsets[d]

    def __getitem__(self, index: int) -> TrainingSample:
        d, local = self.locate(index)
        return self.datasets[d][local]

    def describe(self) -> str:
        return describe_parts(self.specs, self.parts)
