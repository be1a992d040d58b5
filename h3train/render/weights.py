"""What `h3train generate SOURCE` renders with: each kind of SOURCE, told apart from its files alone.

Detection reads names, folder listings, a `config.json` and safetensors headers, never a weight, so a
SOURCE that is none of the kinds is a one-line `UsageError` before any model loads.

- `run`: a run folder (`logging.dir`, it holds `config.yaml`): its newest complete checkpoint
  (`export/transformer.py: checkpoint_to_export`).
- `checkpoint`: a checkpoint folder (`.../checkpoints/step_0000000N`).
- `lora`: a LoRA file in the diffusers format (`pytorch_lora_weights.safetensors`: keys under
  `transformer.` or `transformer_ref.`) or one diffusers converts on load (the ComfyUI format,
  `lora_comfyui.safetensors`, and the other layouts `MiniMaxH3LoraLoaderMixin` reads).
- `transformer`: a diffusers transformer folder (`config.json` of `MiniMaxH3Transformer3DModel` and its
  weights), as `h3train export` writes for a full fine-tune or with `--merge`.

A checkpoint is exported in-process (`export_checkpoint`) into a temporary folder and rendered as the
LoRA file or transformer folder it becomes, so a checkpoint renders as its export does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..errors import UsageError
from ..tasks.table import PARTITIONS

KINDS = ("run", "checkpoint", "lora", "transformer")
# The diffusers class a transformer folder's `config.json` names.
TRANSFORMER_CLASS = "MiniMaxH3Transformer3DModel"
EXPECTED = (
    "a run folder (logging.dir), a checkpoint folder (.../checkpoints/step_N), a LoRA file "
    "(pytorch_lora_weights.safetensors or lora_comfyui.safetensors) or a transformer folder written by h3train export"
)


@dataclass(frozen=True)
class WeightsSource:
    """A detected SOURCE: its kind, its path, and what that kind knows before any weight is read.

    `checkpoint`: the checkpoint a `run` or `checkpoint` renders. `partition`: `transformer` or
    `transformer_ref` where the files say (a LoRA file's key prefix, a checkpoint's trained partition),
    else None. `chosen`: how a run's checkpoint was chosen, for the console.
    """

    kind: str
    path: Path
    checkpoint: Path | None = None
    partition: str | None = None
    chosen: str | None = None


def detect_source(path: str | Path) -> WeightsSource:
    """The kind of `path` (module docstring); anything else is a one-line `UsageError` saying what was expected."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"SOURCE '{path}' does not exist; pass {EXPECTED}")
    if path.is_file():
        if path.suffix == ".safetensors":
            partition = _lora_partition(path)
            if partition is not False:
                return WeightsSource("lora", path, partition=partition)
        raise UsageError(f"SOURCE '{path}' is a file but no LoRA file (no LoRA factors in it); pass {EXPECTED}")
    if _is_transformer_folder(path):
        return WeightsSource("transformer", path)
    from ..checkpoint import METADATA_FILE, STATE_FILE, STEP_DIR
    from ..checkpoint.run_config import CONFIG_FILE

    marked = STEP_DIR.match(path.name) or (path / STATE_FILE).exists() or (path / METADATA_FILE).exists()
    if marked or (path / CONFIG_FILE).is_file():
        from ..checkpoint import is_complete, read_trainer_state
        from ..export.adapter_formats import trained_partition
        from ..export.transformer import checkpoint_to_export

        checkpoint, chosen = checkpoint_to_export(path)
        if not is_complete(checkpoint):
            raise UsageError(f"SOURCE '{checkpoint}' is not a complete h3train checkpoint folder; pass {EXPECTED}")
        partition = trained_partition(read_trainer_state(checkpoint))
        return WeightsSource("checkpoint" if chosen is None else "run", path, checkpoint, partition, chosen)
    if (path / "vae").is_dir() and any((path / p).is_dir() for p in PARTITIONS):
        raise UsageError(f"SOURCE '{path}' is a pipeline folder: pass it as --components, and as SOURCE {EXPECTED}")
    raise UsageError(f"SOURCE '{path}' is a folder of none of the kinds generate takes; pass {EXPECTED}")


