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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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
    ) -> None:
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
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket_size = bucket_size if bucket_size > 1 else 0
        self.lengths = torch.as_tensor(lengths, dtype=torch.long) if self.bucket_size else None
        self.position = 0
        self._epoch_cache: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        # Two epochs are kept: a prefetching thread may already read the next epoch while the training
        # loop finishes this one. The dict is replaced, never mutated, so a concurrent reader is safe.
        cache = self._epoch_cache
        if epoch not in cache:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples)
            if self.bucket_size:
                order = self._bucket(order)
            cache = {e: o for e, o in cache.items() if abs(e - epoch) <= 1} | {epoch: order}
            self._epoch_cache = cache
        return cache[epoch]

    def _bucket(self, order: torch.Tensor) -> torch.Tensor:
        """Sort each window of `bucket_size` consecutive entries by length; a permutation stays one."""
        windows = []
        for window in order.split(self.bucket_size):
            by_length = torch.sort(self.lengths[window], stable=True).indices
            windows.append(window[by_length])
        return torch.cat(windows)

    def global_index(self, position: int) -> int:
        """The sample at a global position of the (epoch-concatenated) order."""
        epoch, offset = divmod(position, self.num_samples)
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
        self.position = int(state["position"])


def assigned_indices(num_samples: int, dp_rank: int, dp: int) -> list[int | None]:
    """The evaluation items DP group `dp_rank` takes (item `i` goes to group `i % dp`), padded with None.

    Every group gets `ceil(num_samples / dp)` slots: FSDP2's collectives need every rank of the
    sharding group to run the same number of forwards, so a group with fewer items repeats one in a
    None slot without counting it. Shared by the held-out loss and the sample renderer.
    """
    slots = (num_samples + dp - 1) // dp
    return [i if (i := j * dp + dp_rank) < num_samples else None for j in range(slots)]
