"""Sampler (DP/SP assignment, resume, bucketing), prefetcher, and the cached dataset on synthetic data."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import read_index, write_index
from h3train.data.prefetch import Prefetcher
from h3train.data.sampler import DistributedSampler
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import DatasetError, SampleError

N = 23  # not a multiple of any DP size used here, so epochs straddle micro-batches


def _samplers(dp_size: int, **kwargs: object) -> list[DistributedSampler]:
    return [DistributedSampler(N, rank, dp_size, seed=5, **kwargs) for rank in range(dp_size)]


def _global_order(length: int, **kwargs: object) -> list[int]:
    reference = DistributedSampler(N, 0, 1, seed=5, **kwargs)
    return [reference.next_index() for _ in range(length)]


def _interleave(samplers: list[DistributedSampler], micro_batches: int) -> list[int]:
    """The samples of `micro_batches` micro-batches, in global order (rank 0 first in each)."""
    return [s.next_index() for _ in range(micro_batches) for s in samplers]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_get_disjoint_samples_per_micro_batch(dp_size: int) -> None:
    ranks = _samplers(dp_size)
    for step in range(3 * N):
        batch = [s.next_index() for s in ranks]
        first, last = step * dp_size, (step + 1) * dp_size - 1
        # A micro-batch straddling an epoch boundary draws from two permutations and may repeat one.
        if first // N == last // N:
            assert len(set(batch)) == dp_size


def test_one_epoch_of_all_ranks_is_a_permutation() -> None:
    order = _global_order(2 * N)
    assert sorted(order[:N]) == list(range(N)) and sorted(order[N:]) == list(range(N))
    assert order[:N] != order[N:]  # a new permutation per epoch


def test_sp_ranks_of_a_dp_group_get_identical_indices() -> None:
    # Every SP rank builds its sampler from its DP coordinates only.
    sp_ranks = [DistributedSampler(N, 1, 3, seed=5) for _ in range(4)]
    streams = [[s.next_index() for _ in range(30)] for s in sp_ranks]
    assert all(stream == streams[0] for stream in streams)


def test_interleaved_ranks_follow_the_global_order() -> None:
    assert _interleave(_samplers(4), 10) == _global_order(40)


def test_exact_resume_from_state_dict() -> None:
    ranks = _samplers(2)
    _interleave(ranks, 7)
    states = [s.state_dict() for s in ranks]
    expected = _interleave(ranks, 9)
    resumed = _samplers(2)
    for sampler, state in zip(resumed, states):
        sampler.load_state_dict(state)
    assert _interleave(resumed, 9) == expected


def test_resume_under_another_dp_size_continues_the_global_order() -> None:
    ranks = _samplers(4)
    seen = _interleave(ranks, 3)
    state = ranks[0].state_dict()
    assert state["position"] == 12
    smaller = _samplers(2)
    for sampler in smaller:
        sampler.load_state_dict(state)
    assert seen + _interleave(smaller, 10) == _global_order(32)


def test_state_from_another_dataset_or_bucketing_is_refused() -> None:
    state = DistributedSampler(N, 0, 1, seed=5).state_dict()
    with pytest.raises(ValueError, match="samples with seed"):
        DistributedSampler(N + 1, 0, 1, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedSampler(N, 0, 1, seed=5, lengths=list(range(N)), bucket_size=4).load_state_dict(state)


def test_iter_indices_reads_ahead_without_advancing() -> None:
    sampler = DistributedSampler(N, 1, 2, seed=5)
    sampler.next_index()
    ahead = list(itertools.islice(sampler.iter_indices(), 30))
    assert sampler.position == 2
    assert ahead == [sampler.next_index() for _ in range(30)]


LENGTHS = [(i * 37) % 101 for i in range(N)]


def test_bucketing_keeps_a_permutation_and_sorts_each_window() -> None:
    plain = _global_order(N)
    bucketed = _global_order(2 * N, lengths=LENGTHS, bucket_size=8)
    for epoch in (bucketed[:N], bucketed[N:]):
        assert sorted(epoch) == list(range(N))
    for start in range(0, N, 8):
        window = bucketed[start : min(start + 8, N)]
        assert sorted(window) == sorted(plain[start : start + 8])  # same members as the window
        assert [LENGTHS[i] for i in window] == sorted(LENGTHS[i] for i in window)
    assert bucketed[:N] != plain


def test_bucketed_order_is_independent_of_dp_size_and_resumes() -> None:
    kwargs = {"lengths": LENGTHS, "bucket_size": 6}
    ranks = _samplers(4, **kwargs)
    seen = _interleave(ranks, 4)
    smaller = _samplers(2, **kwargs)
    for sampler in smaller:
        sampler.load_state_dict(ranks[0].state_dict())
    assert seen + _interleave(smaller, 15) == _global_order(46, **kwargs)


def test_bucketing_needs_matching_lengths() -> None:
    with pytest.raises(ValueError, match="needs the per-sample lengths"):
        DistributedSampler(N, 0, 1, seed=0, bucket_size=4)
    with pytest.raises(ValueError, match="lengths given"):
        DistributedSampler(N, 0, 1, seed=0, lengths=[1, 2], bucket_size=4)


# --------------------------------------------------------------------------------------------------
# Prefetcher


def test_prefetcher_yields_in_order_and_reads_at_most_depth_ahead() -> None:
    loaded: list[int] = []

    def load(i: int) -> int:
        loaded.append(i)
        return i * i

    with Prefetcher(load, range(10), depth=2) as prefetch:
        first = next(prefetch)
        time.sleep(0.2)
        # One handed out, `depth` queued, at most one more blocked on the full queue.
        assert len(loaded) <= 1 + 2 + 1
        rest = list(prefetch)
    assert [first, *rest] == [(i, i * i) for i in range(10)]


def test_prefetcher_keeps_depth_loads_in_flight_at_once() -> None:
    # Each load waits until `depth` loads have started: one loader at a time would time out here.
    depth = 3
    started = threading.Barrier(depth, timeout=10)

    def load(i: int) -> int:
        if i < depth:
            started.wait()
        return i

    with Prefetcher(load, range(8), depth=depth) as prefetch:
        assert list(prefetch) == [(i, i) for i in range(8)]


def test_prefetcher_hands_out_in_order_whatever_order_the_loads_end() -> None:
    def load(i: int) -> int:
        time.sleep(0.05 * (4 - i % 4))
        return i

    with Prefetcher(load, range(9), depth=4) as prefetch:
        assert [i for i, _ in prefetch] == list(range(9))


def test_prefetcher_accepts_an_indexable_source() -> None:
    with Prefetcher(["a", "b", "c"], [2, 0, 1], depth=1) as prefetch:
        assert list(prefetch) == [(2, "c"), (0, "a"), (1, "b")]


def test_prefetcher_reraises_the_loading_error_in_the_consumer() -> None:
    def load(i: int) -> int:
        if i == 3:
            raise SampleError(f"sample '{i}.safetensors': field 'video_latents' is missing")
        return i

    prefetch = Prefetcher(load, range(10), depth=4)
    assert [next(prefetch) for _ in range(3)] == [(0, 0), (1, 1), (2, 2)]
    with pytest.raises(SampleError, match="'3.safetensors'"):
        next(prefetch)
    with pytest.raises(StopIteration):
        next(prefetch)


def test_prefetcher_raises_a_failing_index_after_the_loads_before_it() -> None:
    def indices():
        yield from range(3)
        raise SampleError("the plan of step 4 cannot be made")

    prefetch = Prefetcher(lambda i: i, indices(), depth=4)
    assert [next(prefetch) for _ in range(3)] == [(0, 0), (1, 1), (2, 2)]
    with pytest.raises(SampleError, match="step 4"):
        next(prefetch)


def test_prefetcher_close_stops_the_thread() -> None:
    prefetch = Prefetcher(lambda i: i, itertools.count(), depth=2, name="close-test")
    assert next(prefetch) == (0, 0)
    prefetch.close()
    assert not any(t.name.startswith("close-test") for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(prefetch)


# --------------------------------------------------------------------------------------------------
# CachedDataset on a synthetic dataset


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mixed")
    write_synthetic_dataset(folder, task="mixed", num_samples=24, seed=11, text_dim=8)
    return folder


def test_every_synthetic_sample_loads_and_matches_the_index(mixed_dataset: Path) -> None:
    dataset = CachedDataset(mixed_dataset, "mixed")
    assert len(dataset) == 24
    kinds = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample.layout.seq_len == dataset.lengths[i]
        assert sample.video_rows.dtype == torch.float32 and sample.video_rows.shape[1] == 96
        kinds |= {(sample.task, sample.keyframe_anchors, sample.has_audio)}
        kinds |= {("ref", r.kind, r.has_audio) for r in sample.references}
    assert {("ref", "image", False), ("ref", "video", True), ("ref", "video", False), ("ref", "audio", True)} <= kinds
    for anchors in [("first",), ("last",), ("first", "last")]:
        assert any(k[:2] == ("fl2va", anchors) for k in kinds)
    assert any(k[0] == "t2va" for k in kinds) and any(k[2] is False for k in kinds if k[0] != "ref")


def test_task_filters(mixed_dataset: Path) -> None:
    fl2va, ref2va = CachedDataset(mixed_dataset, "fl2va"), CachedDataset(mixed_dataset, "ref2va")
    assert {e.task for e in fl2va.entries} == {"t2va", "fl2va"}
    assert {e.task for e in ref2va.entries} == {"ref2va"}
    assert len(fl2va) + len(ref2va) == 24


def test_synthetic_writer_is_deterministic_and_refuses_to_mix(mixed_dataset: Path, tmp_path: Path) -> None:
    write_synthetic_dataset(tmp_path, task="mixed", num_samples=3, seed=11, text_dim=8)
    for name in ("synth-000000.safetensors", "synth-000002.safetensors"):
        assert (tmp_path / name).read_bytes() == (mixed_dataset / name).read_bytes()
    with pytest.raises(DatasetError, match="already holds"):
        write_synthetic_dataset(tmp_path, task="ref2va", num_samples=2, seed=0, text_dim=8)
    write_synthetic_dataset(tmp_path, task="ref2va", num_samples=2, seed=0, text_dim=8, overwrite=True)
    assert {e.task for e in read_index(tmp_path)} == {"ref2va"} and len(read_index(tmp_path)) == 2


def test_missing_folder_or_index_or_task_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"dataset folder '{tmp_path / 'nope'}' does not exist"):
        CachedDataset(tmp_path / "nope", "mixed")
    with pytest.raises(DatasetError, match="has no index.jsonl"):
        CachedDataset(tmp_path, "mixed")
    write_synthetic_dataset(tmp_path, task="fl2va", num_samples=2, seed=0, text_dim=8)
    with pytest.raises(DatasetError, match="no samples for task 'ref2va'") as info:
        CachedDataset(tmp_path, "ref2va")
    assert "\n" not in str(info.value)


def test_stale_index_and_on_error_skip(tmp_path: Path) -> None:
    write_synthetic_dataset(tmp_path, task="ref2va", num_samples=4, seed=0, text_dim=8)
    (tmp_path / "synth-000001.safetensors").write_bytes(b"torn")
    strict = CachedDataset(tmp_path, "ref2va")
    with pytest.raises(SampleError, match="synth-000001"):
        strict[1]
    lenient = CachedDataset(tmp_path, "ref2va", on_error="skip")
    assert lenient[1].sample_id == "synth-000002"  # the next loadable sample, the same on every rank
    assert lenient[0].sample_id == "synth-000000"

    (tmp_path / "synth-000001.safetensors").unlink()
    (tmp_path / "synth-000003.safetensors").rename(tmp_path / "synth-000001.safetensors")
    with pytest.raises(SampleError, match="rebuild the index"):
        strict[1]
    write_index(tmp_path)
    assert len(CachedDataset(tmp_path, "ref2va")) == 3


def test_prefetched_training_loop_resumes_exactly(mixed_dataset: Path) -> None:
    """The documented loop: prefetch from `iter_indices()`, advance with `next_index()` per consumed sample."""
    dataset = CachedDataset(mixed_dataset, "mixed")

    def run(sampler: DistributedSampler, steps: int) -> list[str]:
        ids = []
        with Prefetcher(dataset, sampler.iter_indices(), depth=3) as prefetch:
            for _ in range(steps):
                index, sample = next(prefetch)
                assert index == sampler.next_index()
                ids.append(sample.sample_id)
        return ids

    sampler = DistributedSampler(len(dataset), 0, 1, seed=2, lengths=dataset.lengths, bucket_size=4)
    first = run(sampler, 5)
    resumed = DistributedSampler(len(dataset), 0, 1, seed=2, lengths=dataset.lengths, bucket_size=4)
    resumed.load_state_dict(sampler.state_dict())
    reference = DistributedSampler(len(dataset), 0, 1, seed=2, lengths=dataset.lengths, bucket_size=4)
    assert first + run(resumed, 5) == run(reference, 10)


def test_trainer_noises_micro_batches_on_the_prefetch_thread(tmp_path: Path, monkeypatch) -> None:
    """`micro_batch_inputs` runs on the prefetch thread with the (step, slot) the loop trains them as."""
    from h3train.config import load_config
    from h3train.run import assemble as trainer_module

    from helpers.launch import tiny_overrides
    from helpers.paths import TINY_FL2VA

    calls: list[tuple[str, int, int, str]] = []
    build = trainer_module.micro_batch_inputs

    def recording(cfg, sample, step, slot, shared_negative=None):
        calls.append((threading.current_thread().name, step, slot, sample.sample_id))
        return build(cfg, sample, step, slot, shared_negative)

    monkeypatch.setattr(trainer_module, "micro_batch_inputs", recording)
    cfg = load_config(
        TINY_FL2VA,
        tiny_overrides(tmp_path, "train.steps=2", "train.grad_accum=2", "checkpoint.every=0", "data.prefetch=1"),
    )
    order = [(1, 0), (1, 1), (2, 0), (2, 1)]
    trainer = trainer_module.build_trainer(cfg, hooks=[])
    try:
        consumed = [trainer.parts.batches.next(step, micro) for step, micro in order]
    finally:
        trainer.close()
    trained = [(step, micro, sample.sample_id) for (step, micro), (sample, _) in zip(order, consumed)]
    assert {name for name, *_ in calls} == {"prefetch"}
    # One rank (dp = 1): slot = micro. The prefetcher may have read ahead of the consumed four.
    assert [(step, slot, sample_id) for _, step, slot, sample_id in calls[:4]] == trained
    for (step, micro, _), (sample, ti) in zip(trained, consumed):
        again = build(cfg, sample, step, micro)
        assert torch.equal(again.model_inputs["hidden_states"], ti.model_inputs["hidden_states"])
