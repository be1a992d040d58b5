"""The one owner of a config's checks beyond its values, run before any process group or model exists.

A config's values are checked as it loads (`config.load_config` runs `config.check_values`, which
knows no kind of any extension table). `check` runs the rest, once per start (`preflight.preflight`, which
`build_trainer` and `h3train check` run; `preflight.load_checked` for a caller that builds nothing): what reads the
task table, the model's constructor and module names and the files the config names, and each chosen
table entry's own check (the data source's, the optimizer kind's, the adapter kind's, the validation
samples'). `check_inputs` then checks what a start reads: the model folder, the datasets, the device.

Each failure is one line naming the key, file or sample and what to do (a `ConfigError`, or a
`DatasetError` / `SampleError` for the data itself), exit code 2. The order of the checks is the
order in which a config with several faults reports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config, dataset_specs, measures_held_out_loss
from ..config.values import resolve_compile
from ..data.dataset import index_entries
from ..data.dataset_index import location_of, resolve_in_folder
from ..data.location import INDEX_NAME
from ..data.mixture import dataset_key, epoch_draws
from ..data.sample_file import read_header
from ..data.source import data_source
from ..data.storage import is_url, planning_folder
from ..debug.faults import parse_faults
from ..errors import ConfigError, DatasetError, one_of
from ..lora.targets import meta_model, resolve_targets, resolve_train_modules
from ..model.architecture import check_model_kwargs, model_dims, planned_model_dims, pretrained_config_file
from ..ops.attention import resolve_attention_backend
from ..optim.kinds import optimizer_kind
from ..render.requests import validate_samples
from ..tasks.partition import check_partition
from ..tasks.table import TRAINING_TASKS, training_task_for


def check(cfg: Config, planning: bool = False) -> None:
    """The checks of `cfg` beyond its values, in order; raises `ConfigError` on the first problem.

    The data source's own check, the task table, the file `cfg.shared_negative_path` names,
    `debug.fault`, whether the optimizer kind can run here (torchao), the model's constructor kwargs
    and head count, the adapter kind's own check, the LoRA module names (on the model built on meta)
    and `lora.init_from`, the `validation.dataset`, then `validation.samples`. Away from the model
    folder the released architecture stands in, as in `planned_model_dims`.

    `planning` (`h3train check` without `--strict`): the check plans a run away from its data, so a
    `validation.dataset` or `validation.components` not on this machine is planned for, not required."""
    _check_run_folders(cfg)
    data_source(cfg).check(cfg)
    if cfg.task.name not in TRAINING_TASKS:
        raise ConfigError(f"config key 'task.name' is {cfg.task.name!r}; {one_of(cfg.task.name, TRAINING_TASKS)}")
    negative = cfg.cfg
    if negative.negative == "shared" and not Path(negative.shared_negative_path).is_file():
        raise ConfigError(
            f"config key 'cfg.shared_negative_path': file '{negative.shared_negative_path}' does not exist"
        )
    parse_faults(cfg.debug.fault)
    missing = optimizer_kind(cfg.optim.name).missing()
    if missing:
        raise ConfigError(missing)
    _check_model_shape(cfg)
    _check_lora(cfg)
    v = cfg.validation
    if measures_held_out_loss(v) and not planning and not (Path(v.dataset) / INDEX_NAME).is_file():
        raise ConfigError(
            f"config key 'validation.dataset': no dataset at '{v.dataset}' (no {INDEX_NAME}); "
            "encode one with 'h3train encode' or write one with 'h3train synth'"
        )
    validate_samples(cfg, planning)


def _check_run_folders(cfg: Config) -> None:
    """`logging.dir` is a folder here: a URL (`infra/objects.py`'s sense) would become a local folder named
    after it (`./s3:/...`), and the run's logs would land where nobody looks. `checkpoint.dir` may be a URL."""
    if cfg.logging.dir and is_url(cfg.logging.dir):
        raise ConfigError(
            f"config key 'logging.dir' is the URL '{cfg.logging.dir}'; a run's logs and its lock are written to "
            "a folder (a shared filesystem on a cluster): give a path, and set checkpoint.dir to the URL to keep "
            "the checkpoints on object storage"
        )
    if cfg.checkpoint.dir and is_url(cfg.checkpoint.dir) and cfg.checkpoint.export != "none":
        raise ConfigError(
            f"config key 'checkpoint.export' is '{cfg.checkpoint.export}': it writes files into each checkpoint's "
            f"folder, and checkpoint.dir is the URL '{cfg.checkpoint.dir}'; set checkpoint.export=none and write "
            "the files from a checkpoint with 'h3train export URL --out DIR'"
        )


def _check_model_shape(cfg: Config) -> None:
    """`model.config` takes the constructor's arguments, and `parallel.sp` divides the attention heads."""
    if cfg.model.config:
        check_model_kwargs(cfg.model.config, "config key 'model.config.", strict_keys=True)
    dims, _ = planned_model_dims(cfg)
    heads = int(dims["num_attention_heads"])
    if heads % cfg.parallel.sp:
        raise ConfigError(
            f"config key 'parallel.sp' = {cfg.parallel.sp} does not divide the model's "
            f"{heads} attention heads; choose a divisor of {heads}"
        )


def _check_lora(cfg: Config) -> None:
    """`lora.init_from` exists, the module names select modules of the model built on meta, and the file fits them.

    The values themselves (rank, alpha, dropout) are checked when the config loads (`config.check_values`).
    """
    lora = cfg.lora
    if lora.rank == 0:
        return
    from ..lora.adapter_kinds import config_kind
    from ..model.quant import check_base_quant

    config_kind(lora).check(lora)
    check_base_quant(lora.base_quant)
    if lora.init_from is not None and not Path(lora.init_from).is_file():
        raise ConfigError(f"config key 'lora.init_from': file '{lora.init_from}' does not exist")
    model = meta_model(cfg)
    targets = resolve_targets(model, lora.target_modules)
    resolve_train_modules(model, lora.train_modules, targets)
    export = cfg.checkpoint.export != "none"
    if lora.init_from is None and not export:
        return
    from ..lora.adapters import adapter_config, adapter_values, add_adapters

    add_adapters(model, cfg)
    if lora.init_from is not None:
        # The file's adapters must fit the configured ones: read and checked now, not after start-up.
        adapter_values(model, cfg)
    if export:
        # Whether each format of `checkpoint.export` holds these adapters, from their shapes alone.
        from ..export.adapter_formats import check_save_formats
        from ..lora.names import export_name, is_adapter_param

        shapes = {export_name(n): torch.zeros(p.shape) for n, p in model.named_parameters() if is_adapter_param(n)}
        check_save_formats(cfg.checkpoint.export, shapes, adapter_config(model))


def device_type(cfg: Config) -> str:
    """The device kind a run of `cfg` trains on here: `cuda` or `cpu`."""
    return "cuda" if cfg.parallel.backend != "gloo" and torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Checked:
    """What `check_inputs` found and decided of a config, before any process group.

    `cfg`: the config as loaded; `device_kind`: where it trains here (`device_type`); `model_dims`: the
    transformer's constructor arguments (the released architecture where `planning` found no model folder);
    `notes`: what was planned for rather than found; `attention_backend`: the diffusers backend it attends
    with here; `compile_blocks`: whether its blocks compile here (None when planning: `h3train check` decides
    it for the GPU it plans, `blueprint.draw`).
    """

    cfg: Config
    device_kind: str
    model_dims: Mapping[str, Any]
    notes: tuple[str, ...]
    attention_backend: str
    compile_blocks: bool | None


def check_inputs(cfg: Config, planning: bool = False) -> Checked:
    """Inputs and device capabilities a `check`ed config names exist, before any model or process group.

    Every check is cheap: the model is built on the meta device, and of the dataset only
    `index.jsonl` and one sample header are read. `planning` (`h3train check`) plans for what it
    cannot see here, the released architecture for a missing model folder and the longest released
    clip for a missing dataset, and notes each such assumption; training needs both.
    """
    notes: list[str] = []
    if planning:
        dims, note = planned_model_dims(cfg)
        notes += [note] if note else []
    else:
        dims = model_dims(cfg)
    if not notes:
        _check_builds(cfg, dims)
    notes += _check_dataset(cfg, dims, required=not planning)
    v = cfg.validation
    if measures_held_out_loss(v) and not (Path(v.dataset) / INDEX_NAME).is_file():
        notes.append(f"validation: no dataset at '{v.dataset}' here; planned its samples as long as the training ones")
    _check_max_rows(cfg)
    _check_pack(cfg)
    check_partition(cfg, data_source(cfg).sample_tasks)
    kind = device_type(cfg)
    backend = resolve_attention_backend(cfg.model.attention_backend, kind, cfg.model.dtype)
    # A compile this device or torch cannot take with packs is refused here, before any process group.
    compiles = None if planning else resolve_compile(cfg, kind)
    if cfg.model.dtype == "bfloat16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("config key 'model.dtype' is 'bfloat16' but this GPU has no bf16 support; use float32")
    return Checked(cfg, kind, dims, tuple(notes), backend, compiles)


def _check_max_rows(cfg: Config) -> None:
    """A source that drops nothing (synthetic samples, one geometry) has no sample longer than `data.max_rows`."""
    bound = cfg.data.max_rows
    source = data_source(cfg)
    if not bound or source.reads_folders:
        return
    found = source.longest(cfg)
    if found is not None and found[0] > bound:
        raise ConfigError(
            f"config key 'data.max_rows' is {bound} but every {source.name} sample packs to {found[0]} rows; "
            "raise data.max_rows or shrink data.synthetic"
        )


def _check_pack(cfg: Config) -> None:
    """`train.global_batch` only with packs; with `data.pack_oversize=refuse`, no sample is longer than a
    pack's `data.pack` rows."""
    budget = cfg.data.pack
    if cfg.train.global_batch < 0 or (cfg.train.global_batch and not budget):
        raise ConfigError(
            f"config key 'train.global_batch' is {cfg.train.global_batch}: it sets the samples of a packed step "
            "(data.pack > 0); without packs a step trains dp x train.grad_accum samples: unset it or set data.pack"
        )
    if not budget or cfg.data.pack_oversize != "refuse":
        return
    found = data_source(cfg).longest(cfg)
    if found is not None and found[0] > budget:
        raise ConfigError(
            f"config key 'data.pack' is {budget} rows but the longest sample ({found[2]}) packs to {found[0]}; "
            "raise data.pack, bound the samples with data.max_rows, or train such samples alone "
            "(data.pack_oversize=alone)"
        )


def _model_source(cfg: Config) -> str:
    if cfg.model.config:
        return "config key 'model.config'"
    return f"config key 'model.pretrained' ('{pretrained_config_file(cfg)}')"


def _check_builds(cfg: Config, dims: dict[str, Any]) -> None:
    """The architecture builds: on the meta device, so a 33 B model costs no memory and a fraction of a second."""
    from diffusers import MiniMaxH3Transformer3DModel

    try:
        with torch.device("meta"):
            MiniMaxH3Transformer3DModel(**dims)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is a bad model config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{_model_source(cfg)} does not build a MiniMaxH3Transformer3DModel ({type(exc).__name__}: {first})"
        ) from None


