"""Which sample each DP rank trains on, resumable at the exact global position.

The global order is a permutation of `range(num_samples)` per epoch, drawn from `(seed, epoch)`.
Each micro-batch consumes `dp_size` consecutive entries of that order: DP rank `r` takes entry
`position + r`. The state is the global position (samples consumed by all DP ranks together), so a
run resumed under another DP size continues the same global order from the same sample. SP ranks
are not part of the arithmetic: every SP rank of a DP group gets the identical index.
"""

from __future__ import annotations

import torch


class DistributedSampler:
    def __init__(self, num_samples: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError("the dataset holds no samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def global_index(self, position: int) -> int:
        """The sample at a global position of the (epoch-concatenated) order."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self._order(epoch)[offset])

    def next_index(self) -> int:
        """This DP rank's sample for the next micro-batch; advances by one micro-batch of all ranks."""
        index = self.global_index(self.position + self.dp_rank)
        self.position += self.dp_size
        return index

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples with seed {state['seed']}, "
                f"this run has {self.num_samples} samples with seed {self.seed}"
            )
        self.position = int(state["position"])
