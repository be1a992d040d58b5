"""Every bad input is one line on stderr and exit 2: alone, under torchrun (once), and through launch.sh.

Each case is raised before the process group exists and before any model is built: configs,
command lines, dataset folders (index, task, text width), metrics files and encoder manifests.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from h3train.cli import main
from h3train.commands import process
from h3train.config import load_config
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.encode.manifest import ManifestError, read_manifest
from h3train.parallel.dims import free_port

from helpers.launch import run_env, run_h3train, run_process_group, torchrun_error_line
from helpers.paths import ROOT, TINY_FL2VA

TINY_TEXT_DIM = 16


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bad configs and datasets, written once for the module."""
    root = tmp_path_factory.mktemp("bad_input")
    (root / "list.yaml").write_text("- model\n- train\n")
    (root / "train5.yaml").write_text("train: 5\n")
    (root / "syntax.yaml").write_text("model:\n  dtype: float32\n  config: {num_layers: 2\ntrain:\n  steps: 3\n")
    write_synthetic_dataset(root / "fl2va", task="fl2va", num_samples=3, seed=0, text_dim=TINY_TEXT_DIM)
    write_synthetic_dataset(root / "narrow", task="fl2va", num_samples=3, seed=0, text_dim=8)
    (root / "torn").mkdir()
    (root / "torn" / "index.jsonl").write_text('{"id": "a", "file": \n')
    (root / "empty").mkdir()
    (root / "empty" / "index.jsonl").write_text("")
    return root


def _cached(path: Path, *extra: str) -> list[str]:
    return [str(TINY_FL2VA), "data.source=cached", f"data.path={path}", *extra]


# name -> (train arguments after `train`, text the one line must hold). Every case is found before the
# process group; the subset in `LAUNCHED` also runs under torchrun and launch.sh, one case for each
# thing the start-up reads before the group (the config file, a data file, the data against the model):
# the path from the error to its one line is the same for every case found on that read, and each
# launch costs seconds of imports per rank on two cores.
CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "yaml_list": (lambda d: [str(d / "list.yaml")], ("holds a list at the top level", "list.yaml")),
    "yaml_section_value": (lambda d: [str(d / "train5.yaml")], ("config key 'train'", "is a section and needs keys")),
    "yaml_syntax": (lambda d: [str(d / "syntax.yaml")], ("syntax.yaml:4:6:", "started at line 3, column 11")),
    "bad_type": (
        lambda d: [str(TINY_FL2VA), "model.config.num_attention_heads=abc"],
        ("'model.config.num_attention_heads' is 'abc'", "positive integer"),
    ),
    "bad_shape": (lambda d: [str(TINY_FL2VA), "model.config.patch_size=[1,2]"], ("'model.config.patch_size'",)),
    "bad_fault": (lambda d: [str(TINY_FL2VA), "debug.fault=nan_loss"], ("'debug.fault'", "KIND@STEP")),
    "bad_index": (lambda d: _cached(d / "torn"), ("index.jsonl' line 1", "h3train index")),
    "empty_index": (lambda d: _cached(d / "empty"), ("lists no samples",)),
    "no_dataset": (lambda d: _cached(d / "nowhere"), ("'data.path'", "h3train synth")),
    "wrong_task": (lambda d: _cached(d / "fl2va", "task.name=ref2va"), ("'task.name' is 'ref2va'", "task.name=fl2va")),
    "text_dim": (lambda d: _cached(d / "narrow"), ("text_dim=16", "8 wide", "model.config.text_dim=8")),
    "sp_without_launcher": (lambda d: [str(TINY_FL2VA), "parallel.sp=2"], ("torchrun", "2 ranks")),
    "export_into_url": (
        lambda d: [str(TINY_FL2VA), "lora.rank=4", "checkpoint.dir=s3://bucket/ckpt", "checkpoint.export=diffusers"],
        ("'checkpoint.export' is 'diffusers'", "'s3://bucket/ckpt'", "checkpoint.export=none"),
    ),
}
LAUNCHED = ["yaml_list", "bad_index", "text_dim"]