def _check_dataset(cfg: Config, dims: dict[str, Any], required: bool) -> list[str]:
    """Each cached dataset of `data.path` is there, lists samples of the task, and its text width is
    the model's; a list's weights give every dataset at least one draw per epoch.

    Reads each `index.jsonl` and the header of its first sample that trains: the samples of one
    dataset come from one text encoder, so one header tells the width of all of them.
    """
    data = cfg.data
    if not data_source(cfg).reads_folders:
        return []
    specs = dataset_specs(data)
    sizes, notes = [], []
    for i, spec in enumerate(specs):
        size = _check_one_dataset(cfg, dims, dataset_key(specs, i), planning_folder(spec.path))
        if size is None:
            if data.create_synthetic:
                return []  # written at start-up, with the model's text width
            if required:
                raise ConfigError(
                    f"config key '{dataset_key(specs, i)}': no dataset at '{spec.path}' (no {INDEX_NAME}); encode one "
                    "with 'h3train encode' or write a synthetic one with 'h3train synth'"
                )
            planned = f"data.max_rows={data.max_rows}" if data.max_rows else "the longest released clip"
            notes.append(f"data: no dataset at '{spec.path}' here; planned for {planned}")
        sizes.append(size)
    if not notes:
        epoch_draws(sizes, specs)
    return notes[:1]


