"""The step's one all-reduce carries named totals: packed and unpacked by name, never by position."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from h3train.train.reduction import StepTotals


def _distinct() -> dict[str, float]:
    """A different value for every field, so a value read under another field's name shows."""
    return {name: float(10 * (i + 1)) for i, name in enumerate(StepTotals.names())}


def test_packed_totals_unpack_under_their_own_names() -> None:
    values = _distinct()
    losses = StepTotals.loss_terms(**{name: torch.tensor(values[name]) for name in StepTotals.loss_names()})
    counts = {name: values[name] for name in reversed(StepTotals.count_names())}  # any order: by name
    packed = StepTotals.pack(losses, counts)
    assert packed.dtype == torch.float64 and packed.shape == (len(values),)
    # What follows the totals (the unreduced scalars) is left for the caller.
    totals = StepTotals.unpack([*packed.tolist(), -1.0, -2.0])
    assert dataclasses.asdict(totals) == values


def test_a_swap_of_two_fields_is_caught() -> None:
    values = _distinct()
    losses = StepTotals.loss_terms(**{name: torch.tensor(values[name]) for name in StepTotals.loss_names()})
    packed = StepTotals.pack(losses, values).tolist()
    names = list(StepTotals.names())
    for a, b in [("loss", "loss_video"), ("audio_samples", "rows"), ("preempting", "interrupting")]:
        i, j = names.index(a), names.index(b)
        swapped = list(packed)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        totals = StepTotals.unpack(swapped)
        assert dataclasses.asdict(totals) != values
        assert getattr(totals, a) == values[b] and getattr(totals, b) == values[a]


def test_the_device_sums_come_first_and_every_field_is_packed() -> None:
    assert StepTotals.names() == (*StepTotals.loss_names(), *StepTotals.count_names())
    assert {f.name for f in dataclasses.fields(StepTotals)} == set(StepTotals.names())
    assert StepTotals.loss_names() == ("loss", "loss_video", "loss_audio", "loss_video_fm", "loss_audio_fm")


def test_too_few_values_are_refused() -> None:
    with pytest.raises(ValueError, match="12 values"):
        StepTotals.unpack([0.0] * 11)