def _lora_partition(file: Path) -> str | None | bool:
    """A LoRA file's partition (None: not said, a converted layout loads into `transformer`); False: no LoRA file."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - any unreadable header: not a LoRA file
        return False
    if not keys or not all("lora" in k or k.endswith(".alpha") or "dora_scale" in k for k in keys):
        return False
    prefixes = {k.split(".", 1)[0] for k in keys}
    said = [p for p in PARTITIONS if p in prefixes]
    return said[0] if len(said) == 1 else None


def _is_transformer_folder(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    weights = any(folder.glob("*.safetensors"))
    return isinstance(config, dict) and config.get("_class_name") == TRANSFORMER_CLASS and weights


def saved_config(source: WeightsSource) -> dict[str, Any]:
    """The config a run or checkpoint was trained with (`trainer_state.json`'s copy); {} for files."""
    if source.checkpoint is None:
        return {}
    from ..checkpoint import read_trainer_state

    try:
        return yaml.safe_load(read_trainer_state(source.checkpoint).get("config_yaml") or "") or {}
    except yaml.YAMLError:
        return {}


@dataclass(frozen=True)
class DefaultShape:
    """The `frames` and `resolution` a SOURCE renders at when neither a flag nor a request line says,
    and where they come from (`origin`, in words for the console); `values` is empty when nothing does."""

    values: dict[str, Any]
    origin: str


def default_shape(source: WeightsSource) -> DefaultShape:
    """A run's or checkpoint's render shape: the first of its `validation.samples` (the shape it was checked
    at), else its training canvas (`training_shape`); a stand-in's run never trained at the released
    model's 124 frames at 1344x768, and rendering it there takes minutes for nothing it learnt."""
    saved = saved_config(source)
    samples = (saved.get("validation") or {}).get("samples") or []
    first = samples[0] if samples and isinstance(samples[0], dict) else {}
    values = {k: first[k] for k in ("frames", "resolution") if k in first}
    if values:
        return DefaultShape(values, "the run's first validation.samples request")
    found = training_shape(saved)
    return DefaultShape({}, "") if found is None else found


def training_shape(saved: dict[str, Any]) -> DefaultShape | None:
    """The canvas and clip length a saved config's data had: `data.synthetic`'s one geometry, or the most
    common latent canvas of the `data.path` indexes with the median latent frame count among its samples
    (a typical clip, not the longest: that one can be 15 s). None when the data is not readable here."""
    from ..tasks.table import TRAINING_TASKS
    from .requests import latent_shape

    data = saved.get("data") or {}
    if data.get("source") == "synthetic":
        syn = data.get("synthetic") or {}
        keys = ("num_latent_frames", "latent_height", "latent_width")
        if not all(isinstance(syn.get(k), int) for k in keys):
            return None
        return DefaultShape(latent_shape(*(syn[k] for k in keys)), "the run's training canvas from data.synthetic")
    folders = _dataset_folders(data.get("path"))
    task = TRAINING_TASKS.get(str((saved.get("task") or {}).get("name")))
    geometry = _index_geometry(folders, task.sample_tasks if task is not None else None)
    if geometry is None:
        return None
    canvases, counts = np.unique(geometry[:, 1:3], axis=0, return_counts=True)
    height, width = (int(v) for v in canvases[int(np.argmax(counts))])
    same = geometry[(geometry[:, 1] == height) & (geometry[:, 2] == width)]
    frames = int(np.median(same[:, 0]))
    origin = f"the run's training canvas, the most common in its dataset index{'es' * (len(folders) > 1)}"
    return DefaultShape(latent_shape(frames, height, width), origin)


def _dataset_folders(path: Any) -> list[Path]:
    """The folders of a saved `data.path`: one folder, or a list of folders and `{path: DIR, ...}` mappings."""
    items = path if isinstance(path, list) else [path]
    folders = [item.get("path") if isinstance(item, dict) else item for item in items]
    return [Path(f) for f in folders if isinstance(f, str) and f]


def _index_geometry(folders: list[Path], tasks: tuple[str, ...] | None) -> np.ndarray | None:
    """Every indexed sample's `(num_latent_frames, latent_height, latent_width)` of the tasks a run trains
    (all of them when `tasks` is None), `[N, 3]` int64; None when a folder's index is not readable here."""
    from ..data.dataset import index_entries
    from ..data.location import INDEX_NAME
    from ..errors import DatasetError

    if not folders or not all((f / INDEX_NAME).is_file() for f in folders):
        return None
    parts = []
    for folder in folders:
        try:
            table = index_entries(folder)
        except DatasetError:
            return None
        geometry = np.asarray(table.columns["geometry"])[:, :3]
        parts.append(geometry if tasks is None else geometry[table.rows_of(tasks)])
    geometry = np.concatenate(parts)
    return geometry if len(geometry) else None


def default_components(source: WeightsSource) -> Path | None:
    """The pipeline folder a run or checkpoint trained on or rendered with: `model.pretrained`, else
    `validation.components`, the first that is a components folder; None if it names none."""
    from ..data.components import ComponentsError, check_components_folder

    saved = saved_config(source)
    for section, key in (("model", "pretrained"), ("validation", "components")):
        named = (saved.get(section) or {}).get(key)
        if isinstance(named, str) and named:
            try:
                return check_components_folder(named)
            except ComponentsError:
                continue
    return None
