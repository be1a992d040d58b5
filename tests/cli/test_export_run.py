"""`h3train export RUN_DIR`: the run's newest complete checkpoint, the `--name` of a LoRA file, and
the lines that say what an export wrote. One tiny LoRA run (checkpoints at steps 2 and 3) is shared;
tests that change a run folder change a copy of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import MiniMaxH3Transformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file

from h3train.cli import main
from h3train.lora.files import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME

from helpers.launch import checkpoint_dir, run_cli, tiny_args, train
from helpers.paths import ROOT

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("export_run") / "run"
    train(tiny_args(folder, "train.steps=3", "checkpoint.every=2", "checkpoint.keep_last=0", config=TINY_LORA))
    assert sorted(p.name for p in (folder / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]
    return folder


def _one_error(err: str) -> str:
    (line,) = err.strip().splitlines()
    assert line.startswith("h3train: error: ")
    return line


def _report(out: str) -> dict[str, str]:
    """The `  key: value` lines `h3train export` prints after its `exported ...` line."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("exported "))
    pairs = (line.split(":", 1) for line in lines[first + 1 :])
    return {key.strip(): value.strip() for key, value in pairs}


def _state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_a_run_folder_exports_its_newest_complete_checkpoint(run, tmp_path, capsys) -> None:
    copy = _copy(run, tmp_path)
    # A later step that never completed (no .metadata) and one being written are not checkpoints to export.
    late = copy / "checkpoints" / "step_00000009"
    late.mkdir()
    shutil.copy(checkpoint_dir(copy, 3) / "trainer_state.json", late)
    (copy / "checkpoints" / ".tmp-step_00000004").mkdir()

    rc, out, _ = run_cli(capsys, ["export", str(copy), "--out", str(tmp_path / "from_run")])
    assert rc == 0
    newest = checkpoint_dir(copy, 3)
    assert f"exporting {newest}: the newest complete checkpoint in {copy / 'checkpoints'}" in out
    assert f"exported {newest} to {tmp_path / 'from_run'}" in out

    for step in (2, 3):
        assert (
            run_cli(capsys, ["export", str(checkpoint_dir(copy, step)), "--out", str(tmp_path / f"step{step}")])[0] == 0
        )
    got = load_file(tmp_path / "from_run" / DIFFUSERS_WEIGHT_NAME)
    for step, same in ((3, True), (2, False)):
        want = load_file(tmp_path / f"step{step}" / DIFFUSERS_WEIGHT_NAME)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want) == same, step

    # The checkpoint folder itself (a `checkpoint.dir`) picks the same.
    rc, out, _ = run_cli(capsys, ["export", str(copy / "checkpoints"), "--out", str(tmp_path / "from_root")])
    assert rc == 0 and f"exporting {newest}:" in out


def test_a_run_folder_whose_config_names_another_checkpoint_dir(run, tmp_path, capsys) -> None:
    copy = _copy(run, tmp_path)
    elsewhere = tmp_path / "elsewhere" / "ckpts"
    elsewhere.parent.mkdir()
    shutil.move(copy / "checkpoints", elsewhere)
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["checkpoint"]["dir"] = str(elsewhere)
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))

    rc, out, _ = run_cli(capsys, ["export", str(copy), "--out", str(tmp_path / "lora")])
    assert rc == 0
    assert f"exporting {elsewhere / 'step_00000003'}: the newest complete checkpoint in {elsewhere}" in out


def test_a_folder_without_a_complete_checkpoint_is_one_line_naming_what_it_holds(run, tmp_path, capsys) -> None:
    empty_run = tmp_path / "unsaved"
    (empty_run / "checkpoints" / ".tmp-step_00000002").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run / name, empty_run)
    out = tmp_path / "lora"
    rc, _, err = run_cli(capsys, ["export", str(empty_run), "--out", str(out)])
    line = _one_error(err)
    assert rc == 2 and f"no complete checkpoint in run folder '{empty_run}'" in line
    assert "checkpoints/, config.yaml, metrics.jsonl" in line and ".tmp-step_00000002/" in line
    assert not out.exists()

    (tmp_path / "bare").mkdir()
    rc, _, err = run_cli(capsys, ["export", str(tmp_path / "bare"), "--out", str(out)])
    assert rc == 2 and f"'{tmp_path / 'bare'}' holds nothing" in _one_error(err)
    assert f"there is no '{tmp_path / 'bare' / 'checkpoints'}'" in err
    rc, _, err = run_cli(capsys, ["export", str(tmp_path / "gone"), "--out", str(out)])
    assert rc == 2 and "does not exist" in _one_error(err)
    assert not out.exists()


