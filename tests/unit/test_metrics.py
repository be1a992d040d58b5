"""MetricsLogger (JSONL, console, resume, ranks, wandb and TensorBoard) and plot_metrics."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from h3train.checkpoint.run_config import write_resolved_config
from h3train.config import WandbConfig
from h3train.tools.curves import plot_metrics
from h3train.train.metrics import MetricsLogger


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Every test here must be unable to reach the network through wandb, whatever it configures.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # No credentials from the developer's home either, so "online" can never log in.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _metrics(step: int) -> dict[str, float]:
    return {"loss": 1.0 / step, "grad_norm": 0.5 * step, "lr": 1e-5, "loss_video": 0.6 / step}


def _logger(log_dir: Path, **kw: Any) -> MetricsLogger:
    kw.setdefault("is_main", True)
    kw.setdefault("wandb_cfg", WandbConfig())
    kw.setdefault("run_config", {"train": {"steps": 6}})
    kw.setdefault("total_steps", 6)
    return MetricsLogger(log_dir, **kw)


class _FakeRun:
    """Stand-in for a wandb run whose `log` always fails."""

    def __init__(self) -> None:
        self.log_calls = 0
        self.finished = False

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.log_calls += 1
        raise ConnectionError("upload refused")

    def finish(self, exit_code: int | None = None) -> None:
        self.finished = True


def _wandb_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "wandb" in str(w.message)]


def test_jsonl_one_line_per_step_with_step_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _logger(tmp_path, total_steps=3) as logger:
        for step in (1, 2, 3):
            logger.log(step, _metrics(step))
            # Flushed per step: a reader sees the line before the logger closes.
            assert len(_read(tmp_path / "metrics.jsonl")) == step
    records = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(next(iter(r)) == "step" for r in records)
    assert records[1]["loss"] == pytest.approx(0.5)
    # No TTY under pytest, so each step of a short run gets a plain console line.
    err = capsys.readouterr().err
    assert err.count("step ") == 3 and "video=" in err and "grad_norm=" in err
    # No row here has an audio loss: no number, not a 0.
    assert err.count("audio=-") == 3 and "loss=" not in err


def _console_lines(capsys: pytest.CaptureFixture[str], total_steps: int, rows: list[dict]) -> dict[int, dict[str, str]]:
    """The plain console lines of `rows` (steps 1, 2, ...) as {step: {shown name: text}}."""
    from h3train.train.metrics import ConsoleSink

    sink = ConsoleSink(total_steps, progress=False)
    sink.open(0)
    for step, row in enumerate(rows, start=1):
        sink.show(step, row)
    sink.close()
    lines = {}
    for line in capsys.readouterr().err.splitlines():
        head, _, _ = line.partition(" (")
        words = head.split()
        lines[int(words[1].split("/")[0])] = dict(w.split("=", 1) for w in words[2:])
    return lines


def test_console_audio_loss_is_the_mean_over_the_steps_with_sound(capsys: pytest.CaptureFixture[str]) -> None:
    # 200 steps: a line every 4. Steps 1-4 sound on 1 and 3, steps 5-8 silent, steps 9-12 all sound.
    audio = [0.9, None, 0.5, None, None, None, None, None, 0.2, 0.4, 0.6, 0.8]
    rows = [
        {"loss": v + (a or 0.0), "loss_video": v, "loss_audio": a, "grad_norm": 1.0, "lr": 1e-4}
        for v, a in zip([1.0 + i / 10 for i in range(12)], audio, strict=True)
    ]
    lines = _console_lines(capsys, 200, rows)
    assert sorted(lines) == [1, 4, 8, 12]
    assert lines[1]["video"] == "1.0000" and lines[1]["audio"] == "0.9000"
    # The silent steps count for neither the audio mean (as a 0) nor its count: (0.9 + 0.5) / 2.
    assert lines[4]["video"] == f"{(1.0 + 1.1 + 1.2 + 1.3) / 4:.4f}" and lines[4]["audio"] == "0.7000"
    assert lines[8]["audio"] == "-", "no step since the last line had sound"
    assert lines[8]["video"] == f"{(1.4 + 1.5 + 1.6 + 1.7) / 4:.4f}"
    assert lines[12]["audio"] == "0.5000"
    assert all("loss" not in line for line in lines.values())


def test_console_shows_the_total_only_for_rows_without_modality_losses(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _console_lines(capsys, 2, [{"loss": 0.25, "grad_norm": 1.0}, {"loss": 0.125}])
    assert lines == {1: {"loss": "0.2500", "grad_norm": "1"}, 2: {"loss": "0.1250"}}


def test_resume_appends_and_keeps_the_abandoned_steps_aside(tmp_path: Path) -> None:
    with _logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, _metrics(step))
    earlier = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # The checkpoint was at step 3; steps 4 and 5 are redone by the resumed run.
    with _logger(tmp_path, start_step=3) as logger:
        assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        for step in (4, 5, 6):
            logger.log(step, {"loss": 10.0 + step, "grad_norm": 1.0})
    records = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[3]["loss"] == 14.0
    assert records[0]["loss"] == 1.0
    # Never deleted: the abandoned lines, byte for byte, under the resume step's name.
    assert (tmp_path / "metrics.jsonl.abandoned-3").read_text().splitlines() == earlier[3:]
    # A second resume from the same step keeps the first abandoned file too.
    with _logger(tmp_path, start_step=3):
        pass
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl.abandoned-3.2")] == [4, 5, 6]


def test_resume_moves_a_torn_last_line_aside(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    with _logger(tmp_path, start_step=2) as logger:
        logger.log(3, {"loss": 0.8})
    assert [r["step"] for r in _read(path)] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl.abandoned-2").read_text() == '{"step": 3, "lo\n'


def test_resume_at_the_last_logged_step_leaves_no_abandoned_file(tmp_path: Path) -> None:
    with _logger(tmp_path) as logger:
        for step in (1, 2):
            logger.log(step, _metrics(step))
    with _logger(tmp_path, start_step=2) as logger:
        logger.log(3, _metrics(3))
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_non_finite_values_are_strict_json_null_with_a_flag(tmp_path: Path) -> None:
    with _logger(tmp_path, total_steps=2) as logger:
        logger.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
        logger.log(2, {"loss": 0.5, "grad_norm": 1.0, "lr": 1e-3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def strict(text: str) -> Any:
        # What jq, JavaScript and Go accept: no NaN / Infinity tokens.
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON token {name}"))

    first, second = (strict(line) for line in lines)
    assert first == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "nonfinite": ["loss", "grad_norm"]}
    assert "nonfinite" not in second and second["loss"] == 0.5


def test_non_main_rank_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "run"
    cfg = WandbConfig(enabled=True)
    with _logger(log_dir, is_main=False, wandb_cfg=cfg) as logger:
        logger.log(1, _metrics(1))
    assert not log_dir.exists()
    assert capsys.readouterr().err == ""


def test_wandb_offline_run(tmp_path: Path, recwarn: pytest.WarningsRecorder, monkeypatch) -> None:
    import wandb

    from h3train.train.metrics import wandb_sink

    # An offline start takes seconds, more on a loaded machine: what is tested is that the rows
    # logged before it are sent, not how fast it comes up.
    monkeypatch.setattr(wandb_sink, "_WANDB_GRACE_S", 120.0)
    cfg = WandbConfig(enabled=True, project="h3train-test", run_name="offline-test", mode="offline", init_timeout_s=120)
    with _logger(tmp_path, wandb_cfg=cfg, total_steps=2, run_config={"optim": {"lr": 1e-5}}) as logger:
        for step in (1, 2):
            logger.log(step, _metrics(step))
        # wandb starts on a thread of its own; the rows logged meanwhile are sent once it is up.
        assert logger._wandb_ready(final=True) and not logger._wandb_held
    assert wandb.run is None
    assert _wandb_warnings(list(recwarn)) == []
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert len(_read(tmp_path / "metrics.jsonl")) == 2


def test_wandb_init_failure_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise TimeoutError("no network")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = WandbConfig(enabled=True, mode="offline")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with _logger(tmp_path, wandb_cfg=cfg, total_steps=3) as logger:
            for step in (1, 2, 3):
                logger.log(step, _metrics(step))
    messages = _wandb_warnings(record)
    assert len(messages) == 1
    assert "metrics.jsonl" in messages[0] and "no network" in messages[0]
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_wandb_online_without_credentials_warns_without_prompting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    def must_not_init(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("wandb.init reached without credentials")

    monkeypatch.setattr(wandb, "init", must_not_init)
    cfg = WandbConfig(enabled=True, mode="online")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with _logger(tmp_path, wandb_cfg=cfg, total_steps=1) as logger:
            logger.log(1, _metrics(1))
    messages = _wandb_warnings(record)
    assert len(messages) == 1 and "API key" in messages[0]
    assert len(_read(tmp_path / "metrics.jsonl")) == 1


def test_wandb_log_failure_warns_once_across_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    run = _FakeRun()
    monkeypatch.setattr(wandb, "init", lambda *a, **k: run)
    cfg = WandbConfig(enabled=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with _logger(tmp_path, wandb_cfg=cfg, total_steps=4) as logger:
            for step in (1, 2, 3, 4):
                logger.log(step, _metrics(step))
    messages = _wandb_warnings(record)
    assert len(messages) == 1 and "metrics.jsonl" in messages[0]
    # After the first failure wandb is switched off rather than retried every step.
    assert run.log_calls == 1 and run.finished
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_write_resolved_config_keeps_each_attempts_config(tmp_path: Path) -> None:
    path = write_resolved_config(tmp_path / "run", "train:\n  steps: 3\n")
    assert path == tmp_path / "run" / "config.yaml"
    # The same configuration again (a requeued run) adds nothing.
    write_resolved_config(tmp_path / "run", "train:\n  steps: 3\n")
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]
    write_resolved_config(tmp_path / "run", "train:\n  steps: 4\n")
    write_resolved_config(tmp_path / "run", "train:\n  steps: 5\n")
    assert path.read_text() == "train:\n  steps: 5\n"
    assert (path.parent / "config.yaml.previous-1").read_text() == "train:\n  steps: 3\n"
    assert (path.parent / "config.yaml.previous-2").read_text() == "train:\n  steps: 4\n"


def test_plot_reads_a_log_with_null_values(tmp_path: Path) -> None:
    with _logger(tmp_path, progress=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": float("nan") if step == 2 else 1.0 / step, "grad_norm": 0.5})
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "m.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_writes_png(tmp_path: Path) -> None:
    with _logger(tmp_path, progress=False) as logger:
        for step in range(1, 7):
            logger.log(step, _metrics(step))
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "metrics.png")
    assert out == tmp_path / "plots" / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist"), ("", "no step records"), ('{"step": 1, "grad_norm": 0.3}\n', "no finite 'loss'")],
)
def test_plot_metrics_rejects_bad_input(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        plot_metrics(path, tmp_path / "out.png")
    assert str(path) in str(info.value)
    assert not (tmp_path / "out.png").exists()


# -- console, null values, resumes -----------------------------------------------------------------


def test_show_prints_a_steps_line_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _logger(tmp_path, total_steps=2) as logger:
        logger.show(1, _metrics(1))
        logger.log(1, _metrics(1))
        # Without `show`, `log` prints it.
        logger.log(2, _metrics(2))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert all("elapsed 0:00:00, eta 0:00:00" in line for line in lines)


def test_none_is_null_in_the_file_and_left_out_of_the_dashboards(tmp_path: Path, monkeypatch) -> None:
    import wandb

    class Run:
        def __init__(self) -> None:
            self.logged: list[dict[str, Any]] = []

        def log(self, data: dict[str, Any], step: int | None = None) -> None:
            self.logged.append(data)

        def finish(self, exit_code: int | None = None) -> None:
            pass

    run = Run()
    monkeypatch.setattr(wandb, "init", lambda *a, **k: run)
    with _logger(tmp_path, wandb_cfg=WandbConfig(enabled=True), total_steps=1) as logger:
        logger.log(1, {"loss": 0.5, "loss_audio": None})
        assert logger._wandb_ready(final=True)
    (row,) = _read(tmp_path / "metrics.jsonl")
    assert row == {"step": 1, "loss": 0.5, "loss_audio": None}
    assert run.logged == [{"loss": 0.5}]


def test_the_first_row_of_a_resumed_run_says_so(tmp_path: Path) -> None:
    with _logger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, _metrics(step))
    with _logger(tmp_path, start_step=2) as logger:
        for step in (3, 4):
            logger.log(step, _metrics(step))
    rows = _read(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("resumed")) for r in rows] == [(1, None), (2, None), (3, True), (4, None)]


# -- TensorBoard --------------------------------------------------------------------------------------


def _events(folder: Path) -> Any:
    """The TensorBoard events under `folder`, every one kept (tensorboard's `EventAccumulator`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"images": 0, "audio": 0, "tensors": 0, "scalars": 0})
    events.Reload()
    return events


def test_tensorboard_gets_the_rows_and_the_clips(tmp_path: Path) -> None:
    import torch

    from h3train.encode.media import moving_pattern
    from h3train.render.pipeline import write_clip

    clip = write_clip(tmp_path / "clips", "x", moving_pattern(22, 64, 96, 0), torch.zeros(2, 32000), 32000)
    with _logger(tmp_path, total_steps=2, progress=False, tensorboard=True) as logger:
        logger.log(1, {"loss": 1.0, "loss_audio": None, "lr": 1e-3})
        logger.log(2, {"loss": 0.5, "loss_audio": 0.25, "lr": 1e-3})
        logger.log_validation(2, {"val/loss": 0.75})
        logger.log_videos(2, {"x": (clip, "a prompt")})
    events = _events(tmp_path / "tensorboard")
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {
        "loss": [(1, 1.0), (2, 0.5)],
        "loss_audio": [(2, 0.25)],
        "lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))],
        "val/loss": [(2, 0.75)],
    }
    (image,) = events.Images("samples/x")
    assert image.step == 2 and image.encoded_image_string.startswith(b"GIF8")
    assert (image.width, image.height) == (96, 64)
    (audio,) = events.Audio("samples/x/audio")
    assert audio.step == 2 and audio.sample_rate == 32000
    # torch's text summary puts its own suffix on the tag.
    (prompt,) = events.Tensors("samples/x/prompt/text_summary")
    assert prompt.step == 2 and prompt.tensor_proto.string_val == [b"a prompt"]


def test_tensorboard_hides_the_steps_a_resumed_run_redoes(tmp_path: Path) -> None:
    with _logger(tmp_path, tensorboard=True) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"loss": float(step)})
    with _logger(tmp_path, start_step=2, tensorboard=True) as logger:
        for step in (3, 4, 5):
            logger.log(step, {"loss": 10.0 + step})
    got = [(e.step, e.value) for e in _events(tmp_path / "tensorboard").Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def test_tensorboard_failure_warns_once_and_the_jsonl_goes_on(tmp_path: Path, monkeypatch) -> None:
    from h3train.train import metrics

    def refuse(self: Any, step: int, values: dict[str, float]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics._TensorBoard, "scalars", refuse)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with _logger(tmp_path, total_steps=3, tensorboard=True) as logger:
            for step in (1, 2, 3):
                logger.log(step, _metrics(step))
    messages = [str(w.message) for w in record if "TensorBoard" in str(w.message)]
    assert len(messages) == 1 and "No space left" in messages[0] and "metrics.jsonl" in messages[0]
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3]


