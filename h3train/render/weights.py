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
        from ..export.adapter import trained_partition
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


def default_shape(source: WeightsSource) -> dict[str, Any]:
    """The `frames` and `resolution` of the first of a run's `validation.samples` ({} if it has none):
    a run's renders default to the clip shape it was checked with, not the released model's 124 frames
    at 1344x768, which a stand-in's run never trained at."""
    samples = (saved_config(source).get("validation") or {}).get("samples") or []
    first = samples[0] if samples and isinstance(samples[0], dict) else {}
    return {k: first[k] for k in ("frames", "resolution") if k in first}


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
