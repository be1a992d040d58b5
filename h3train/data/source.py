"""Where training samples come from: one interface, built in one place.

A **sample source** is indexable: `len(source)`, `source[i]` -> `TrainingSample`, and `lengths` (the
packed length of every sample, for bucketing and planning, known without reading the samples).
`DATA_SOURCES` holds the kinds `data.source` names, each saying how its samples are made, which sample
tasks it holds (the partition check) and its longest sample (the memory plan, the rehearsal);
`build_source` makes the configured one (several `data.path` datasets are one `DatasetMixture`). The
trainer, the composer, validation and preflight all take theirs from it, and `build_sampler` the
sampler that draws from it.

The loop does not index a source itself: it asks a **micro-batch stream** for micro-batch `micro`
of step `step` (`MicroBatchStream.next`). The indexable stream below draws indices from the
`DistributedSampler`, reads and noises samples on a prefetch thread and checkpoints the sampler's
position. A streaming (iterable) source would come with a stream of its own that keeps the same
three methods (`next`, `state_dict` / `load_state_dict`, `close`) and the loop stays as it is.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from ..config import Config, dataset_specs, register_entry
from ..errors import ConfigError
from ..tasks.sample import TrainingSample
from .prefetch import Prefetcher
from .sampler import DistributedSampler
from .step_composition import StepComposer, StepComposition, StepStats, step_stats
from .storage import dataset_folder, has_index, is_dataset_dir

if TYPE_CHECKING:
    from ..objective import TrainingInputs


logger = logging.getLogger(__name__)


class SampleSource(Protocol):
    """Indexable `TrainingSample`s of one run; sample `i` is the same on every rank that asks."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> TrainingSample: ...

    @property
    def lengths(self) -> Sequence[int]:
        """Packed sequence length of every sample, without reading the sample files (a list, or a
        `Lengths` over an int64 array for a cached dataset: `np.asarray` reads either)."""
        ...


# A source of several datasets (`mixture.DatasetMixture`) also has `parts`: each dataset's
# `(size, draws per epoch)`, which `build_sampler` hands to the sampler.


OnSkip = Callable[[str, str], None]


class DataSource:
    """One `data.source`. Subclass, set `name`, override what differs, register an instance."""

    name: ClassVar[str]
    #: Whether its samples live in folders preflight reads before the run (`data.path`).
    reads_folders: ClassVar[bool] = False

    def check(self, cfg: Config) -> None:
        """What this source refuses in `cfg`, as a one-line `ConfigError` naming the key; before any model."""

    def build(self, cfg: Config, text_dim: int | None, on_skip: OnSkip | None) -> SampleSource:
        """The run's samples; `text_dim` (the model's prompt width) sizes made-up prompts."""
        raise NotImplementedError

    def sample_tasks(self, cfg: Config) -> Counter[str] | None:
        """How many samples of each sample task it holds; None when that cannot be known yet."""
        raise NotImplementedError

    def longest(self, cfg: Config) -> tuple[int, int, str] | None:
        """(packed rows, text rows, where that comes from) of its longest sample; None when its data
        cannot be read here (the plan then assumes the longest released clip)."""
        raise NotImplementedError

    def longest_sample(self, cfg: Config, text_dim: int) -> TrainingSample:
        """The sample `longest` describes."""
        source = self.build(cfg, text_dim, None)
        return source[int(np.argmax(np.asarray(source.lengths)))]


