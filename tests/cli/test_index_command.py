"""A hand-edited index: `h3train check --strict` and a start name each line that disagrees with the sample
files, and `h3train index DIR` rewrites it from their headers, keeping the lines the user deleted out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from h3train.cli import main
from h3train.config import load_config
from h3train.data.dataset_index import read_index
from h3train.data.location import INDEX_NAME
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.errors import DatasetError
from h3train.run.preflight import check_indexes

from helpers.paths import TINY_FL2VA

TEXT_DIM = 16


def _cached(folder: Path) -> list[str]:
    return [str(TINY_FL2VA), "data.source=cached", f"data.path={folder}", "data.create_synthetic=false"]


@pytest.fixture(autouse=True)
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process started alone, as `h3train check --strict` is: it reads every header."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _damaged(folder: Path) -> tuple[list[dict], list[dict]]:
    """Six samples whose index a user edited: line 2 says the wrong seq_len, line 3 lists a file that does
    not exist, line 7 repeats line 1, and the sixth sample's line is deleted. The lines as written by the
    dataset, and as edited."""
    write_synthetic_dataset(folder, task="fl2va", num_samples=6, seed=0, text_dim=TEXT_DIM)
    rows = [json.loads(line) for line in (folder / INDEX_NAME).read_text().splitlines()]
    wrong = dict(rows[1], seq_len=rows[1]["seq_len"] + 7)
    gone = dict(rows[2], id="gone", file="gone.safetensors")
    edited = [rows[0], wrong, gone, rows[2], rows[3], rows[4], rows[0]]
    (folder / INDEX_NAME).write_text("".join(json.dumps(row) + "\n" for row in edited))
    return rows, edited


def test_check_strict_names_each_damaged_line_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "data"
    rows, _ = _damaged(folder)
    assert main(["check", *_cached(folder), "--strict"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"h3train: error: dataset '{folder}' (data.path): 3 lines of its index.jsonl"), err
    assert err[0].endswith(f"rebuild the index with 'h3train index {folder}'"), err
    assert err[1:] == [
        f"dataset '{folder}' index.jsonl line 2: sample 'synth-000001': the line says seq_len "
        f"{rows[1]['seq_len'] + 7}, its file 'synth-000001.safetensors' holds seq_len {rows[1]['seq_len']}",
        f"dataset '{folder}' index.jsonl line 3: sample 'gone': its file 'gone.safetensors' does not exist",
        f"dataset '{folder}' index.jsonl line 7: sample 'synth-000000' is listed again (first on line 1): "
        "it trains twice an epoch",
    ]


def test_index_rewrites_the_damaged_lines_and_keeps_the_removed_one_out(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp_path / "data"
    rows, edited = _damaged(folder)
    before = (folder / INDEX_NAME).read_bytes()
    assert main(["index", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    backups = list(folder.glob(f"{INDEX_NAME}.bak-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == before
    assert out == [
        f"index.jsonl line 2: rewritten, the line says seq_len {edited[1]['seq_len']}, its file "
        f"'synth-000001.safetensors' holds seq_len {rows[1]['seq_len']}",
        "index.jsonl line 3: dropped, its file 'gone.safetensors' does not exist",
        "index.jsonl line 7: dropped, it lists file 'synth-000000.safetensors' again (first on line 1)",
        f"wrote {folder / INDEX_NAME}: 5 samples; the index it replaced is kept as {backups[0]}",
    ]
    # The lines the dataset was written with, less the one the user deleted; the sample file stays.
    assert [json.loads(line) for line in (folder / INDEX_NAME).read_text().splitlines()] == rows[:5]
    assert (folder / rows[5]["file"]).is_file()
    assert [entry.sample_id for entry in read_index(folder)] == [row["id"] for row in rows[:5]]

    assert main(["check", *_cached(folder), "--strict"]) == 0
    # Nothing left to fix: nothing written, no second backup.
    assert main(["index", str(folder)]) == 0
    assert "nothing to fix" in capsys.readouterr().out
    assert list(folder.glob(f"{INDEX_NAME}.bak-*")) == backups


def test_index_without_an_index_lists_every_sample_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=3, seed=0, text_dim=TEXT_DIM)
    written = (folder / INDEX_NAME).read_text()
    (folder / INDEX_NAME).unlink()
    assert main(["index", str(folder)]) == 0
    assert (folder / INDEX_NAME).read_text() == written
    assert "listed all 3 sample files" in capsys.readouterr().out


def test_a_line_naming_no_file_is_refused_and_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=2, seed=0, text_dim=TEXT_DIM)
    with open(folder / INDEX_NAME, "a") as index:
        index.write('{"id": "torn", "fi\n')
    before = (folder / INDEX_NAME).read_bytes()
    assert main(["index", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "index.jsonl' line 3" in err and f"then run 'h3train index {folder}' again" in err, err
    assert err.count("\n") == 1
    assert (folder / INDEX_NAME).read_bytes() == before and not list(folder.glob("*.bak-*"))


def test_train_refuses_a_damaged_index_before_the_process_group(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "data"
    _damaged(folder)
    log_dir = tmp_path / "run"
    assert main(["train", *_cached(folder), f"logging.dir={log_dir}", "logging.progress=false"]) == 2
    err = capsys.readouterr().err
    assert not dist.is_initialized() and not log_dir.exists()
    assert f"'h3train index {folder}'" in err and "line 2: sample 'synth-000001'" in err, err


def test_the_ranks_of_a_launch_check_only_duplicates_and_missing_files(tmp_path: Path) -> None:
    """Each rank would read every header again after launch.sh's check: the ranks run the cheap checks."""
    folder = tmp_path / "data"
    _damaged(folder)
    cfg = load_config(TINY_FL2VA, _cached(folder)[1:])
    with pytest.raises(DatasetError) as found:
        check_indexes(cfg, headers=False)
    lines = str(found.value).splitlines()
    assert "2 lines" in lines[0] and len(lines) == 3
    assert "line 3: sample 'gone'" in lines[1] and "line 7: sample 'synth-000000'" in lines[2]


def test_a_rank_of_a_launch_starts_without_reading_every_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Under a launcher (WORLD_SIZE > 1) the start refuses the missing file and the repeated line alone."""
    folder = tmp_path / "data"
    _damaged(folder)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["check", *_cached(folder), "--strict", "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "2 lines" in err and "line 3: sample 'gone'" in err and "line 2:" not in err, err


def test_the_held_out_dataset_index_is_checked_too(tmp_path: Path) -> None:
    folder = tmp_path / "heldout"
    _damaged(folder)
    cfg = load_config(TINY_FL2VA, ["validation.every=2", f"validation.dataset={folder}"])
    with pytest.raises(DatasetError, match=r"\(validation\.dataset\): 3 lines of its index.jsonl disagree"):
        check_indexes(cfg, headers=True)


def test_check_without_strict_finds_what_needs_no_header(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "data"
    _damaged(folder)
    assert main(["check", *_cached(folder)]) == 2
    err = capsys.readouterr().err
    assert "2 lines" in err and "line 7: sample 'synth-000000'" in err and "line 2:" not in err, err
