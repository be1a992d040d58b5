"""Which sample each DP rank trains on, resumable at the exact global position.

The global order is a permutation of `range(num_samples)` per epoch, drawn from `(seed, epoch)`.
Each micro-batch consumes `dp_size` consecutive entries of that order: DP rank `r` takes entry
`position + r`. The state is the global position (samples consumed by all DP ranks together), so a
run resumed under another DP size continues the same global order from the same sample. SP ranks
are not part of the arithmetic: every SP rank of a DP group gets the identical index. Within an
epoch the DP ranks of a micro-batch get distinct samples; a micro-batch that straddles an epoch
boundary draws from two permutations and may repeat a sample, the price of an order that does not
depend on `dp_size`.

Optional length bucketing: with per-sample `lengths` and `bucket_size > 1`, each epoch's permutation
is cut into consecutive windows of `bucket_size` entries and each window is sorted by length (ties
keep permutation order). Neighbouring entries, which the DP ranks train on in the same micro-batch,
then have similar packed lengths, so fewer ranks idle at the gradient reduction. The bucketed order
depends only on `(seed, epoch, lengths, bucket_size)`, never on `dp_size`, so resume keeps working.

Several datasets (`parts`): the samples are numbered dataset after dataset, and dataset `d` of `size`
samples is drawn `draws` times per epoch (its repeats times its size, or its weight's share of the
epoch): every sample `draws // size` times, and `draws % size` extras taken in turn from the
dataset's own endless stream of seeded permutations. A dataset drawn less than its size so shows a
different subset each epoch and all of its samples over the epochs; within an epoch a sample is drawn
`draws // size` or one more times (two more only where the extras cross from one permutation to the
next), and over `size` epochs exactly `draws` times. An epoch is the sorted multiset of all datasets'
draws, shuffled by the epoch's permutation as above; with one dataset drawn once per epoch the
multiset is `range(num_samples)` and the order is the plain one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


class DistributedSampler:
    def __init__(
        self,
        num_samples: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        lengths: Sequence[int] | None = None,
        bucket_size: int = 0,
        parts: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """`parts`: `(size, draws per epoch)` of each dataset, in sample order; None is one dataset
        drawn once per epoch. The sizes add up to `num_samples`."""
        if num_samples < 1:
            raise ValueError("the dataset holds no samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if bucket_size < 0:
            raise ValueError(f"bucket_size must be >= 0 (0 or 1: no bucketing), got {bucket_size}")
        if bucket_size > 1 and lengths is None:
            raise ValueError("length bucketing needs the per-sample lengths")
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths given for {num_samples} samples")
        parts = [(num_samples, num_samples)] if parts is None else [(int(n), int(d)) for n, d in parts]
        if sum(n for n, _ in parts) != num_samples or any(n < 1 or d < 1 for n, d in parts):
            raise ValueError(f"dataset parts {parts} do not cover {num_samples} samples, each drawn at least once")
        self.parts = parts
        self.epoch_length = sum(d for _, d in parts)
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket_size = bucket_size if bucket_size > 1 else 0
        # A list, or a cached dataset's `Lengths` (an int64 array, read as one without a Python int per sample).
        self.lengths = torch.from_numpy(np.array(lengths, dtype=np.int64)) if self.bucket_size else None
        self.position = 0
        self._epoch_cache: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        # Two epochs are kept: a prefetching thread may already read the next epoch while the training
        # loop finishes this one. The dict is replaced, never mutated, so a concurrent reader is safe.
        cache = self._epoch_cache
        if epoch not in cache:
            order = self._draws(epoch)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = order[torch.randperm(self.epoch_length, generator=g)]
            if self.bucket_size:
                order = self._bucket(order)
            cache = {e: o for e, o in cache.items() if abs(e - epoch) <= 1} | {epoch: order}
            self._epoch_cache = cache
        return cache[epoch]

    def _draws(self, epoch: int) -> torch.Tensor:
        """The epoch's samples as a sorted multiset of `epoch_length` global indices."""
        pieces, offset = [], 0
        for d, (size, draws) in enumerate(self.parts):
            whole, extra = divmod(draws, size)
            pieces.append(torch.arange(size).repeat(whole) + offset)
            # The extras are entries [epoch * extra, (epoch + 1) * extra) of the dataset's own stream of
            # passes (seeded permutations): over `size` epochs every sample is an extra `extra` times.
            position, stop = epoch * extra, (epoch + 1) * extra
            while position < stop:
                p, into = divmod(position, size)
                take = min(size - into, stop - position)
                pieces.append(self._pass(d, p)[into : into + take] + offset)
                position += take
            offset += size
        return torch.sort(torch.cat(pieces)).values

    def _pass(self, dataset: int, index: int) -> torch.Tensor:
        """Pass `index` of dataset `dataset`'s own stream: a seeded permutation of its local indices."""
        size = self.parts[dataset][0]
        key = hashlib.sha256(f"{self.seed}/{dataset}/{index}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return torch.randperm(size, generator=g)

    def _bucket(self, order: torch.Tensor) -> torch.Tensor:
        """Sort each window of `bucket_size` consecutive entries by length; a permutation stays one."""
        windows = []
        for window in order.split(self.bucket_size):
            by_length = torch.sort(self.lengths[window], stable=True).indices
            windows.append(window[by_length])
        return torch.cat(windows)

    def global_index(self, position: int) -> int:
        """The sample at a global position of the (epoch-concatenated) order."""
        epoch, offset = divmod(position, self.epoch_length)
        return int(self._order(epoch)[offset])

    def next_index(self) -> int:
        """This DP rank's sample for the next micro-batch; advances by one micro-batch of all ranks."""
        index = self.global_index(self.position + self.dp_rank)
        self.position += self.dp_size
        return index

    def iter_indices(self) -> Iterator[int]:
        """This DP rank's indices from the current position on, without advancing the state.

        For a prefetcher that reads ahead: the state then still counts only the samples the training
        loop consumed (it calls `next_index()` per consumed sample), so a checkpoint resumes exactly.
        """
        position = self.position
        while True:
            yield self.global_index(position + self.dp_rank)
            position += self.dp_size

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "bucket_size": self.bucket_size,
            "parts": [list(part) for part in self.parts],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples with seed {state['seed']}, "
                f"this run has {self.num_samples} samples with seed {self.seed}"
            )
        # A different bucketing is a different global order: the position would point elsewhere.
        if state.get("bucket_size", 0) != self.bucket_size:
            raise ValueError(
                f"sampler state is for bucket_size {state.get('bucket_size', 0)}, this run has "
                f"{self.bucket_size}; resume with the same data.bucket_size"
            )
        # Other datasets, weights or repeats draw another order: the position would point elsewhere.
        parts = [tuple(part) for part in state.get("parts", [(self.num_samples, self.num_samples)])]
        if parts != self.parts:
            raise ValueError(
                f"sampler state is for datasets of {_parts_text(parts)}, this run has {_parts_text(self.parts)}; "
                "resume with the same data.path datasets, weights and repeats, or, to train the new data from "
                "this run's weights, export it ('h3train export RUN --out DIR') and start a new run from DIR "
                "(model.pretrained=DIR; a LoRA: lora.init_from=DIR/pytorch_lora_weights.safetensors)"
            )
        self.position = int(state["position"])


def _parts_text(parts: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{size} samples ({draws} draws per epoch)" for size, draws in parts)


def assigned_indices(num_samples: int, dp_rank: int, dp: int) -> list[int | None]:
    """The evaluation items DP group `dp_rank` takes (item `i` goes to group `i % dp`), padded with None.

    Every group gets `ceil(num_samples / dp)` slots: FSDP2's collectives need every rank of the
    sharding group to run the same number of forwards, so a group with fewer items repeats one in a
    None slot without counting it. Shared by the held-out loss and the sample renderer.
    """
    slots = (num_samples + dp - 1) // dp
    return [i if (i := j * dp + dp_rank) < num_samples else None for j in range(slots)]