class SyntheticData(DataSource):
    """Random latents and prompts of one configured geometry (`tasks/synthetic.py`), made in memory."""

    name = "synthetic"

    def build(self, cfg: Config, text_dim: int | None, on_skip: OnSkip | None) -> SampleSource:
        if text_dim is None:
            raise ValueError("a synthetic source needs the model's text_dim")
        from ..tasks.synthetic import SyntheticSource

        return SyntheticSource(cfg.data.synthetic, text_dim, cfg.train.seed, cfg.task.name)

    def sample_tasks(self, cfg: Config) -> Counter[str] | None:
        from ..tasks.synthetic import synthetic_anchors
        from ..tasks.table import sample_task_of

        made = sample_task_of("keyframes" if synthetic_anchors(cfg.data.synthetic, cfg.task.name) else None)
        return Counter({made: cfg.data.synthetic.num_samples})

    def longest(self, cfg: Config) -> tuple[int, int, str] | None:
        from ..tasks.layout import Geometry
        from ..tasks.sample import build_layout
        from ..tasks.synthetic import synthetic_anchors
        from ..tasks.table import sample_task_of

        syn = cfg.data.synthetic
        geometry = Geometry(syn.num_latent_frames, syn.latent_height, syn.latent_width, syn.num_audio_latents)
        # The anchors the run's samples carry: none for a task that trains no fl2va samples (t2va).
        anchors = synthetic_anchors(syn, cfg.task.name)
        task = sample_task_of("keyframes" if anchors else None)
        tags = torch.ones(syn.text_len, dtype=torch.long)
        return build_layout(task, tags, geometry, anchors).seq_len, syn.text_len, "synthetic geometry"

    def longest_sample(self, cfg: Config, text_dim: int) -> TrainingSample:
        return self.build(cfg, text_dim, None)[0]  # every sample has the configured geometry


class CachedData(DataSource):
    """Encoded samples in one or more dataset folders (`data.path`, `data/sample_file.py`, `data/dataset_index.py`)."""

    name = "cached"
    reads_folders = True

    def check(self, cfg: Config) -> None:
        specs = dataset_specs(cfg.data)
        if not specs:
            raise ConfigError(
                "config key 'data.path' must name a cached dataset folder (or a list of them) when data.source is "
                "'cached'"
            )
        if cfg.data.create_synthetic and len(specs) > 1:
            raise ConfigError(
                "config key 'data.create_synthetic' writes one dataset: give data.path one folder, "
                "or write each dataset of the list with 'h3train synth'"
            )

    def build(self, cfg: Config, text_dim: int | None, on_skip: OnSkip | None) -> SampleSource:
        from ..debug.faults import corrupt_samples
        from .dataset import CachedDataset

        corrupt = corrupt_samples(cfg.debug.fault)
        specs = dataset_specs(cfg.data)
        datasets = [
            CachedDataset(
                spec.path,
                cfg.task.name,
                on_error=cfg.data.on_error,
                on_skip=on_skip,
                injected_corrupt=corrupt,
                max_rows=cfg.data.max_rows,
            )
            for spec in specs
        ]
        if isinstance(cfg.data.path, str):
            return datasets[0]
        from .mixture import DatasetMixture

        return DatasetMixture(datasets, specs)

    def sample_tasks(self, cfg: Config) -> Counter[str] | None:
        from ..tasks.table import TRAINING_TASKS
        from .dataset import index_entries

        specs = dataset_specs(cfg.data)
        if not specs:
            return None
        tasks: Counter[str] = Counter()
        for spec in specs:
            if not has_index(spec.path):
                if not cfg.data.create_synthetic:
                    return None
                return Counter(dict.fromkeys(TRAINING_TASKS[cfg.task.name].sample_tasks, 1))
            tasks.update(index_entries(dataset_folder(spec.path)).task_counts())
        return tasks

    def longest(self, cfg: Config) -> tuple[int, int, str] | None:
        """The longest sample of the dataset indexes; its text rows from its header (one file read)."""
        from ..errors import DatasetError, SampleError
        from .sample_file import read_header

        specs = dataset_specs(cfg.data)
        if not specs or not all(is_dataset_dir(spec.path) for spec in specs):
            return None
        try:
            source = self.build(cfg, None, None)
            lengths = np.asarray(source.lengths)
        except DatasetError as exc:
            raise ConfigError(f"config key 'data.path': {exc}") from None
        longest = int(np.argmax(lengths))  # the first of the longest, as max() picks
        if hasattr(source, "locate"):  # a mixture: the dataset, then the sample within it
            part, index = source.locate(longest)
            sample = source.datasets[part], index
        else:
            sample = source, longest
        try:
            text_rows = read_header(sample[0].path(sample[1])).specs["text_token_tags"].shape[0]
        except SampleError:  # training skips or reports it (`data.on_error`); the plan assumes a released prefix
            text_rows = None
        name = sample[0].entries[sample[1]].sample_id
        found = "longest sample in the dataset index" + ("es" if len(specs) > 1 else "") + f": '{name}'"
        return int(lengths[longest]), text_rows, found


