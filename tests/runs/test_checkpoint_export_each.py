"""`checkpoint.export`: a LoRA run's adapter files in each checkpoint, and the lines that close a run.

One run of tiny_lora is shared by the module: 2 ranks (FSDP2), background saves, a checkpoint every
step of 4, `keep_last=2` and the best guidance cosine kept, both formats, a held-out pass at start and
after every step. A second, in-process run saves in the foreground with the diffusers format alone.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
from safetensors.torch import load_file

from h3train.checkpoint import complete_checkpoints, read_trainer_state, step_of
from h3train.cli import main
from h3train.config import load_config
from h3train.errors import ConfigError
from h3train.export.adapter_formats import SAVE_FOLDER
from h3train.lora.base import random_base_state
from h3train.lora.files import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME
from h3train.run.checks import check
from h3train.train.adapter_files import AdapterFiles

from helpers.launch import checkpoint_dir, read_metrics, run_forked, tiny_args
from helpers.paths import ROOT

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
STEPS = 4
BOTH = (DIFFUSERS_WEIGHT_NAME, COMFYUI_WEIGHT_NAME)
# diffusers' H3 loader, when a file's partition is not known to it.
PARTITION_WARNING = "does not say which one it was trained"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("heldout") / "data"
    assert main(["synth", "--out", str(out), "--task", "fl2va", "--num-samples", "2", "--text-dim", "16"]) == 0
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, heldout: Path) -> tuple[Path, str]:
    """(run folder, its stdout): the module's shared 2-rank run."""
    folder = tmp_path_factory.mktemp("each") / "run"
    args = [
        f"train.steps={STEPS}",
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
        "checkpoint.async_save=true",
        "checkpoint.export=both",
        # The guidance turns from the base's as the adapters train fast: the best cosine is an early step.
        "checkpoint.keep_best=val/guidance_cos_video",
        "checkpoint.keep_best_mode=max",
        "optim.lr=3e-2",
        f"validation.dataset={heldout}",
        "validation.every=1",
        "validation.at_start=true",
        "validation.sigmas=[0.3,0.7]",
    ]
    proc = run_forked(tiny_args(folder, *args, config=TINY_LORA), nproc=2)
    return folder, proc.stdout


def _validations(folder: Path) -> list[dict]:
    return [r for r in read_metrics(folder) if r.get("kind") == "validation"]


def _best_step(folder: Path) -> int:
    rows = [r for r in _validations(folder) if r["step"] > 0]
    return max(rows, key=lambda r: r["val/guidance_cos_video"])["step"]


def _base(checkpoint: Path) -> MiniMaxH3Transformer3DModel:
    """The random base the run trained on, as a plain diffusers model (what a user loads the file onto)."""
    state = read_trainer_state(checkpoint)
    model = MiniMaxH3Transformer3DModel(**state["model_config"])
    model.load_state_dict(random_base_state(state["model_config"], int(state["lora_base"]["seed"])))
    return model.float().eval()