# -- plot ---------------------------------------------------------------------------------------------


def test_smoothing_is_a_debiased_exponential_average_that_skips_gaps() -> None:
    from h3train.tools.curves import SMOOTHING, smoothed

    values = [4.0, 2.0, math.nan, 8.0, 1.0]
    got = smoothed(values)
    finite = [v for v in values if math.isfinite(v)]
    want = []
    for n in range(1, len(finite) + 1):
        weights = [SMOOTHING ** (n - 1 - i) for i in range(n)]
        want.append(sum(w * v for w, v in zip(weights, finite[:n])) / sum(weights))
    assert math.isnan(got[2])
    assert [g for g in got if math.isfinite(g)] == pytest.approx(want)
    assert got[0] == values[0]


def _resumed_log(tmp_path: Path) -> Path:
    """Steps 1-6 with a resume from step 3 (steps 4-5 redone), a null loss_audio, held-out rows and a cosine lr."""
    with _logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {**_metrics(step), "loss_audio": 0.3})
    with _logger(tmp_path, start_step=3) as logger:
        for step in (4, 5, 6):
            audio = None if step == 5 else 0.2 / step
            logger.log(step, {**_metrics(step), "loss_audio": audio, "lr": 1e-3 * math.cos(step / 10)})
            if step == 6:
                logger.log_validation(6, {"val/loss": 0.4, "val/loss_video": 0.3, "val/loss_audio": 0.1})
    return tmp_path / "metrics.jsonl"


