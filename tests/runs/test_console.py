"""What a run shows and leaves behind for its user: the console lines, the closing summary, peak memory,
null for a modality a step did not have, TensorBoard, and the third-party notices kept off the console.

One tiny run of `h3train train` (in this process, through `h3train.cli.main`) serves most tests: six
steps over a cached dataset of six samples, every third without sound, one sample per step.
"""

from __future__ import annotations

import io
import logging
import re
import resource
import shlex
import sys
import warnings
from collections.abc import Callable, Mapping
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from h3train.checkpoint import step_dir_name
from h3train.cli import main
from h3train.config import load_config
from h3train.data.location import SAMPLE_SUFFIX
from h3train.data.sample_file import read_cached_sample
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.infra.quiet import known_notices
from h3train.tools.curves import metrics_figure
from h3train.train.hooks import TrainerHook, TrainerView
from h3train.train.metrics import MEMORY_KEY, TENSORBOARD_DIR, format_duration

from helpers.launch import read_metrics, tiny_args
from helpers.paths import TINY_FL2VA

STEPS = 6
SAMPLES = 6
# step 3/6 video=0.1234 audio=- grad_norm=0.5678 lr=1.000e-03 peak_mem=1.23GiB samples=2 (0.05 s/step, elapsed 0:00:01,
# eta ..)
LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total>\d+) video=(?P<video>\S+) audio=(?P<audio>\S+) grad_norm=\S+ lr=\S+ "
    r"peak_mem=(?P<mem>[\d.]+)GiB samples=(?P<samples>\d+) "
    r"\((?P<per_step>[\d.]+) s/step, elapsed (?P<elapsed>\d+:\d\d:\d\d), eta (?P<eta>\d+:\d\d:\d\d)\)$"
)


@dataclass
class Run:
    dir: Path
    data: Path
    out: str
    err: str
    rows: list[dict]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("console")
    data = write_synthetic_dataset(root / "data", task="fl2va", num_samples=SAMPLES, seed=0, text_dim=16)
    log_dir = root / "run"
    args = tiny_args(
        log_dir,
        "data.source=cached",
        f"data.path={data}",
        f"train.steps={STEPS}",
        "train.grad_accum=1",
        "checkpoint.every=3",
        "logging.tensorboard=true",
    )
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    assert code == 0, err.getvalue()[-4000:]
    return Run(log_dir, data, out.getvalue(), err.getvalue(), read_metrics(log_dir))


def _seconds(clock: str) -> int:
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def test_every_step_line_shows_elapsed_time_eta_and_peak_memory(run: Run) -> None:
    lines = [line for line in run.err.splitlines() if line.startswith("step ")]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [int(m["step"]) for m in matches] == list(range(1, STEPS + 1))
    elapsed = [_seconds(m["elapsed"]) for m in matches]
    assert elapsed == sorted(elapsed)
    # The ETA is the mean time per step so far times the steps left: none after the last.
    assert matches[-1]["eta"] == "0:00:00"
    for m, row in zip(matches, run.rows, strict=True):
        done, left = int(m["step"]), STEPS - int(m["step"])
        assert _seconds(m["eta"]) == pytest.approx(_seconds(m["elapsed"]) / done * left, abs=1 + left / done)
        assert float(m["mem"]) == pytest.approx(row[MEMORY_KEY], abs=0.006)
        assert int(m["samples"]) == row["samples"]


def test_step_lines_show_each_modality_loss_and_a_dash_without_sound(run: Run) -> None:
    matches = [LINE.match(line) for line in run.err.splitlines() if line.startswith("step ")]
    assert len(matches) == len(run.rows) and all(matches)
    # Up to 50 steps every line is its own step's: the video loss, and the audio loss or `-` without sound.
    for m, row in zip(matches, run.rows, strict=True):
        assert float(m["video"]) == pytest.approx(row["loss_video"], abs=5e-5)
        assert (
            m["audio"] == "-"
            if row["loss_audio"] is None
            else float(m["audio"]) == pytest.approx(row["loss_audio"], abs=5e-5)
        )
    assert "-" in [m["audio"] for m in matches], "the data has silent clips"
    assert "loss=" not in run.err, "the total (about half on a silent step) is not the headline"