class _Messages(logging.Handler):
    """What diffusers logs (its loggers do not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- the files and their checkpoints -----------------------------------------------------------------


def test_each_kept_checkpoint_holds_its_files_and_pruned_ones_went_with_theirs(run: tuple[Path, str]) -> None:
    folder, _ = run
    best = _best_step(folder)
    assert best < STEPS - 1, _validations(folder)
    kept = complete_checkpoints(folder / "checkpoints")
    assert [step_of(p) for p in kept] == sorted({best, STEPS - 1, STEPS})
    for checkpoint in kept:
        assert sorted(p.name for p in (checkpoint / SAVE_FOLDER).iterdir()) == sorted(BOTH)
        assert not list(checkpoint.glob(".tmp-*")), "a temporary folder was left behind"
    for step in set(range(1, STEPS + 1)) - {best, STEPS - 1, STEPS}:
        assert not checkpoint_dir(folder, step).exists()
    leftovers = [p.name for p in (folder / "checkpoints").iterdir() if p not in kept]
    assert leftovers == [], leftovers


def test_the_files_are_what_h3train_export_writes_from_the_checkpoint(run: tuple[Path, str], tmp_path: Path) -> None:
    folder, _ = run
    for checkpoint in complete_checkpoints(folder / "checkpoints"):
        for fmt, name in zip(("diffusers", "comfyui"), BOTH):
            out = tmp_path / f"{checkpoint.name}-{fmt}"
            assert main(["export", str(checkpoint), "--out", str(out), "--format", fmt]) == 0
            assert (checkpoint / SAVE_FOLDER / name).read_bytes() == (out / name).read_bytes(), (checkpoint, fmt)


def test_the_checkpoints_still_verify_and_export_with_their_files(run: tuple[Path, str], tmp_path: Path) -> None:
    folder, _ = run
    newest = complete_checkpoints(folder / "checkpoints")[-1]
    # `h3train export` checks every recorded digest first; `--merge` reads the whole checkpoint.
    assert main(["export", str(newest), "--out", str(tmp_path / "merged"), "--merge"]) == 0


def test_diffusers_loads_the_file_into_the_trained_partition_without_a_warning(run: tuple[Path, str]) -> None:
    folder, _ = run
    checkpoint = complete_checkpoints(folder / "checkpoints")[-1]
    file = load_file(checkpoint / SAVE_FOLDER / DIFFUSERS_WEIGHT_NAME)
    assert file and all(k.startswith("transformer.") for k in file)
    heard = _Messages()
    diffusers_logger = logging.getLogger("diffusers")
    diffusers_logger.addHandler(heard)
    try:
        pipe = MiniMaxH3ModularPipeline()
        pipe.update_components(transformer=_base(checkpoint))
        pipe.load_lora_weights(str(checkpoint / SAVE_FOLDER), weight_name=DIFFUSERS_WEIGHT_NAME)
        model = _base(checkpoint)
        model.load_lora_adapter(str(checkpoint / SAVE_FOLDER), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")
    finally:
        diffusers_logger.removeHandler(heard)
    assert not [m for m in heard.messages if PARTITION_WARNING in m], heard.messages
    for loaded in (pipe.transformer, model):
        params = dict(loaded.named_parameters())
        for key, value in file.items():
            module, factor = key.removeprefix("transformer.").rsplit(".lora_", 1)
            mine = params[f"{module}.lora_{factor.replace('.weight', '')}.default_0.weight"]
            torch.testing.assert_close(mine.detach(), value, rtol=0, atol=0)


# -- the closing summary ------------------------------------------------------------------------------

_NUMBER = r"([-+0-9.e]+)"


def test_the_summary_names_the_newest_files_and_the_first_and_last_held_out_values(run: tuple[Path, str]) -> None:
    folder, out = run
    newest = checkpoint_dir(folder, STEPS) / SAVE_FOLDER
    assert f"adapter files: {newest / DIFFUSERS_WEIGHT_NAME}, {newest / COMFYUI_WEIGHT_NAME}" in out.splitlines()
    rows = _validations(folder)
    first, last = rows[0], rows[-1]
    assert (first["step"], last["step"]) == (0, STEPS)
    loss = re.search(
        rf"^held-out loss \(steps 0 -> {STEPS}\): {_NUMBER} -> {_NUMBER} "
        rf"\(video {_NUMBER} -> {_NUMBER}, audio {_NUMBER} -> {_NUMBER}\)$",
        out,
        re.M,
    )
    assert loss is not None, out
    want = [row[k] for k in ("val/loss", "val/loss_video", "val/loss_audio") for row in (first, last)]
    got = [float(loss[i]) for i in (1, 2, 3, 4, 5, 6)]
    assert got == pytest.approx(want, rel=1e-3)
    retention = re.search(r"^guidance retention: (.+)$", out, re.M)
    assert retention is not None, out
    for label, metric in (("ratio", "guidance_ratio"), ("cos", "guidance_cos"), ("drift", "drift")):
        part = re.search(rf"{label} video {_NUMBER} -> {_NUMBER}, audio {_NUMBER} -> {_NUMBER}", retention[1])
        assert part is not None, retention[1]
        want = [row[f"val/{metric}_{m}"] for m in ("video", "audio") for row in (first, last)]
        assert [float(part[i]) for i in (1, 2, 3, 4)] == pytest.approx(want, rel=1e-3, abs=1e-9), label
    assert f"best checkpoint: {checkpoint_dir(folder, _best_step(folder))} (val/guidance_cos_video" in out


# -- a foreground save, one format ------------------------------------------------------------------


def test_a_foreground_save_writes_the_chosen_format_alone(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "run"
    args = ["train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=1", "checkpoint.export=diffusers"]
    assert main(tiny_args(folder, *args, config=TINY_LORA)) == 0
    out = capsys.readouterr().out
    newest = checkpoint_dir(folder, 2)
    assert [step_of(p) for p in complete_checkpoints(folder / "checkpoints")] == [2]
    assert [p.name for p in (newest / SAVE_FOLDER).iterdir()] == [DIFFUSERS_WEIGHT_NAME]
    assert f"adapter file: {newest / SAVE_FOLDER / DIFFUSERS_WEIGHT_NAME}" in out.splitlines()
    assert "held-out loss" not in out and "guidance retention" not in out  # no validation, no line
    assert main(["export", str(newest), "--out", str(tmp_path / "out")]) == 0
    written = (newest / SAVE_FOLDER / DIFFUSERS_WEIGHT_NAME).read_bytes()
    assert written == (tmp_path / "out" / DIFFUSERS_WEIGHT_NAME).read_bytes()
    # A `lora/` already in a checkpoint (someone's own) is never written over: the files are left out.
    copy = tmp_path / "copy" / newest.name
    shutil.copytree(newest, copy)
    (copy / SAVE_FOLDER / DIFFUSERS_WEIGHT_NAME).write_bytes(b"mine")
    files = AdapterFiles("both")
    files(copy)
    assert files.newest == [] and (copy / SAVE_FOLDER / DIFFUSERS_WEIGHT_NAME).read_bytes() == b"mine"
    assert "is saved without its adapter files" in capsys.readouterr().err


# -- settings that cannot work ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["lora.rank=0"], "this run is a full fine-tune (lora.rank=0): set checkpoint.export=none"),
        (["lora.train_modules=[norm_out]"], "lora.train_modules trains weights in full"),
        (["checkpoint.export=all"], "'checkpoint.export' is 'all'; choose one of none, diffusers, comfyui, both"),
        (["lora.kind=loha"], "lora.kind=loha has no diffusers LoRA file"),
        (["lora.kind=lokr", "checkpoint.export=comfyui"], "lora.kind=lokr has no ComfyUI LoRA file"),
    ],
)
def test_settings_no_file_can_hold_are_one_line_before_training(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        check(load_config(TINY_LORA, ["checkpoint.export=diffusers", *overrides]))
    message = str(err.value)
    assert needle in message and "\n" not in message and "checkpoint.export" in message, message


def test_a_format_that_holds_the_kind_passes_the_check() -> None:
    check(load_config(TINY_LORA, ["checkpoint.export=comfyui", "lora.kind=loha"]))
    check(load_config(TINY_LORA, ["checkpoint.export=diffusers", "lora.kind=lokr"]))
