"""`h3train check` on a million-sample index grows by at most `BUDGET_MIB` over a ten-sample one.

The compact index is mapped as columns; a check that held a Python object per index row (a list of the
sample ids, of the entries) would take hundreds of MiB at a million rows. Both folders are written by
`helpers.index_memory.write_folder`, as `scripts/index_bench.py` writes them, with their compact index
built before the checks, and each check's peak RSS comes from a fresh process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from h3train.data.dataset_index import open_index

from helpers.index_memory import check_run, write_folder

pytestmark = pytest.mark.one_lane

BIG = 1_000_000
SMALL = 10
BUDGET_MIB = 200


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(big, small): the two folders, each with its compact index built."""
    root = tmp_path_factory.mktemp("index_memory")
    big, small = write_folder(root / "big", BIG), write_folder(root / "small", SMALL)
    for folder in (big, small):
        open_index(folder)
    return big, small


@pytest.fixture(scope="module")
def small_peak(folders: tuple[Path, Path]) -> float:
    return check_run(folders[1])[1]


@pytest.mark.slow
def test_check_on_a_million_sample_index_stays_within_its_memory_budget(
    folders: tuple[Path, Path], small_peak: float
) -> None:
    growth = check_run(folders[0])[1] - small_peak
    print(f"check {BIG:,} vs {SMALL}: {growth:+.0f} MiB")
    assert growth <= BUDGET_MIB, f"check on {BIG:,} samples peaks {growth:+.0f} MiB over {SMALL}"


@pytest.mark.slow
def test_the_budget_catches_a_check_that_holds_every_index_row(folders: tuple[Path, Path], small_peak: float) -> None:
    # The same measurement with every row held as an `IndexEntry`: the budget must see it.
    growth = check_run(folders[0], planted=True)[1] - small_peak
    print(f"planted check {BIG:,} vs {SMALL}: {growth:+.0f} MiB")
    assert growth > BUDGET_MIB, f"the planted check peaks only {growth:+.0f} MiB over {SMALL} samples"