def test_format_duration_counts_hours_past_a_day() -> None:
    assert [format_duration(s) for s in (0, 59.6, 83, 3600, 90061)] == [
        "0:00:00",
        "0:01:00",
        "0:01:23",
        "1:00:00",
        "25:01:01",
    ]


def test_rows_hold_the_peak_memory(run: Run) -> None:
    peaks = [row[MEMORY_KEY] for row in run.rows]
    assert all(isinstance(p, float) and p > 0 for p in peaks)
    # On the CPU it is this process's peak RSS (KiB on Linux): it never falls, and no row exceeds it now.
    assert peaks == sorted(peaks)
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert peaks[-1] <= now + 1e-9


def test_a_step_without_sound_logs_null_audio_losses(run: Run) -> None:
    silent = sum(not read_cached_sample(path).has_audio for path in run.data.glob(f"*{SAMPLE_SUFFIX}"))
    assert 0 < silent < SAMPLES
    audio = [row["loss_audio"] for row in run.rows]
    # One sample per step over one pass of the data: one null per silent sample, a loss for the others.
    assert audio.count(None) == silent
    assert all(isinstance(v, float) and v > 0 for v in audio if v is not None)
    assert not any("nonfinite" in row for row in run.rows), "an absent value is not a non-finite one"
    # The plot leaves those steps out instead of diving to zero.
    (line,) = [
        ln for ln in metrics_figure(run.dir / "metrics.jsonl").axes[0].get_lines() if ln.get_label() == "loss_audio"
    ]
    assert list(line.get_xdata()) == [row["step"] for row in run.rows if row["loss_audio"] is not None]


def test_the_plot_shows_samples_per_step_and_steps_per_epoch(run: Run) -> None:
    samples_axis = metrics_figure(run.dir / "metrics.jsonl").axes[3]
    (line,) = [ln for ln in samples_axis.get_lines() if ln.get_label() == "samples"]
    assert list(line.get_ydata()) == [row["samples"] for row in run.rows]
    first, last = run.rows[0], run.rows[-1]
    per_epoch = (last["step"] - first["step"]) / (last["epoch"] - first["epoch"])
    assert samples_axis.get_title().startswith(f"{per_epoch:,.1f} steps per epoch")


def test_the_run_closes_with_a_summary_and_a_working_export_command(run: Run, tmp_path: Path) -> None:
    checkpoint = run.dir / "checkpoints" / step_dir_name(STEPS)
    lines = run.out.strip().splitlines()
    summary = lines[-3:]
    trained = sum(row["samples"] for row in run.rows)
    epoch = run.rows[-1]["epoch"]
    assert re.fullmatch(
        rf"done: trained steps 1-{STEPS} of {STEPS} "
        rf"\({STEPS} steps, {trained} samples: {trained / STEPS:.1f} per step\) "
        rf"in \d+:\d\d:\d\d; the data order is at epoch {epoch:.2f}",
        summary[0],
    )
    assert epoch == pytest.approx(trained / SAMPLES)
    assert summary[1] == f"last checkpoint: {checkpoint}"
    prefix = "export it with: "
    assert summary[2].startswith(prefix)
    command = shlex.split(summary[2][len(prefix) :])
    assert command[:3] == ["h3train", "export", str(checkpoint)]
    assert command[3:] == ["--out", str(run.dir / "export" / checkpoint.name)]
    # The printed command works as printed (to another folder here, so the run's stays as it is).
    command[-1] = str(tmp_path / "exported")
    assert main(command[1:]) == 0
    assert (tmp_path / "exported" / "config.json").is_file()