def test_plot_draws_smoothed_over_raw_lr_resumes_and_held_out_points(tmp_path: Path) -> None:
    from matplotlib.colors import to_rgba

    from h3train.tools.curves import metrics_figure, smoothed

    path = _resumed_log(tmp_path)
    rows = [r for r in _read(path) if "kind" not in r]
    fig = metrics_figure(path)
    ax_loss, ax_grad, ax_lr = fig.axes[:3]
    video = [r["loss_video"] for r in rows]
    (smooth,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "loss_video"]
    assert list(smooth.get_ydata()) == pytest.approx(smoothed(video))
    (raw,) = [ln for ln in ax_loss.get_lines() if list(ln.get_ydata()) == video and ln is not smooth]
    assert raw.get_alpha() < 0.5 and to_rgba(raw.get_color()) == to_rgba(smooth.get_color())
    (audio,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "loss_audio"]
    assert list(audio.get_xdata()) == [1, 2, 3, 4, 6], "a null step is left out, not drawn at 0"
    labels = ax_loss.get_legend_handles_labels()[1]
    assert "loss" not in labels and "val/loss (held out)" not in labels, "the total is not on the loss panel"
    (held_out,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "val/loss_audio (held out)"]
    assert held_out.get_linestyle() == "None" and held_out.get_marker() == "o"
    assert list(held_out.get_xdata()) == [6] and held_out.get_color() == audio.get_color()
    (lr,) = [ln for ln in ax_lr.get_lines() if ln.get_label() == "lr"]
    assert list(lr.get_ydata()) == pytest.approx([r["lr"] for r in rows])
    for ax in (ax_loss, ax_grad, ax_lr):
        markers = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [3, 3]]
        assert len(markers) == 1, "one marker where the run resumed (from step 3)"


