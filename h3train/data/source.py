"""Where training samples come from: one interface, built in one place.

A **sample source** is indexable: `len(source)`, `source[i]` -> `PackedSample`, and `lengths` (the
packed length of every sample, for bucketing and planning, known without reading the samples).
`build_source` makes the one `data.source` names (several `data.path` datasets are one
`DatasetMixture`); the trainer, the planner, validation and preflight all take theirs from it, and
`build_sampler` the sampler that draws from it.

The loop does not index a source itself: it asks a **micro-batch stream** for micro-batch `micro`
of step `step` (`MicroBatchStream.next`). The indexable stream below draws indices from the
`DistributedSampler`, reads and noises samples on a prefetch thread and checkpoints the sampler's
position. A streaming (iterable) source would come with a stream of its own that keeps the same
three methods (`next`, `state_dict` / `load_state_dict`, `close`) and the loop stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..config import Config, dataset_specs
from ..errors import ConfigError
from ..tasks.layout import PackedSample
from .prefetch import MicroBatchPosition, Prefetcher, micro_batch_positions
from .sampler import DistributedSampler

if TYPE_CHECKING:
    from ..objective import TrainingInputs


class SampleSource(Protocol):
    """Indexable `PackedSample`s of one run; sample `i` is the same on every rank that asks."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PackedSample: ...

    @property
    def lengths(self) -> list[int]:
        """Packed sequence length of every sample, without reading the sample files."""
        ...


# A source of several datasets (`mixture.DatasetMixture`) also has `parts`: each dataset's
# `(size, draws per epoch)`, which `build_sampler` hands to the sampler.


def build_source(
    cfg: Config,
    text_dim: int | None = None,
    on_skip: Callable[[str, str], None] | None = None,
    path: str | None = None,
) -> SampleSource:
    """The source `data.source` names, or the cached dataset at `path` (validation's held-out set).

    `text_dim` (the model's prompt width) sizes synthetic prompts; `on_skip(sample_id, reason)` hears
    every sample `data.on_error=skip` passes over.
    """
    if path is None and cfg.data.source == "synthetic":
        if text_dim is None:
            raise ValueError("a synthetic source needs the model's text_dim")
        from ..tasks.synthetic import SyntheticSource

        return SyntheticSource(cfg.data.synthetic, text_dim, cfg.train.seed, cfg.task.name)
    from ..train.faults import FaultInjector
    from .dataset import CachedDataset

    if path is not None:
        return CachedDataset(path, cfg.task.name)
    corrupt = FaultInjector(cfg.debug.fault, rank=0).corrupt_samples()
    specs = dataset_specs(cfg.data)
    datasets = [
        CachedDataset(spec.path, cfg.task.name, on_error=cfg.data.on_error, on_skip=on_skip, injected_corrupt=corrupt)
        for spec in specs
    ]
    if isinstance(cfg.data.path, str):
        return datasets[0]
    from .mixture import DatasetMixture

    return DatasetMixture(datasets, specs)


def build_sampler(source: SampleSource, cfg: Config, dp_rank: int, dp_size: int) -> DistributedSampler:
    """The sampler of `source` for DP rank `dp_rank` of `dp_size` (every SP rank of a DP group builds
    the same one): `data.bucket_size` windows, and a mixture's draws per dataset."""
    return DistributedSampler(
        len(source),
        dp_rank,
        dp_size,
        cfg.train.seed,
        lengths=source.lengths if cfg.data.bucket_size > 1 else None,
        bucket_size=cfg.data.bucket_size,
        parts=getattr(source, "parts", None),
    )


def load_shared_negative(cfg: Config) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`cfg.negative=shared`: one `(negative_prompt_embeds [L, D], negative_text_token_tags [L])` file."""
    if cfg.cfg.negative != "shared":
        return None
    from safetensors.torch import load_file

    path = cfg.cfg.shared_negative_path
    tensors = load_file(path)
    for key in ("negative_prompt_embeds", "negative_text_token_tags"):
        if key not in tensors:
            raise ConfigError(f"config key 'cfg.shared_negative_path': file '{path}' has no tensor '{key}'")
    return tensors["negative_prompt_embeds"].float(), tensors["negative_text_token_tags"].long()


MakeInputs = Callable[[PackedSample, int, int], "TrainingInputs"]
"""`make(sample, step, slot)`: the noised inputs of `sample` as micro-batch `slot` of step `step`."""


class MicroBatchStream:
    """Micro-batches of an indexable source in the sampler's order, read and noised ahead of the loop.

    `slot` (the micro-batch's place in the global batch, `micro * dp + dp_rank`) and `step` seed the
    noise, so a micro-batch is the same whatever the prefetch depth. The checkpointed state is the
    sampler's, which counts consumed samples only: a checkpoint never skips prefetched ones.
    """

    def __init__(
        self,
        source: SampleSource,
        sampler: DistributedSampler,
        make_inputs: MakeInputs,
        grad_accum: int,
        depth: int,
    ) -> None:
        self.source = source
        self.sampler = sampler
        self.make_inputs = make_inputs
        self.grad_accum = grad_accum
        self.depth = max(1, depth)
        self._prefetcher: Prefetcher | None = None
        self._items: Iterator[tuple[MicroBatchPosition, tuple[PackedSample, TrainingInputs]]] | None = None

    def _load(self, at: MicroBatchPosition) -> tuple[PackedSample, TrainingInputs]:
        # On the prefetch thread: reading and noising stay off the training thread.
        sample = self.source[at.index]
        slot = at.micro * self.sampler.dp_size + self.sampler.dp_rank
        return sample, self.make_inputs(sample, at.step, slot)

    def next(self, step: int, micro: int) -> tuple[PackedSample, TrainingInputs]:
        """Micro-batch `micro` (0-based) of optimizer step `step` (1-based): the sample and its inputs."""
        if self._prefetcher is None:
            # Started lazily, so that it reads from the sampler state a resume has restored.
            positions = micro_batch_positions(self.sampler.iter_indices(), step, micro, self.grad_accum)
            self._prefetcher = Prefetcher(self._load, positions, self.depth)
            self._items = iter(self._prefetcher)
        assert self._items is not None
        at, item = next(self._items)
        expected = MicroBatchPosition(self.sampler.next_index(), step, micro)
        assert at == expected, f"prefetcher delivered {at}, the training loop expects {expected}"
        return item

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