def test_tensorboard_holds_the_same_scalars_as_metrics_jsonl(run: Run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.dir / TENSORBOARD_DIR))
    events.Reload()
    numeric = {
        key
        for row in run.rows
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    assert set(events.Tags()["scalars"]) == numeric
    for key in numeric:
        want = {row["step"]: row[key] for row in run.rows if row.get(key) is not None}
        got = {event.step: event.value for event in events.Scalars(key)}
        assert got.keys() == want.keys(), key
        for step, value in want.items():
            # TensorBoard keeps float32.
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


class _Announcer(TrainerHook):
    """Prints as a render does after each step (tqdm.write to stderr) and hands the trainer a 'clip'."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def after_step(self, trainer: TrainerView, step: int, stats: Mapping[str, float]) -> None:
        tqdm.write(f"rendering 1 validation sample after step {step}", file=sys.stderr)
        trainer.log_videos(step, {"clip": (self.folder / f"step_{step}" / "clip.mp4", "a prompt")})


def test_hook_lines_follow_their_steps_line_and_the_summary_names_the_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from h3train.run.assemble import build_trainer

    samples = tmp_path / "run" / "samples"
    cfg = load_config(TINY_FL2VA, tiny_args(tmp_path / "run", "train.steps=3", "checkpoint.every=0")[2:])
    trainer = build_trainer(cfg, hooks=[_Announcer(samples)])
    try:
        trainer.fit()
    finally:
        trainer.close()
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    for step in (1, 2, 3):
        own = next(i for i, line in enumerate(err) if line.startswith(f"step {step}/3 "))
        hook = err.index(f"rendering 1 validation sample after step {step}")
        assert own < hook, err
    out = captured.out.strip().splitlines()
    assert out[-2:] == ["no checkpoint of this run to export (checkpoint.every=0)", f"samples: {samples / 'step_3'}"]


def _notices(action: Callable[[], None]) -> tuple[list[str], list[str]]:
    """The diffusers log records and the warnings `action()` raises."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            action()
    finally:
        logger.removeHandler(handler)
    return records, [str(w.message) for w in caught]


def test_known_notices_are_silenced_only_inside_the_block() -> None:
    from h3train.model.build import build_meta_model

    model = build_meta_model(load_config(TINY_FL2VA))

    def set_backend() -> None:
        model.set_attention_backend("native")

    def weight_norm() -> None:
        torch.nn.utils.weight_norm(torch.nn.Conv1d(1, 1, 1))

    def quietly(action: Callable[[], None]) -> None:
        with known_notices():
            action()
            # Anything else still shows inside the block.
            warnings.warn("another notice", FutureWarning, stacklevel=1)

    assert any("Attention backends are an experimental feature" in r for r in _notices(set_backend)[0])
    assert any("weight_norm` is deprecated" in w for w in _notices(weight_norm)[1])
    records, caught = _notices(lambda: quietly(set_backend))
    assert not any("Attention backends" in r for r in records) and caught == ["another notice"]
    records, caught = _notices(lambda: quietly(weight_norm))
    assert caught == ["another notice"]
    # The filter goes with the block.
    assert any("Attention backends" in r for r in _notices(set_backend)[0])


def test_under_cfg_the_headline_is_the_flow_matching_loss_with_the_objective_beside_it(capsys) -> None:
    from h3train.train.metrics.console_sink import ConsoleSink

    sink = ConsoleSink(total_steps=2, progress=False)
    sink.open(0)
    row = {"loss": 40.0, "loss_video": 25.96, "loss_audio": None, "loss_video_fm": 1.6279, "loss_audio_fm": None}
    sink.show(1, {**row, "grad_norm": 0.5, "lr": 1e-3})
    line = capsys.readouterr().err.strip()
    # The same number held-out reports as val/loss_video leads; the calibrated objective follows.
    assert line.startswith("step 1/2 video=1.6279 audio=- cfg_video=25.9600 cfg_audio=- grad_norm=0.5 "), line
    sink.show(2, {"loss": 3.0, "loss_video": 1.5, "loss_audio": 1.5, "grad_norm": 0.5})
    assert " video=1.5000 audio=1.5000 grad_norm=" in capsys.readouterr().err