def test_export_says_what_it_wrote(run, tmp_path, capsys) -> None:
    checkpoint = checkpoint_dir(run, 3)
    state = _state(checkpoint)
    rank, alpha = state["lora"]["r"], state["lora"]["lora_alpha"]
    cases = {
        "diffusers": ([], "diffusers LoRA file", DIFFUSERS_WEIGHT_NAME),
        "comfyui": (["--format", "comfyui"], "ComfyUI LoRA file", COMFYUI_WEIGHT_NAME),
        "merged": (["--merge"], "diffusers transformer folder, the LoRA merged into its base", None),
    }
    for name, (extra, kind, file) in cases.items():
        out = tmp_path / name
        rc, printed, _ = run_cli(capsys, ["export", str(checkpoint), "--out", str(out), *extra])
        assert rc == 0, name
        assert "(partition 'transformer': the pipeline's transformer/ folder)" in printed.splitlines()[0]
        report = _report(printed)
        files = sorted(p for p in out.iterdir() if p.is_file())
        tensors = 0
        for f in files:
            if f.suffix == ".safetensors":
                with safe_open(f, "pt") as handle:
                    tensors += len(list(handle.keys()))
        assert report["format"] == kind, name
        assert report["tensors"] == str(tensors) and tensors > 0, name
        assert report["lora"] == f"rank {rank}, alpha {alpha:g}", name
        assert report["bytes"].split()[0] == str(sum(f.stat().st_size for f in files)), name
        assert report["path"] == str(out / file if file else out), name
        if file is None:
            with torch.device("meta"):
                model = MiniMaxH3Transformer3DModel(**state["model_config"])
            assert tensors == len(model.state_dict()), "a merged folder holds every weight"
    assert all(k.startswith("transformer.") for k in load_file(tmp_path / "diffusers" / DIFFUSERS_WEIGHT_NAME))


def test_name_names_the_lora_file(run, tmp_path, capsys) -> None:
    checkpoint = checkpoint_dir(run, 3)
    for extra, default in (([], DIFFUSERS_WEIGHT_NAME), (["--format", "comfyui"], COMFYUI_WEIGHT_NAME)):
        named, plain = tmp_path / f"named{len(extra)}", tmp_path / f"plain{len(extra)}"
        rc, out, _ = run_cli(
            capsys, ["export", str(checkpoint), "--out", str(named), "--name", "my_lora.safetensors", *extra]
        )
        assert rc == 0 and _report(out)["path"] == str(named / "my_lora.safetensors")
        assert [p.name for p in named.iterdir()] == ["my_lora.safetensors"]
        assert main(["export", str(checkpoint), "--out", str(plain), *extra]) == 0
        got, want = load_file(named / "my_lora.safetensors"), load_file(plain / default)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    # diffusers loads the renamed file by its name.
    base = MiniMaxH3Transformer3DModel(**_state(checkpoint)["model_config"])
    base.load_lora_adapter(str(tmp_path / "named0"), weight_name="my_lora.safetensors", prefix="transformer")
    file = load_file(tmp_path / "named0" / "my_lora.safetensors")
    key = next(k for k in file if k.endswith("to_q.lora_B.weight"))
    module = key.removeprefix("transformer.").removesuffix(".lora_B.weight")
    (loaded,) = [p for n, p in base.named_parameters() if n.startswith(f"{module}.lora_B.")]
    assert torch.equal(loaded, file[key]) and file[key].abs().sum() > 0


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--name", "sub/my.safetensors"], "--name 'sub/my.safetensors' is not a plain file name"),
        (["--name", ".."], "--name '..' is not a plain file name"),
        (["--name", "my_lora.bin"], "does not end in .safetensors"),
        (["--name", ".safetensors"], "does not end in .safetensors"),
        (["--name", "x" * 300 + ".safetensors"], "file names take at most 255"),
        (["--name", "my.safetensors", "--merge"], "--merge writes a transformer folder"),
    ],
)
def test_a_bad_name_is_one_line_before_any_work(run, tmp_path, capsys, extra: list[str], says: str) -> None:
    out = tmp_path / "lora"
    rc, _, err = run_cli(capsys, ["export", str(checkpoint_dir(run, 3)), "--out", str(out), *extra])
    assert rc == 2 and says in _one_error(err)
    assert not out.exists()
