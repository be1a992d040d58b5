"""The task table (`h3train/tasks/table.py`) is the one definition of H3's tasks, and `task.name=t2va` proves it.

Every reader agrees with the table: the dataset filter, the manifest and render-request schema, the
render core steps (checked against the partition diffusers' block loads), the partition checks, the
synthetic writers and the frame rule. No other module spells a tuple of task names. `task.name=t2va`,
a training task by its table entry alone, trains the `transformer` partition on the t2va samples of a
dataset that also holds fl2va ones, and its LoRA exports under `transformer.`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames
from safetensors import safe_open

from h3train.checkpoint import read_trainer_state, step_dir_name
from h3train.cli import build_parser, main
from h3train.config import load_config
from h3train.data import sample_file as data_format
from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import read_index
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.encode.manifest import ManifestError, read_manifest
from h3train.errors import ConfigError
from h3train.export.adapter_formats import trained_partition
from h3train.lora.files import DIFFUSERS_WEIGHT_NAME
from h3train.render.pipeline import core_step
from h3train.render.requests import _frames
from h3train.tasks import table
from h3train.tasks.synthetic import SyntheticSource
from h3train.tasks.table import (
    PARTITIONS,
    SAMPLE_TASKS,
    TRAINING_TASKS,
    frame_counts_around,
    is_frame_count,
    partition_tasks,
    sample_task_of,
    training_task_for,
)

from helpers.paths import ROOT, TINY_FL2VA

TINY_LORA = ROOT / "configs" / "tiny_lora.yaml"
TINY_TEXT_DIM = 16


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> Path:
    """8 synthetic samples of every sample task: fl2va, ref2va alternating, sample 6 a t2va one."""
    return write_synthetic_dataset(tmp_path_factory.mktemp("mixed"), "mixed", 8, text_dim=8)


def test_table_is_self_consistent() -> None:
    # A leaf: the config, the data and the renderer all import it.
    imports = [n for n in ast.walk(ast.parse(Path(table.__file__).read_text())) if isinstance(n, ast.ImportFrom)]
    assert all(n.level == 0 and not (n.module or "").startswith("h3train") for n in imports)
    assert set(PARTITIONS) == {t.partition for t in SAMPLE_TASKS.values()}
    assert sorted(t for p in PARTITIONS for t in partition_tasks(p)) == sorted(SAMPLE_TASKS)
    for name, task in TRAINING_TASKS.items():
        assert task.name == name and set(task.sample_tasks) <= set(SAMPLE_TASKS)
        if task.partition is not None:
            # A partition's fine-tune helps only the tasks inference routes to it.
            assert set(task.sample_tasks) <= set(partition_tasks(task.partition))
    assert TRAINING_TASKS["t2va"].sample_tasks == ("t2va",) and TRAINING_TASKS["t2va"].partition == "transformer"
    assert {c: sample_task_of(c) for c in (None, "keyframes", "references")} == {
        None: "t2va",
        "keyframes": "fl2va",
        "references": "ref2va",
    }
    assert training_task_for({"t2va"}) == "t2va"
    assert training_task_for({"t2va", "fl2va"}) == "fl2va"
    assert training_task_for({"ref2va"}) == "ref2va"
    assert training_task_for({"fl2va", "ref2va"}) == "mixed"


def test_render_core_steps_are_the_tables_and_load_its_partition() -> None:
    for name, task in SAMPLE_TASKS.items():
        block = core_step(name)
        assert block.__name__ == task.denoise_block
        components = {c.name for c in block().expected_components}
        assert task.partition in components and not (components & set(PARTITIONS)) - {task.partition}


def test_dataset_filter_is_each_training_tasks_sample_tasks(mixed_data: Path) -> None:
    present = {e.task for e in read_index(mixed_data)}
    assert present == set(SAMPLE_TASKS)
    for name, task in TRAINING_TASKS.items():
        dataset = CachedDataset(mixed_data, name)
        assert {e.task for e in dataset.entries} == set(task.sample_tasks)
        assert len(dataset) == sum(e.task in task.sample_tasks for e in read_index(mixed_data))


def test_synthetic_writers_make_only_the_trained_sample_tasks(tmp_path: Path) -> None:
    for name, task in TRAINING_TASKS.items():
        folder = write_synthetic_dataset(tmp_path / name, name, 8, text_dim=8)
        assert {e.task for e in read_index(folder)} == set(task.sample_tasks), name
    cfg = load_config(TINY_FL2VA, [])
    assert cfg.data.synthetic.keyframe_anchors == ["first", "last"]
    # t2va gets text-only samples whatever data.synthetic.keyframe_anchors says; fl2va the anchors.
    t2va = SyntheticSource(cfg.data.synthetic, TINY_TEXT_DIM, 0, "t2va")[0]
    assert t2va.task == "t2va" and t2va.keyframe_anchors == () and t2va.layout.num_condition_video_rows == 0
    fl2va = SyntheticSource(cfg.data.synthetic, TINY_TEXT_DIM, 0, "fl2va")[0]
    assert fl2va.task == "fl2va" and fl2va.keyframe_anchors == ("first", "last")
    with pytest.raises(ConfigError, match="data.source"):
        SyntheticSource(cfg.data.synthetic, TINY_TEXT_DIM, 0, "ref2va")
    synth = next(a for a in build_parser()._actions if a.dest == "command").choices["synth"]
    assert next(a for a in synth._actions if a.dest == "task").choices == tuple(TRAINING_TASKS)


def test_manifest_tasks_and_their_conditioning_fields_are_the_tables(tmp_path: Path) -> None:
    (tmp_path / "a.mp4").touch()
    (tmp_path / "a.png").touch()
    fields = {"keyframes": "first", "references": [{"kind": "image", "path": "a.png"}]}
    for name, task in SAMPLE_TASKS.items():
        row = {"video": "a.mp4", "prompt": "p", "task": name}
        if task.conditioning:
            row[task.conditioning] = fields[task.conditioning]
        (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n")
        [entry] = read_manifest(tmp_path / "m.jsonl")
        assert (bool(entry.keyframes), bool(entry.references)) == (
            task.conditioning == "keyframes",
            task.conditioning == "references",
        )
        for other in set(fields) - {task.conditioning}:
            (tmp_path / "m.jsonl").write_text(json.dumps({**row, other: fields[other]}) + "\n")
            with pytest.raises(ManifestError, match=f"'{other}'"):
                read_manifest(tmp_path / "m.jsonl")
    (tmp_path / "m.jsonl").write_text(json.dumps({"video": "a.mp4", "prompt": "p", "task": "i2v"}) + "\n")
    with pytest.raises(ManifestError, match=", ".join(SAMPLE_TASKS)):
        read_manifest(tmp_path / "m.jsonl")


def test_frame_rule_is_diffusers_and_read_from_the_table() -> None:
    assert data_format.VAE_FRAMES_PER_CHUNK is table.VAE_FRAMES_PER_CHUNK
    assert data_format.VAE_LATENTS_PER_CHUNK is table.VAE_LATENTS_PER_CHUNK
    chunk, latents = table.VAE_FRAMES_PER_CHUNK, table.VAE_LATENTS_PER_CHUNK
    for frames in range(-20, 200):
        aligned = frames >= latents and align_num_frames(frames, chunk, latents) == frames
        assert is_frame_count(frames) == aligned, frames
        below, above = frame_counts_around(frames, 1)
        if is_frame_count(frames, 1):
            assert below == frames == above
        elif frames < chunk + latents:
            assert below == above == chunk + latents
        else:
            assert below < frames < above == below + chunk and is_frame_count(below, 1)
    assert _frames(0, 124) == 124
    with pytest.raises(ConfigError, match=r"is 23; it takes 17 n \+ 5 frames with n >= 1 \(e.g. 22 or 39;"):
        _frames(0, 23)
    with pytest.raises(ConfigError, match=r"\(at least 22;"):
        _frames(0, 5)


def _task_name_collections(path: Path) -> list[int]:
    """Lines of `path` holding a literal tuple, list, set or dict of two or more task names."""
    names = set(SAMPLE_TASKS) | set(TRAINING_TASKS)
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items or len(items) < 2:
            continue
        if all(isinstance(i, ast.Constant) and i.value in names for i in items):
            lines.append(node.lineno)
    return lines


def test_no_module_but_the_table_lists_tasks() -> None:
    package = ROOT / "h3train"
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(package.rglob("*.py"))
        if path != package / "tasks" / "table.py" and (lines := _task_name_collections(path))
    }
    assert found == {}


def test_t2va_trains_only_its_samples_and_exports_into_transformer(tmp_path: Path, capsys) -> None:
    """A LoRA t2va run on a dataset of t2va and fl2va samples: every micro-batch is a t2va one.

    The 8 samples hold 2 t2va ones, so the 3 micro-batches of step 2 (dumped) could not all be t2va
    samples if the run read the fl2va ones too.
    """
    data = write_synthetic_dataset(tmp_path / "data", "fl2va", 8, text_dim=TINY_TEXT_DIM)
    t2va_ids = {e.sample_id for e in read_index(data) if e.task == "t2va"}
    assert len(t2va_ids) == 2 and {e.task for e in read_index(data)} == {"t2va", "fl2va"}
    run = tmp_path / "run"
    overrides = [
        f"logging.dir={run}",
        "task.name=t2va",
        "data.source=cached",
        f"data.path={data}",
        "train.steps=2",
        "train.grad_accum=3",
        "checkpoint.every=2",
        "debug.dump_step=2",
        "logging.progress=false",
    ]
    assert main(["train", str(TINY_LORA), *overrides]) == 0
    meta = json.loads((run / "dump" / "step_2" / "meta.json").read_text())
    read = [(m["sample_id"], m["task"]) for m in meta["micro_batches"]]
    assert len(read) == 3 and all(task == "t2va" and sample_id in t2va_ids for sample_id, task in read), read

    checkpoint = run / "checkpoints" / step_dir_name(2)
    assert trained_partition(read_trainer_state(checkpoint)) == "transformer"
    out = tmp_path / "export"
    capsys.readouterr()
    assert main(["export", str(checkpoint), "--out", str(out)]) == 0
    assert "(partition 'transformer': the pipeline's transformer/ folder)" in capsys.readouterr().out
    with safe_open(str(out / DIFFUSERS_WEIGHT_NAME), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and not k.startswith("transformer_ref.") for k in keys)