@pytest.fixture
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_train_input_is_one_line_before_the_process_group(
    name: str, inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture, no_process_group: None
) -> None:
    args, needles = CASES[name]
    log_dir = tmp_path / "run"
    assert main(["train", *args(inputs), f"logging.dir={log_dir}", "logging.progress=false"]) == 2
    err = capsys.readouterr().err
    # Found before any rank joined a process group (the model is built after), and nothing written.
    assert not dist.is_initialized(), err
    assert not log_dir.exists()
    assert err.startswith("h3train: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


def test_a_scalar_where_a_list_is_expected_is_a_one_item_list() -> None:
    assert load_config(TINY_FL2VA, ["debug.fault=nan_loss@2"]).debug.fault == ["nan_loss@2"]
    assert load_config(TINY_FL2VA, ["data.synthetic.keyframe_anchors=last"]).data.synthetic.keyframe_anchors == ["last"]


def test_a_value_for_a_list_or_section_names_the_key(capsys: pytest.CaptureFixture) -> None:
    for override, needle in (
        ("train.steps=[1,2]", "config key 'train.steps' (in the overrides) takes a single value"),
        ("optim=3", "config key 'optim' (in the overrides) is a section"),
        ("train.steps=null", "config key 'train.steps' cannot be null"),
        ("train.steps=three", "config key 'train.steps' is 'three'; it takes an integer"),
        ("model.gradient_checkpointing=maybe", "config key 'model.gradient_checkpointing' is 'maybe'; it takes true"),
    ):
        assert main(["check", str(TINY_FL2VA), override]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_rank_prints_pre_group_errors_once_per_node(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    bad = ["check", str(TINY_FL2VA), "model.config.num_attention_heads=abc"]
    monkeypatch.setattr(process, "_SILENT_RANK_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(bad) == 2
    assert capsys.readouterr().err == ""
    # The first rank of another node may see other files: it speaks.
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(bad) == 2
    assert "num_attention_heads" in capsys.readouterr().err
    # Once the process group exists an error may be this rank's alone: every rank prints it.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert main(bad) == 2
    assert "num_attention_heads" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHED)
def test_torchrun_prints_the_line_once_and_again_last(name: str, inputs: Path, tmp_path: Path) -> None:
    """One rank prints the line; it is repeated after torchrun's report, as the last line."""
    args, needles = CASES[name]
    proc = run_h3train(["train", *args(inputs), f"logging.dir={tmp_path / 'run'}"], nproc=2, check=False, timeout=120)
    line = torchrun_error_line(proc.stderr)
    assert all(n in line for n in needles), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0
    assert "[rank" not in proc.stderr  # no rank's traceback


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHED)
def test_launch_script_checks_first_one_line_exit_2(name: str, inputs: Path, tmp_path: Path) -> None:
    args, needles = CASES[name]
    env = run_env(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        GPUS_PER_NODE="2",
        MASTER_PORT=str(free_port()),
    )
    cmd = [str(ROOT / "scripts" / "launch.sh"), *args(inputs), f"logging.dir={tmp_path / 'run'}"]
    proc = run_process_group(cmd, env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3train: error: "), proc.stderr[-3000:]
    assert all(n in lines[0] for n in needles)


# --- h3train check away from the model and the data ------------------------------------------------


def test_check_plans_from_a_lone_config_json_without_the_dataset(tmp_path: Path, capsys) -> None:
    from h3train.model.architecture import model_defaults

    (tmp_path / "H3" / "transformer").mkdir(parents=True)
    small = {"num_layers": 3, "num_attention_heads": 8}
    (tmp_path / "H3" / "transformer" / "config.json").write_text(json.dumps({"_class_name": "X", **small}))
    config = ROOT / "configs" / "h3_a100_16gpu.yaml"
    extra = [f"model.pretrained={tmp_path / 'H3'}", f"data.path={tmp_path / 'no_data'}"]
    assert main(["check", str(config), "--world-size", "16", *extra]) == 0
    out = capsys.readouterr().out
    assert "assumed: data: no dataset at" in out and "assumed: model" not in out
    assert "3 blocks" in out and "113,126 rows" in out
    assert model_defaults()["num_layers"] != 3
    # Training needs the data; --strict (what launch.sh runs) checks as training does.
    assert main(["check", "--strict", str(config), "--world-size", "16", *extra]) == 2
    assert "'data.path'" in capsys.readouterr().err


def test_check_without_the_model_folder_plans_the_released_architecture(tmp_path: Path, capsys) -> None:
    config = ROOT / "configs" / "h3_a100_16gpu.yaml"
    extra = [f"model.pretrained={tmp_path / 'absent'}", f"data.path={tmp_path / 'no_data'}"]
    assert main(["check", str(config), "--world-size", "16", *extra]) == 0
    out = capsys.readouterr().out
    assert f"assumed: model: '{tmp_path / 'absent' / 'transformer' / 'config.json'}' is not readable here" in out
    assert "33,122,992,896 total" in out and "fits: yes" in out
    assert main(["check", "--strict", str(config), "--world-size", "16", *extra]) == 2
    err = capsys.readouterr().err
    assert "'model.pretrained'" in err and err.count("\n") == 1


def test_a_broken_pretrained_config_json_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"num_layers": "many"}')
    config = ROOT / "configs" / "h3_a100_16gpu.yaml"
    assert main(["check", str(config), "--world-size", "16", f"model.pretrained={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "config.json' key 'num_layers' is 'many'" in err and err.count("\n") == 1
    (tmp_path / "transformer" / "config.json").write_text("{not json")
    assert main(["check", str(config), "--world-size", "16", f"model.pretrained={tmp_path}"]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


# --- h3train plot ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "does not exist"),
        (b"", "holds no step records"),
        (bytes(range(256)) * 8, "holds no step records"),
        (b'{"step": 1, "loss": null}\n', "no finite 'loss' values"),
    ],
)
def test_plot_bad_metrics_file_is_one_line(content: bytes | None, needle: str, tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics.jsonl"
    if content is not None:
        metrics.write_bytes(content)
    assert main(["plot", str(metrics), "--out", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h3train: error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "m.png").exists()


def test_plot_skips_null_values(tmp_path: Path) -> None:
    from h3train.tools.curves import _series, read_metrics

    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "loss": None, "grad_norm": None, "nonfinite": True},
        {"step": 2, "loss": 1.5, "grad_norm": 0.5},
        {"step": 3, "loss": 1.25, "grad_norm": None},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _series(read_metrics(metrics), "loss") == ([2, 3], [1.5, 1.25])
    assert _series(read_metrics(metrics), "grad_norm") == ([2], [0.5])
    assert main(["plot", str(metrics), "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG")


def test_plot_unwritable_out_is_one_line(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "file").write_text("")
    assert main(["plot", str(metrics), "--out", str(tmp_path / "file" / "m.png")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and err.count("\n") == 1


# --- encoder manifests ---------------------------------------------------------------------------------


def _manifest(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_manifest_links_must_resolve_inside_its_folder(tmp_path: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("not a clip")
    folder = tmp_path / "data"
    (folder / "clips").mkdir(parents=True)
    (folder / "clips" / "x.mp4").symlink_to(outside)
    (folder / "clips" / "real.mp4").write_bytes(b"")
    (folder / "clips" / "alias.mp4").symlink_to(folder / "clips" / "real.mp4")
    row = {"video": "clips/x.mp4", "prompt": "p", "task": "t2va"}
    with pytest.raises(ManifestError, match="after links are resolved") as info:
        read_manifest(_manifest(folder / "m.jsonl", [row]))
    assert str(outside) in str(info.value) and "line 1" in str(info.value)
    # A link that stays inside the folder is followed.
    (entry,) = read_manifest(_manifest(folder / "m.jsonl", [{**row, "video": "clips/alias.mp4"}]))
    assert entry.video.path == (folder / "clips" / "real.mp4").resolve()


def test_manifest_reports_every_bad_line_at_once(tmp_path: Path, capsys) -> None:
    good = {"video": "a.mp4", "prompt": "p", "task": "t2va"}
    rows = [
        good,
        {"video": "b.mp4", "prompt": "p", "task": "i2v"},
        "{not json",
        {"video": "c.mp4", "task": "t2va"},
        {**good, "id": "a"},
    ]
    manifest = _manifest(tmp_path / "m.jsonl", rows)
    with pytest.raises(ManifestError) as info:
        read_manifest(manifest)
    message = str(info.value)
    assert message.startswith(f"manifest '{manifest}': 4 bad lines: line 2: field 'task'")
    for needle in ("line 3: not valid JSON", "line 4: field 'prompt' is missing", "line 5: id 'a' is already used"):
        assert needle in message
    assert main(["encode", str(manifest), "--components", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    many = _manifest(tmp_path / "many.jsonl", [good] + [{"video": f"v{i}.mp4", "task": "t2va"} for i in range(9)])
    with pytest.raises(ManifestError, match=r"9 bad lines: .*line 6: .*; and 4 more$"):
        read_manifest(many)


@pytest.mark.parametrize("container", [False, True])
def test_slurm_script_checks_first_one_line_exit_2(container: bool, inputs: Path, tmp_path: Path) -> None:
    """A bad config ends the job before any training step; in a container the check runs as a step in it."""
    bin_dir, log = tmp_path / "bin", tmp_path / "srun.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a01\\n'\n")
    # A stand-in srun: records its argv, runs the command after its options, and reports a failing
    # task in srun's own words.
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        'while [[ "$1" == --* ]]; do shift; done\n'
        '"$@"; s=$?\n'
        '(( s == 0 )) || echo "srun: error: gpu-a01: task 0: Exited with exit code $s" >&2\n'
        "exit $s\n"
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = run_env(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        SLURM_JOB_ID="9",
        SLURM_JOB_NODELIST="gpu-a01",
        SLURM_JOB_NUM_NODES="1",
    )
    if container:
        env["CONTAINER_IMAGE"] = "h3train.sqsh"
    else:
        env.pop("CONTAINER_IMAGE", None)
    proc = run_process_group(["bash", str(ROOT / "scripts" / "slurm.sbatch"), str(inputs / "list.yaml")], env, 60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3train: error: ") and "list.yaml" in lines[0], proc.stderr
    steps = log.read_text().splitlines() if log.exists() else []
    # No training step started: only the check, and only in the container case.
    assert all("launch.sh" not in s for s in steps)
    assert [("--container-image=h3train.sqsh" in s and "h3train check" in s) for s in steps] == ([True] * container)


def test_the_dataset_reuses_the_preflight_parse_of_its_index(tmp_path: Path) -> None:
    """Start-up parses index.jsonl once (preflight, then the dataset), and again only when it changes."""
    from h3train.data.dataset import CachedDataset, index_entries
    from h3train.data.dataset_index import write_index

    data = write_synthetic_dataset(tmp_path / "data", task="fl2va", num_samples=3, seed=0, text_dim=TINY_TEXT_DIM)
    first = index_entries(data)
    assert all(a is b for a, b in zip(first, CachedDataset(data, "fl2va").entries))
    sorted(data.glob("*.safetensors"))[0].unlink()
    write_index(data)
    assert len(index_entries(data)) == len(first) - 1 == len(CachedDataset(data, "fl2va"))
