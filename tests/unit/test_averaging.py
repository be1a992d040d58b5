"""The start-up probe of `ReduceOp.AVG` (`h3train/parallel/averaging.py`): average, sum, or refused.

A whole run over collectives that sum is held against the unsharded reference in
`tests/runs/test_sp_parity.py`; here the probe's verdicts on the values a collective returns.
"""

from __future__ import annotations

import pytest
import torch

from h3train.errors import ConfigError
from h3train.parallel import averaging


class _FourRanks:
    """A 4-rank group as the probe sees it: the ranks contribute 1, 2, 3, 4 (average 2.5, sum 10)."""

    def size(self) -> int:
        return 4


@pytest.fixture
def returns(monkeypatch):
    monkeypatch.setattr(averaging.dist, "get_backend", lambda group=None: "gloo")

    def set_value(value: float) -> None:
        monkeypatch.setattr(averaging, "averaged", lambda kind, group, device: value)

    return set_value


def test_an_average_needs_nothing_and_a_sum_is_named(returns) -> None:
    cpu = torch.device("cpu")
    returns(2.5)
    assert averaging._probe("reduce-scatter", _FourRanks(), "dp_shard_sp", cpu) is None
    returns(10.0)
    found = averaging._probe("reduce-scatter", _FourRanks(), "dp_shard_sp", cpu)
    assert found == "gloo's reduce-scatter over dp_shard_sp (4 ranks)"
    line = averaging.Averaging((found,)).describe(8)
    assert averaging.Averaging((found,)).force_sum and not averaging.Averaging().force_sum
    assert "summed when asked to average" in line and "divides by 8 itself" in line


def test_a_backend_that_gives_neither_is_refused_in_one_line(returns) -> None:
    returns(7.0)
    with pytest.raises(ConfigError, match=r"neither the average 2\.5 nor the sum 10") as err:
        averaging._probe("all-reduce", _FourRanks(), "dp_replicate", torch.device("cpu"))
    assert "\n" not in str(err.value) and "parallel.backend" in str(err.value)
