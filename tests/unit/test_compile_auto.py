"""`model.compile: auto`: the blocks compile where it pays (bfloat16 compute on CUDA, packs where they attend
in one varlen call: `test_packed_attention.py`), decided by `resolve_compile` alone; `true` and `false` stay
explicit, every spelling of them loads, anything else is one line naming the key; a compiling run says what
its first step spent compiling."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3train.cli import main
from h3train.config import Config, load_config
from h3train.config.values import resolve_compile, torch_varlen_available
from h3train.train.trainer import Trainer

from helpers.launch import tiny_args, tiny_overrides
from helpers.paths import TINY_FL2VA

PACK = "data.pack=200"
# Packs compile on CUDA where this torch attends a pack in one call (torch >= 2.10's varlen_attn).
VARLEN = torch_varlen_available()


def _cfg(*overrides: str) -> Config:
    return load_config(TINY_FL2VA, list(overrides))


def _with_compile(folder: Path, value: str) -> Path:
    """The tiny config with `model.compile: value` written into its `model` section."""
    text = TINY_FL2VA.read_text()
    assert text.count("\nmodel:\n") == 1
    config = folder / "c.yaml"
    config.write_text(text.replace("\nmodel:\n", f"\nmodel:\n  compile: {value}\n", 1))
    return config


def _one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3train: error: "), err
    return lines[0]


def test_auto_is_the_default() -> None:
    assert Config().model.compile == "auto"
    assert _cfg().model.compile == "auto"


@pytest.mark.parametrize(
    ("overrides", "device", "compiles"),
    [
        (["model.dtype=bfloat16"], "cuda", True),
        (["model.dtype=float32"], "cuda", False),
        (["model.dtype=bfloat16"], "cpu", False),
        (["model.dtype=bfloat16", PACK], "cuda", VARLEN),
        (["model.dtype=bfloat16", PACK], "cpu", False),
        (["model.dtype=float32", PACK], "cuda", False),
        # Explicit choices are kept, on any device and in any dtype.
        (["model.compile=true"], "cpu", True),
        (["model.compile=true", "model.dtype=float32"], "cuda", True),
        (["model.compile=false", "model.dtype=bfloat16"], "cuda", False),
    ],
)
def test_resolve_compile(overrides: list[str], device: str, compiles: bool) -> None:
    assert resolve_compile(_cfg(*overrides), device) is compiles


def test_a_packed_run_loads_with_auto_and_true_only_where_it_attends_in_one_call(
    capsys: pytest.CaptureFixture,
) -> None:
    assert _cfg("model.dtype=bfloat16", PACK).model.compile == "auto"
    assert _cfg("model.compile=false", PACK).model.compile is False
    # float32 compute has no varlen kernel: refused as the config loads, on any machine.
    assert main(["check", str(TINY_FL2VA), "model.compile=true", PACK]) == 2
    line = _one_line(capsys)
    assert "'model.compile' is true with data.pack=200" in line and "but model.dtype is 'float32'" in line
    # bfloat16: `check` plans a CUDA run, which compiles its packs where this torch has varlen_attn.
    assert main(["check", str(TINY_FL2VA), "model.compile=true", "model.dtype=bfloat16", PACK]) == (0 if VARLEN else 2)
    if not VARLEN:
        assert "has none; set model.compile=false" in _one_line(capsys)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"),
        ("true", True),
        ("false", False),
        ("True", True),
        ("FALSE", False),
        ("on", True),
        ("off", False),
        ("yes", True),
        ("no", False),
    ],
)
def test_every_override_spelling(value: str, expected: object) -> None:
    assert _cfg(f"model.compile={value}").model.compile == expected
    assert type(_cfg(f"model.compile={value}").model.compile) is type(expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", "auto"), ("true", True), ("false", False), ("on", True), ('"true"', True), ("'false'", False)],
)
def test_every_yaml_spelling(tmp_path: Path, value: str, expected: object) -> None:
    assert load_config(_with_compile(tmp_path, value)).model.compile == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("maybe", "'model.compile' is 'maybe'; it takes auto, true or false"),
        ("Auto", "it takes auto, true or false (did you mean 'auto'?)"),
        ("1", "'model.compile' is '1'; it takes auto, true or false"),
        ("2.5", "'model.compile' is '2.5'"),
        ("", "'model.compile' is ''"),
    ],
)
def test_anything_else_is_one_line_naming_the_key(value: str, needle: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(TINY_FL2VA), f"model.compile={value}"]) == 2
    assert needle in _one_line(capsys)


def test_a_number_in_yaml_is_one_line_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(_with_compile(tmp_path, "1"))]) == 2
    assert "config key 'model.compile' is '1'; it takes auto, true or false" in _one_line(capsys)


def test_check_prints_what_the_planned_run_compiles(capsys: pytest.CaptureFixture) -> None:
    for overrides, line in [
        (["model.dtype=bfloat16"], "compile: each transformer block, on CUDA (model.compile: auto)"),
        ([], "compile: off (model.compile: auto: it compiles bfloat16 compute on CUDA)"),
        (
            ["model.dtype=bfloat16", PACK],
            "compile: each transformer block, on CUDA, each pack attending in one varlen call (model.compile: auto)"
            if VARLEN
            else "compile: off (model.compile: auto: it compiles bfloat16 compute on CUDA, packs with torch >= 2.10's "
            "varlen attention, and this torch",
        ),
        ([PACK], "compile: off (model.compile: auto: it compiles bfloat16 compute on CUDA)"),
        (["model.compile=on"], "compile: each transformer block, on CUDA (model.compile: true)"),
        (["model.compile=false", "model.dtype=bfloat16"], "compile: off (model.compile: false)"),
    ]:
        assert main(["check", str(TINY_FL2VA), *overrides]) == 0
        printed = [text for text in capsys.readouterr().out.splitlines() if text.startswith("compile: ")]
        assert len(printed) == 1 and printed[0].startswith(line), (overrides, printed)


def _compiled_blocks(trainer) -> list[bool]:
    """Per transformer block: whether its `forward` is a compiled one (`torch.compile`'s wrapper)."""
    blocks = trainer.model.transformer.transformer_blocks
    return [hasattr(block.forward, "_torchdynamo_orig_callable") for block in blocks]


def test_the_trainer_compiles_what_resolve_compile_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from h3train.run import assemble, checks

    overrides = tiny_overrides(tmp_path, "checkpoint.every=0", "train.steps=1", "model.compile_backend=aot_eager")
    trainer = assemble.build_trainer(load_config(TINY_FL2VA, overrides), hooks=[])
    try:
        assert trainer.device.type == "cpu" and _compiled_blocks(trainer) == [False, False]  # auto, on the CPU
    finally:
        trainer.close()
    asked = []

    def resolved(cfg: Config, device_type: str) -> bool:
        asked.append((cfg.model.compile, device_type))
        return True

    monkeypatch.setattr(checks, "resolve_compile", resolved)
    trainer = assemble.build_trainer(load_config(TINY_FL2VA, overrides), hooks=[])
    try:
        assert _compiled_blocks(trainer) == [True, True]
    finally:
        trainer.close()
    assert asked == [("auto", "cpu")]


@pytest.mark.parametrize(
    ("before", "now", "line"),
    [
        (
            2.0,
            43.2,
            "step 1 spent 41.2 s of its 44.9 s in torch.compile (the blocks; a new sequence length compiles them "
            "once more)",
        ),
        (None, None, "step 1 took 44.9 s, compiling the blocks included"),
    ],
)
def test_the_compile_time_line(
    before: float | None, now: float | None, line: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from h3train.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "compile_seconds", lambda: now)
    trainer = SimpleNamespace(_compile_unsaid=True, _compile_before=before, ctx=SimpleNamespace(is_main=True))
    Trainer._say_compile_time(trainer, 1, {"step_time_s": 44.9})  # type: ignore[arg-type]
    assert capsys.readouterr().err.splitlines() == [line]
    assert trainer._compile_unsaid is False  # said once: `_loop_step` asks no more


def test_compile_seconds_counts_torch_compile() -> None:
    import torch

    from h3train.train.trainer import compile_seconds

    before = compile_seconds()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert before is not None and compile_seconds() > before


def test_a_compiling_run_says_its_first_step_compile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = tiny_args(
        tmp_path / "run", "train.steps=1", "checkpoint.every=0", "model.compile=true", "model.compile_backend=aot_eager"
    )
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "torch.compile" in line]
    assert len(lines) == 1, lines
    pattern = r"step 1 spent (\d+\.\d) s of its (\d+\.\d) s in torch\.compile \(the blocks; .*\)"
    spent, took = map(float, re.fullmatch(pattern, lines[0]).groups())
    assert 0 < spent <= took