def _check_one_dataset(cfg: Config, dims: dict[str, Any], key: str, folder: Path) -> int | None:
    """The number of samples dataset `folder` (config key `key`) trains, None where it has no index."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return None
    try:
        table = index_entries(folder)
    except DatasetError as exc:
        raise DatasetError(f"{exc}; fix the line or rebuild the index with 'h3train index {folder}'") from None
    if not len(table):
        raise DatasetError(
            f"dataset '{folder}': '{index}' lists no samples; encode the data with 'h3train encode' "
            f"or rebuild the index with 'h3train index {folder}'"
        )
    accepted = TRAINING_TASKS[cfg.task.name].sample_tasks
    trained = table.rows_of(accepted)
    if not trained.size:
        found = set(table.task_counts())
        other = "remove it from data.path" if key != "data.path" else f"use a {cfg.task.name} dataset"
        raise ConfigError(
            f"config key 'task.name' is '{cfg.task.name}' (it trains {', '.join(accepted)} samples) but dataset "
            f"'{folder}' ({key}) holds only {', '.join(sorted(found))} samples; use "
            f"task.name={training_task_for(found)} or {other}"
        )
    first = table[int(trained[0])]
    resolve_in_folder(folder, first.file, f"index '{index}'")
    sample = location_of(folder, first)
    width = read_header(sample).specs["prompt_embeds"].shape[-1]
    text_dim = int(dims["text_dim"])
    if width != text_dim:
        raise ConfigError(
            f"{_model_source(cfg)} gives text_dim={text_dim} but dataset '{folder}' holds prompt embeddings "
            f"{width} wide (sample '{sample}'); "
            + (
                f"set model.config.text_dim={width} or encode the data with the matching text encoder"
                if cfg.model.config
                else "encode the data with this model's text encoder, or use the model it was encoded for"
            )
        )
    return len(trained)
