"""Every rank issues the same collectives from the start on, whichever rank reaches each point first.

The 4-rank parity layout `ref2va sp=4` (`scripts/parity_report.py`) writes its dataset at the start
(`data.create_synthetic`): rank 0 writes it, every rank waits in a barrier. On a loaded machine the ranks
reach that step seconds apart, and a rank that decided from the files it saw whether to wait would skip the
barrier its peers wait in once rank 0 had written them: one rank in the barrier, another in the next
collective (`Detected mismatch between collectives` under the collective checks, a hang on NCCL). Here that
order is made on purpose (`helpers/start_ranks.py`: chosen ranks enter the data step only once the index is
written), the start and the step run in each order, and each rank's collectives, in the order issued with
their sizes, must be the same on every rank. The process groups check each collective too
(`launch.run_env`), and a short `parallel.timeout_s` ends a diverged run where they cannot.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.launch import run_env, tiny_overrides
from helpers.pack_ranks import run_on_ranks
from helpers.paths import ROOT
from helpers.reference import parity_overrides
from helpers.start_ranks import Call, start_orders

CONFIG = ROOT / "configs" / "tiny_ref2va.yaml"
NPROC = 4
# Which ranks enter the data step only once rank 0 has written the dataset, per round.
LATE = {
    "in order": [],
    "every peer late": [1, 2, 3],
    "one rank late": [3],
}


def _overrides(log_dir: Path, data: Path) -> list[str]:
    """The parity run of the layout (one step, dumped), its files in `log_dir`, its dataset in `data`."""
    return [*tiny_overrides(log_dir), *parity_overrides(1, data, ["parallel.sp=4"]), "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def orders(tmp_path_factory) -> dict[str, list[list[Call]]]:
    """Per round, each rank's collectives in the order issued (`start_ranks.start_orders`), rank 0's first."""
    root = tmp_path_factory.mktemp("order")
    rounds = {
        name: (_overrides(root / f"run{i}", root / f"data{i}"), late) for i, (name, late) in enumerate(LATE.items())
    }
    # The first round's dataset, written already: the late ranks find it at once, and no rank writes.
    rounds["written before"] = (_overrides(root / "run_again", root / "data0"), [1, 2, 3])
    return run_on_ranks(start_orders, NPROC, str(CONFIG), rounds, env=run_env(), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LATE, "written before"])
def test_every_rank_issues_the_same_collectives(orders, name: str) -> None:
    ranks = orders[name]
    first = ranks[0]
    assert sum(kind == "barrier" for _, kind, _, _ in first) >= 2, f"{name}: the start's barriers are missing"
    for rank, calls in enumerate(ranks[1:], start=1):
        diverged = next((i for i, (a, b) in enumerate(zip(first, calls)) if a != b), min(len(first), len(calls)))
        assert calls == first, (
            f"{name}: rank {rank} diverges from rank 0 at collective {diverged}: "
            f"{calls[diverged : diverged + 3]} against {first[diverged : diverged + 3]}"
        )
