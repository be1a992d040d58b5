"""A task filter names what it leaves out: `check` and the training start-up lines list, per dataset, the
samples of each sample task `task.name` does not train, with their count, the first ids and the
`task.name` that would train them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from h3train.config import load_config
from h3train.data.dataset_index import write_index
from h3train.data.location import SAMPLE_SUFFIX
from h3train.data.sample_file import write_sample
from h3train.data.source import left_out_lines
from h3train.data.synthetic_dataset import synthetic_sample

from helpers.launch import run_cli
from helpers.paths import TINY_FL2VA


def _fl2va_and_ref2va(folder: Path, fl2va: int, ref2va: int) -> Path:
    """A dataset of `fl2va` fl2va samples (`fl-i`) and `ref2va` ref2va samples (`ref-i`), one index."""
    folder.mkdir(parents=True)
    made = {"fl2va": 0, "ref2va": 0}
    for task, count in (("fl2va", fl2va), ("ref2va", ref2va)):
        index = 0
        while made[task] < count:
            sample = synthetic_sample(task, index, 0, 16)
            index += 1
            if sample.task != task:  # the fl2va synthetic data holds a few text-only clips too
                continue
            sample_id = f"{'ref' if task == 'ref2va' else 'fl'}-{made[task]}"
            write_sample(folder / f"{sample_id}{SAMPLE_SUFFIX}", dataclasses.replace(sample, sample_id=sample_id))
            made[task] += 1
    write_index(folder)
    return folder


def _overrides(folder: Path, task: str) -> list[str]:
    return ["data.source=cached", f"data.path={folder}", f"task.name={task}"]


def test_fl2va_names_the_ref2va_samples_it_leaves_out(tmp_path: Path) -> None:
    folder = _fl2va_and_ref2va(tmp_path / "x", 5, 3)
    lines = left_out_lines(load_config(TINY_FL2VA, _overrides(folder, "fl2va")))
    assert lines == [
        f"task.name=fl2va leaves out 3 ref2va samples of dataset '{folder}' ('ref-0', 'ref-1', 'ref-2'); "
        "task.name=mixed trains them"
    ]
    assert left_out_lines(load_config(TINY_FL2VA, _overrides(folder, "mixed"))) == []


def test_the_names_are_capped_and_the_rest_counted(tmp_path: Path) -> None:
    folder = _fl2va_and_ref2va(tmp_path / "x", 6, 1)
    (line,) = left_out_lines(load_config(TINY_FL2VA, _overrides(folder, "ref2va")))
    assert line == (
        f"task.name=ref2va leaves out 6 fl2va samples of dataset '{folder}' ('fl-0', 'fl-1', 'fl-2' and 3 more); "
        "task.name=mixed trains them"
    )


def test_check_prints_what_the_filter_leaves_out(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    folder = _fl2va_and_ref2va(tmp_path / "x", 5, 3)
    rc, out, err = run_cli(capsys, ["check", str(TINY_FL2VA), *_overrides(folder, "fl2va")])
    assert rc == 0, out[-2000:] + err
    assert "task.name=fl2va leaves out 3 ref2va samples" in out and "('ref-0', 'ref-1', 'ref-2')" in out


def test_the_start_up_lines_print_what_the_filter_leaves_out(tmp_path: Path, capsys) -> None:
    from helpers.blueprints import start_plan

    folder = _fl2va_and_ref2va(tmp_path / "x", 5, 3)
    start_plan(load_config(TINY_FL2VA, _overrides(folder, "fl2va")), "cpu", 80.0)
    out = capsys.readouterr().out
    assert f"task.name=fl2va leaves out 3 ref2va samples of dataset '{folder}'" in out
