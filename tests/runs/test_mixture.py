"""Several datasets in `data.path`: weights and repeats, the sampler's epochs, the config, a run."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import pytest

from h3train.cli import main
from h3train.config import DatasetSpec, dataset_specs, load_config
from h3train.data.mixture import DatasetMixture, epoch_draws
from h3train.data.sampler import DistributedSampler
from h3train.data.source import build_sampler, build_source
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import ConfigError

from helpers.launch import read_metrics, tiny_args
from helpers.paths import ROOT
from helpers.reference import parity_step

TOL = 1e-5
TINY_REF2VA = ROOT / "configs" / "tiny_ref2va.yaml"
PARTS = [(8, 18), (5, 2), (3, 9)]  # oversampled, undersampled, oversampled by a fraction
N = sum(size for size, _ in PARTS)
EPOCH = sum(draws for _, draws in PARTS)


def _sampler(rank: int = 0, dp: int = 1, parts=PARTS, **kwargs: object) -> DistributedSampler:
    return DistributedSampler(sum(size for size, _ in parts), rank, dp, seed=7, parts=parts, **kwargs)


def _dataset_of(index: int, parts=PARTS) -> int:
    offsets = list(itertools.accumulate(size for size, _ in parts))
    return next(d for d, end in enumerate(offsets) if index < end)


def _global(length: int, **kwargs: object) -> list[int]:
    one = _sampler(**kwargs)
    return [one.next_index() for _ in range(length)]


# -- the sampler ----------------------------------------------------------------------------------


def test_each_epoch_draws_every_dataset_its_count_and_each_sample_evenly() -> None:
    order = _global(8 * 5 * 3 * EPOCH)
    for epoch in range(40):
        drawn = order[epoch * EPOCH : (epoch + 1) * EPOCH]
        per_dataset = Counter(_dataset_of(i) for i in drawn)
        assert [per_dataset[d] for d in range(len(PARTS))] == [draws for _, draws in PARTS]
        counts = Counter(drawn)
        start = 0
        for size, draws in PARTS:
            times = [counts[i] for i in range(start, start + size)]
            # draws // size or one more; two more only where the extras cross into the next permutation
            assert set(times) <= {draws // size, draws // size + 1, draws // size + 2}, times
            assert sorted(times)[-1] - sorted(times)[0] <= 2
            start += size
    # Over `size` epochs a dataset draws each of its samples exactly `draws` times: the undersampled
    # one (5 samples, 2 draws per epoch) shows all five, twice each, within any 5 epochs from a
    # multiple of 5; the oversampled ones their whole passes plus the extras in turn.
    start = 0
    for size, draws in PARTS:
        for first in range(0, 40, size):
            window = order[first * EPOCH : (first + size) * EPOCH]
            counts = Counter(i for i in window if start <= i < start + size)
            assert sorted(counts) == list(range(start, start + size)) and set(counts.values()) == {draws}
        start += size


def test_an_epoch_is_shuffled_across_datasets_and_differs_between_epochs() -> None:
    order = _global(2 * EPOCH)
    first, second = order[:EPOCH], order[EPOCH:]
    assert first != second
    # Not dataset after dataset: the datasets interleave within the epoch.
    runs = sum(1 for a, b in itertools.pairwise(first) if _dataset_of(a) != _dataset_of(b))
    assert runs > len(PARTS)


def test_one_dataset_drawn_once_is_the_plain_order() -> None:
    plain = DistributedSampler(N, 0, 1, seed=7)
    one = DistributedSampler(N, 0, 1, seed=7, parts=[(N, N)])
    assert [plain.next_index() for _ in range(3 * N)] == [one.next_index() for _ in range(3 * N)]


@pytest.mark.parametrize("dp", [2, 3])
def test_dp_ranks_interleave_into_the_global_order_and_sp_ranks_agree(dp: int) -> None:
    ranks = [_sampler(rank, dp) for rank in range(dp)]
    together = [r.next_index() for _ in range(20) for r in ranks]
    assert together == _global(20 * dp)
    sp_peers = [_sampler(1, dp) for _ in range(2)]
    assert [s.next_index() for s in sp_peers for _ in range(1)] == [together[1]] * 2


def test_resume_under_another_dp_size_continues_and_bucketing_keeps_the_counts() -> None:
    lengths = [(i * 37) % 11 for i in range(N)]
    four = [_sampler(r, 4, lengths=lengths, bucket_size=5) for r in range(4)]
    seen = [r.next_index() for _ in range(7) for r in four]
    two = [_sampler(r, 2, lengths=lengths, bucket_size=5) for r in range(2)]
    for sampler in two:
        sampler.load_state_dict(four[0].state_dict())
    rest = [r.next_index() for _ in range(30) for r in two]
    assert seen + rest == _global(88, lengths=lengths, bucket_size=5)
    epoch = Counter(_dataset_of(i) for i in (seen + rest)[:EPOCH])
    assert [epoch[d] for d in range(len(PARTS))] == [draws for _, draws in PARTS]


def test_a_state_of_other_weights_or_datasets_is_refused() -> None:
    state = _sampler().state_dict()
    with pytest.raises(ValueError, match="same data.path datasets, weights and repeats"):
        _sampler(parts=[(8, 16), (5, 4), (3, 9)]).load_state_dict(state)
    # A checkpoint of one dataset (no parts recorded) resumes as one dataset drawn once per epoch.
    legacy = {k: v for k, v in DistributedSampler(N, 0, 1, seed=7).state_dict().items() if k != "parts"}
    DistributedSampler(N, 0, 1, seed=7).load_state_dict(legacy)
    with pytest.raises(ValueError, match="weights and repeats"):
        _sampler().load_state_dict(legacy)


# -- weights and repeats --------------------------------------------------------------------------


def test_weights_split_an_epoch_of_all_samples_by_the_largest_remainder() -> None:
    specs = [DatasetSpec("a", weight=3), DatasetSpec("b", weight=1), DatasetSpec("c", weight=1)]
    draws = epoch_draws([8, 5, 3], specs)
    assert sum(draws) == 16 and draws == [10, 3, 3]  # shares 9.6, 3.2, 3.2: the 0.6 takes the extra one
    assert epoch_draws([8, 5], [DatasetSpec("a", repeats=2), DatasetSpec("b", repeats=3)]) == [16, 15]
    with pytest.raises(ConfigError, match=r"'data.path\[1\].repeats' makes an epoch of 100,000,008 draws"):
        epoch_draws([8, 1_000_000], [DatasetSpec("a"), DatasetSpec("b", repeats=100)])
    with pytest.raises(ConfigError, match=r"'data.path\[1\].weight' gives dataset 'b' 0.11 of the 11 draws"):
        epoch_draws([10, 1], [DatasetSpec("a", weight=100), DatasetSpec("b", weight=1)])


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return (
        write_synthetic_dataset(root / "a", task="ref2va", num_samples=5, seed=1),
        write_synthetic_dataset(root / "b", task="ref2va", num_samples=3, seed=2),
    )


def _mixture_overrides(a: Path, b: Path, weights: tuple[float, float] = (1, 3)) -> list[str]:
    return [
        "data.create_synthetic=false",
        f"data.path=[{{path: {a}, weight: {weights[0]}}}, {{path: {b}, weight: {weights[1]}}}]",
    ]


def test_the_config_takes_a_list_in_yaml_and_on_the_command_line(two_datasets, tmp_path: Path) -> None:
    a, b = two_datasets
    cfg = load_config(TINY_REF2VA, _mixture_overrides(a, b))
    assert dataset_specs(cfg.data) == [DatasetSpec(str(a), weight=1.0), DatasetSpec(str(b), weight=3.0)]
    config = tmp_path / "mix.yaml"
    config.write_text(
        TINY_REF2VA.read_text().replace(
            "  path: runs/tiny_ref2va_data\n  create_synthetic: true\n",
            f"  path:\n    - {a}\n    - path: {b}\n      repeats: 2\n",
        )
    )
    specs = dataset_specs(load_config(config).data)
    # In a weighted list a folder without a weight weighs 1.
    assert dataset_specs(
        load_config(TINY_REF2VA, _mixture_overrides(a, b)[:1] + [f"data.path=[{a}, {{path: {b}, weight: 3}}]"]).data
    ) == [
        DatasetSpec(str(a), weight=1.0),
        DatasetSpec(str(b), weight=3.0),
    ]
    assert specs == [DatasetSpec(str(a)), DatasetSpec(str(b), repeats=2)]
    # A single folder stays literal text, a number in its name included.
    assert dataset_specs(load_config(TINY_REF2VA, ["data.path=runs/1e3 #x"]).data) == [DatasetSpec("runs/1e3 #x")]

    source = build_source(load_config(config))
    assert isinstance(source, DatasetMixture) and len(source) == 8 and source.parts == [(5, 5), (3, 6)]
    assert source.lengths == source.datasets[0].lengths + source.datasets[1].lengths
    assert source.locate(5) == (1, 0) and source[6].sample_id == source.datasets[1][1].sample_id
    sampler = build_sampler(source, load_config(config), 0, 1)
    assert sampler.parts == [(5, 5), (3, 6)] and sampler.epoch_length == 11


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("[]", "'data.path' is []; give a dataset folder or a list"),
        ("[{path: A, weight: 1, repeats: 2}]", "'data.path[0]' sets both weight and repeats"),
        (
            "[{path: A, weight: 1}, {path: B, repeats: 2}]",
            "'data.path[1].repeats' is set in a list balanced by weights",
        ),
        ("[{path: A, weight: 2}, {path: B, weight: 0}]", "'data.path[1].weight' is 0; it takes a positive number"),
        ("[A, {path: B, repeats: 0}]", "'data.path[1].repeats' is 0; it takes a whole number of at least 1"),
        ("[A, {path: B, repeats: 1.5}]", "'data.path[1].repeats' is 1.5"),
        ("[A, {path: B, wieght: 2}]", "'data.path[1].wieght' is not a dataset field (fields: path, weight, repeats)"),
        ("[A, {weight: 2}]", "'data.path[1].path' is None; give the dataset's folder"),
        ("[A, ./A]", "'data.path[1]' names the folder of data.path[0] again"),
        ("[A, [B]]", "'data.path[1]' is ['B']; each dataset is a folder"),
    ],
)
def test_a_malformed_list_is_one_line_naming_the_entry(value: str, expected: str, capsys) -> None:
    args = ["check", str(TINY_REF2VA), "data.create_synthetic=false", f"data.path={value}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_preflight_names_the_dataset_of_the_list(two_datasets, tmp_path: Path, capsys) -> None:
    a, b = two_datasets
    fl2va = write_synthetic_dataset(tmp_path / "fl2va", task="fl2va", num_samples=2)
    cases = {
        f"data.path=[{a}, {tmp_path / 'missing'}]": f"'data.path[1]': no dataset at '{tmp_path / 'missing'}'",
        f"data.path=[{a}, {fl2va}]": f"dataset '{fl2va}' (data.path[1]) holds only fl2va samples; use task.name=fl2va",
        f"data.path=[{{path: {a}, weight: 1000}}, {{path: {b}, weight: 1}}]": "'data.path[1].weight' gives dataset",
    }
    for override, expected in cases.items():
        assert main(tiny_args(tmp_path / "run", "data.create_synthetic=false", override, config=TINY_REF2VA)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (override, err)
    assert (
        main(["check", str(TINY_REF2VA), "data.create_synthetic=false", f"data.path=[{a}, {{path: {b}, repeats: 3}}]"])
        == 0
    )
    said = capsys.readouterr().out
    assert f"data: 2 datasets, 14 draws per epoch: '{a}' 5 samples x 1 = 5 (repeats 1, 35.7%); '{b}' 3 samples" in said
    assert "longest sample in the dataset indexes" in said
    assert main(["check", str(TINY_REF2VA), "data.path=[a, b]"]) == 2
    assert "'data.create_synthetic' writes one dataset" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything is written


# -- a run ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_weighted_mixture_at_dp2_sp2_matches_the_unsharded_reference_and_resumes_only_as_itself(
    two_datasets, tmp_path: Path, capsys
) -> None:
    a, b = two_datasets
    run = tmp_path / "run"
    extra = ["parallel.dp_shard=2", "parallel.sp=2", *_mixture_overrides(a, b)]
    cfg = load_config(TINY_REF2VA, extra)
    source = build_source(cfg)
    # Step 1 (2 DP ranks x grad_accum 2) trains on both datasets, so the comparison covers the mixture.
    ranks = [build_sampler(source, cfg, r, 2) for r in range(2)]
    step_one = [s.next_index() for _ in range(cfg.train.grad_accum) for s in ranks]
    assert {source.locate(i)[0] for i in step_one} == {0, 1}, step_one

    result = parity_step(TINY_REF2VA, extra, run, nproc=4, dp=2)
    worst, name = result.worst()
    assert worst <= TOL, f"gradient of {name} off by relative L2 {worst:.3e}"
    assert result.loss == pytest.approx(result.ref_loss, rel=TOL)
    assert result.grad_norm == pytest.approx(result.ref_norm, rel=TOL)

    # Other weights are another order: the checkpoint's data position would point elsewhere.
    resume = ["train.steps=2", "parallel.dp_shard=-1", "logging.progress=false", f"logging.dir={run}"]
    assert main(["train", str(TINY_REF2VA), *resume, *_mixture_overrides(a, b, (1, 1))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "same data.path datasets, weights and repeats" in lines[0], lines
    # The way forward with other data: a new run from this one's exported weights.
    assert "'h3train export RUN --out DIR'" in lines[0] and "model.pretrained=DIR" in lines[0], lines
    # The same list resumes (under another DP size) and trains on.
    assert main(["train", str(TINY_REF2VA), *resume, *_mixture_overrides(a, b)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: 2 datasets")]
    assert said == [
        f"data: 2 datasets, 8 draws per epoch: '{a}' 5 samples x 0.4 = 2 (weight 1, 25.0%); "
        f"'{b}' 3 samples x 2 = 6 (weight 3, 75.0%)"
    ]
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and math.isfinite(rows[-1]["loss"])