#: `data.source` -> its kind, in registration order.
DATA_SOURCES: dict[str, DataSource] = {}


def register_data_source(kind: DataSource) -> DataSource:
    """Add `kind` to the table and make its name a choice of `data.source`."""
    return register_entry(DATA_SOURCES, kind, "data source", "data.source")


for _kind in (SyntheticData(), CachedData()):
    register_data_source(_kind)


def data_source(cfg: Config) -> DataSource:
    """The kind `data.source` names."""
    return DATA_SOURCES[cfg.data.source]


#: How many sample ids a left-out line names before it counts the rest.
LEFT_OUT_NAMED = 3


def left_out_lines(cfg: Config) -> list[str]:
    """One line per dataset and sample task that `task.name` leaves out of a cached run, naming the count,
    the first few sample ids and the `task.name` that would train them; none for data not read from
    folders or a dataset without an index here (preflight names that).

    `task.name=fl2va leaves out 3 ref2va samples of dataset '/data/x' ('a', 'b', 'c'); task.name=mixed trains them`
    """
    if not data_source(cfg).reads_folders:
        return []
    from ..tasks.table import TRAINING_TASKS, training_task_for
    from .dataset import index_entries

    accepted = TRAINING_TASKS[cfg.task.name].sample_tasks
    lines = []
    for spec in dataset_specs(cfg.data):
        if not has_index(spec.path):
            continue
        table = index_entries(dataset_folder(spec.path))
        for task, count in sorted(table.task_counts().items()):
            if task in accepted:
                continue
            rows = table.rows_of([task])[:LEFT_OUT_NAMED].tolist()
            named = ", ".join(f"'{table[row].sample_id}'" for row in rows)
            if count > len(rows):
                named += f" and {count - len(rows):,} more"
            wider = training_task_for({*accepted, task})
            lines.append(
                f"task.name={cfg.task.name} leaves out {count:,} {task} sample{'s' if count != 1 else ''} of "
                f"dataset '{spec.path}' ({named}); task.name={wider} trains {'them' if count != 1 else 'it'}"
            )
    return lines


def build_source(
    cfg: Config,
    text_dim: int | None = None,
    on_skip: OnSkip | None = None,
    path: str | None = None,
) -> SampleSource:
    """The source `data.source` names, or the cached dataset at `path` (validation's held-out set).

    `text_dim` (the model's prompt width) sizes synthetic prompts; `on_skip(sample_id, reason)` hears
    every sample `data.on_error=skip` passes over.
    """
    if path is not None:
        from .dataset import CachedDataset

        return CachedDataset(path, cfg.task.name)
    return data_source(cfg).build(cfg, text_dim, on_skip)


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


MakeInputs = Callable[[TrainingSample, int, int], "TrainingInputs"]
"""`make(sample, step, slot)`: the noised inputs of `sample` as micro-batch `slot` of step `step`."""