def test_plot_under_cfg_puts_flow_matching_beside_held_out_and_the_objective_on_its_own_axis(
    tmp_path: Path,
) -> None:
    from h3train.tools.curves import metrics_figure

    with _logger(tmp_path) as logger:
        for step in range(1, 5):
            # The calibrated objective is an order of magnitude above the flow-matching loss it calibrates.
            logger.log(step, {**_metrics(step), "loss_video": 23.0 / step, "loss_audio": 21.0 / step,
                              "loss_video_fm": 1.6 / step, "loss_audio_fm": 1.2 / step, "samples": 2})  # fmt: skip
        held_out = {"val/loss": 1.0, "val/loss_video": 0.4, "val/loss_audio": 0.3}
        logger.log_validation(4, {**held_out, "val/loss_video_cfg": 6.0, "val/loss_audio_cfg": 5.0})
    fig = metrics_figure(tmp_path / "metrics.jsonl")
    ax_loss, ax_cfg, *_, ax_samples = fig.axes
    assert len(fig.axes) == 5

    def labels(ax) -> set[str]:
        return {ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")}

    assert labels(ax_loss) == {
        "loss_video_fm", "loss_audio_fm", "val/loss_video (held out)", "val/loss_audio (held out)"
    }  # fmt: skip
    assert labels(ax_cfg) == {
        "loss_video",
        "loss_audio",
        "val/loss_video_cfg (held out)",
        "val/loss_audio_cfg (held out)",
    }
    assert ax_loss.get_ylabel() == "flow-matching loss" and ax_cfg.get_ylabel() == "CFG objective"
    # The objective's size sets no scale on the panel held-out shares: nothing there above the fm losses.
    assert max(max(ln.get_ydata()) for ln in ax_loss.get_lines()) == pytest.approx(1.6)
    (held_out,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "val/loss_video (held out)"]
    (fm,) = [ln for ln in ax_loss.get_lines() if ln.get_label() == "loss_video_fm"]
    assert held_out.get_color() == fm.get_color() and list(held_out.get_ydata()) == [0.4]
    assert {ln.get_label() for ln in ax_samples.get_lines()} >= {"samples"}


def test_plot_loss_curves_smooth_each_modality_over_the_steps_that_have_it() -> None:
    from h3train.tools.curves import loss_curves, smoothed

    audio = [0.9, None, 0.5, None, None, 0.3, 0.1]
    rows = [
        {"step": step, "loss": 1.0 + (a or 0.0), "loss_video": 1.0, "loss_audio": a}
        for step, a in enumerate(audio, start=1)
    ]
    curves = loss_curves(rows)
    assert sorted(curves) == ["loss_audio", "loss_video"], "the total (halved on a silent step) is not drawn"
    assert curves["loss_video"].steps == list(range(1, 8)) and curves["loss_video"].smoothed == pytest.approx([1.0] * 7)
    sounded = [a for a in audio if a is not None]
    assert curves["loss_audio"].steps == [1, 3, 6, 7], "points only at the steps with sound"
    assert curves["loss_audio"].values == sounded
    # Smoothed over the sounded steps alone: a silent step neither pulls it towards 0 nor ages it.
    assert curves["loss_audio"].smoothed == pytest.approx(smoothed(sounded))
    # A file without modality losses (or a video-only run's rows) still has its curve.
    assert sorted(loss_curves([{"step": 1, "loss": 2.0}])) == ["loss"]
    assert sorted(loss_curves([{"step": 1, "loss": 2.0, "loss_video": 2.0, "loss_audio": None}])) == ["loss_video"]


def test_plot_legends_sit_outside_the_axes(tmp_path: Path) -> None:
    from h3train.tools.curves import metrics_figure

    fig = metrics_figure(_resumed_log(tmp_path))
    fig.canvas.draw()
    for ax in fig.axes[:3]:
        legend = ax.get_legend()
        assert legend is not None
        box, area = legend.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= area.x1, "the legend must not cover the data"
        assert box.x1 <= fig.bbox.x1 + 1, "and stays inside the figure"


def test_plot_marks_a_gap_in_the_steps_as_a_resume() -> None:
    from h3train.tools.curves import resume_steps

    rows = [{"step": s} for s in (1, 2, 3, 7, 8)] + [{"step": 9, "resumed": True}, {"step": 10}]
    assert resume_steps(rows) == [6, 8]