class MicroBatchStream:
    """Micro-batches of an indexable source in the sampler's order, read and noised ahead of the loop.

    Each step's samples are planned by `composer` (`data/step_composition.py`): the step's window of the global
    order, and which slots of it this DP rank trains in each micro-batch, one sample each or packed.
    A sample's slot in the window and the step seed its noise, so a micro-batch is the same whatever
    the prefetch depth, the rank or the pack it lands in. The checkpointed state is the sampler's
    global position, advanced when a step's last micro-batch is consumed: a checkpoint never skips
    prefetched samples.
    """

    def __init__(
        self,
        source: SampleSource,
        sampler: DistributedSampler,
        make_inputs: MakeInputs,
        composer: StepComposer,
        depth: int,
    ) -> None:
        """`composer` plans the steps of `sampler`'s DP size, `composer.grad_accum` micro-batches a rank."""
        if composer.dp != sampler.dp_size:
            raise ValueError(f"the composer plans for {composer.dp} DP ranks, the sampler draws for {sampler.dp_size}")
        self.source = source
        self.sampler = sampler
        self.make_inputs = make_inputs
        self.composer = composer
        self.grad_accum = composer.grad_accum
        self.depth = max(1, depth)
        self._lengths = source.lengths
        self._prefetcher: Prefetcher | None = None
        self._items: Iterator[tuple[_At, tuple[Any, TrainingInputs]]] | None = None
        self._step_stats: StepStats | None = None
        self._stats_of: tuple[int, int] | None = None

    def _rows_at(self, position: int) -> int:
        return int(self._lengths[self.sampler.global_index(position)])

    def compose(self, start: int) -> StepComposition:
        """The composition of the step that starts at global position `start` (the same on every rank)."""
        return self.composer.compose(start, self._rows_at, self.sampler.global_index, self.sampler.epoch_length)

    def _positions(self, step: int, micro: int) -> Iterator[_At]:
        """Every micro-batch this rank trains from micro-batch `micro` of step `step` on, with its step's plan."""
        start = self.sampler.position
        while True:
            composition = self.compose(start)
            for m in range(micro, self.grad_accum):
                yield _At(step, m, composition)
            start, step, micro = composition.end, step + 1, 0

    def _load(self, at: _At) -> tuple[Any, TrainingInputs]:
        # On the prefetch thread: reading and noising stay off the training thread.
        slots = at.composition.slots(self.sampler.dp_rank, at.micro)
        samples = [self.source[self.sampler.global_index(at.composition.start + slot)] for slot in slots]
        items = [self.make_inputs(sample, at.step, slot) for sample, slot in zip(samples, slots, strict=True)]
        if not self.composer.budget:
            return samples[0], items[0]
        from ..packing import Pack, pack_inputs

        packed = pack_inputs(items, at.composition.largest_micro_batch)
        rows = packed.rows.longest
        if len(samples) > 1 and rows > self.composer.budget:
            # The plan read the index's lengths; a sample `data.on_error=skip` put in place of an
            # unreadable one, or a longer negative prompt, can make the pack longer.
            logger.warning(
                "step %d: the pack of %s holds %d rows, over data.pack=%d",
                at.step,
                "+".join(s.sample_id for s in samples),
                rows,
                self.composer.budget,
            )
        return Pack(tuple(samples)), packed

    def next(self, step: int, micro: int) -> tuple[Any, TrainingInputs]:
        """Micro-batch `micro` (0-based) of optimizer step `step` (1-based): the sample (a `packing.Pack`
        when packing) and its inputs."""
        if self._prefetcher is None:
            # Started lazily, so that it reads from the sampler state a resume has restored.
            self._prefetcher = Prefetcher(self._load, self._positions(step, micro), self.depth)
            self._items = iter(self._prefetcher)
        assert self._items is not None
        at, item = next(self._items)
        assert (at.step, at.micro, at.composition.origin) == (step, micro, self.sampler.position), (
            f"prefetcher delivered micro-batch {at.micro} of step {at.step} at position {at.composition.origin}, the "
            f"training loop expects micro-batch {micro} of step {step} at position {self.sampler.position}"
        )
        if self._stats_of != (step, at.composition.origin):
            self._step_stats = step_stats(self.composer, at.composition, self._rows_at, self.sampler.epoch_length)
            self._stats_of = (step, at.composition.origin)
        if micro == self.grad_accum - 1:
            self.sampler.position = at.composition.end
        return item

    def step_stats(self) -> StepStats:
        """The plan of the step whose micro-batch `next` delivered last (all DP ranks): its samples, whose
        mean the loss is, its packs' fill and its ranks' imbalance."""
        assert self._step_stats is not None, "no micro-batch was delivered yet"
        return self._step_stats

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


class _At(NamedTuple):
    """Micro-batch `micro` of step `step`, in the step's plan."""

    step: int
    micro: int
    composition: StepComposition
