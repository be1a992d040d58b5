"""A start's checks, in the order a start runs them: load and check a config, check what it reads, plan it.

`load_checked` is where every entry point gets its config (`checks.check` after the value checks of
`load_config`); `preflight` checks the inputs and the device before any process group or model
(`checks.check_inputs`), and `agree_job_device` the device every rank plans against: what
`blueprint.draw` decides the rest of the start from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config, dataset_specs, load_config, measures_held_out_loss
from ..data.dataset import index_entries
from ..data.dataset_index import index_problems
from ..data.location import INDEX_NAME
from ..data.mixture import dataset_key
from ..data.source import data_source
from ..data.storage import is_url, planning_folder
from ..errors import ConfigError, DatasetError
from ..model.architecture import planned_model_dims
from ..parallel.dims import ParallelDims
from ..plan import MemoryPlan
from .checks import Checked, check, check_inputs


def load_checked(path: str | os.PathLike | None, overrides: Sequence[str] = (), planning: bool = False) -> Config:
    """`load_config` and `check`: a config every entry point can start from, or one `ConfigError`.

    `planning`: checked for planning away from the data (`h3train check` without `--strict`).
    """
    cfg = load_config(path, list(overrides))
    check(cfg, planning)
    return cfg


def preflight(cfg: Config, planning: bool = False, world_size: int | None = None) -> Checked:
    """`check`, the mesh against a launch of `world_size` ranks, then `check_inputs` between the checks of
    the datasets' indexes against their files (`check_indexes`: the cheap ones before, the headers after):
    what `check_inputs` found and decided, with its notes of what was planned for rather than found.

    Every start runs it once on a config from `load_config` (`build_trainer`, `h3train check`), before
    any process group. The order is the order in which a config with several faults reports them.
    `planning` reads no sample header: it checks the indexes found here cheaply.
    """
    check(cfg, planning)
    if world_size is not None:
        check_global_batch(cfg, ParallelDims.from_config(cfg.parallel, world_size))
    headers = not planning and reads_every_header()
    check_indexes(cfg, headers=headers, files=True)
    checked = check_inputs(cfg, planning)
    if headers:
        check_indexes(cfg, headers=True, files=False)
    return checked


def reads_every_header() -> bool:
    """Whether this start reads the header of every sample its indexes list (`check_indexes`): a process
    alone does (`h3train check --strict`, which launch.sh runs once per node before torchrun; a
    one-process `train`); the ranks of a launch do not, each would read every header again."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1


def check_indexes(cfg: Config, headers: bool, files: bool = True) -> None:
    """Each cached dataset's `index.jsonl` (`data.path`'s, `validation.dataset`'s) agrees with its sample
    files (`data.dataset_index.index_problems`), or one `DatasetError` naming the dataset, each problem on a line of
    its own and `h3train index DIR`.

    `files`: the cheap checks (a sample id or file listed twice, a listed file missing), which come before
    the model's checks; `headers`: each listed file's header against its line (sample id, task, seq_len,
    geometry, has_audio). The cheap checks that find something add the header checks (when `headers`), so
    that one report names everything. A dataset without an index is left to `check_inputs`, which names it.
    """
    for key, name, folder in _indexed_datasets(cfg):
        if not (folder / INDEX_NAME).is_file():
            continue
        # A dataset on object storage is named by its URL, and written there again rather than re-indexed.
        fix = f"'h3train index {folder}'" if name == str(folder) else f"'h3train shard DIR --out {name}'"
        try:
            table = index_entries(folder)
        except DatasetError as exc:
            raise DatasetError(f"{exc}; fix or delete the line, or rebuild the index with {fix}") from None
        problems = index_problems(folder, table, files=files, headers=headers and not files)
        if problems and files and headers:
            problems = index_problems(folder, table, files=True, headers=True)
        if problems:
            shown = [f"dataset '{name}' {problem}" for problem in problems[:_PROBLEMS_SHOWN]]
            if len(problems) > _PROBLEMS_SHOWN:
                shown.append(f"dataset '{name}': and {len(problems) - _PROBLEMS_SHOWN} more")
            raise DatasetError(
                "\n".join(
                    [
                        f"dataset '{name}' ({key}): {_lines(len(problems))} with its sample files, "
                        f"each below; {'rebuild the index with' if name == str(folder) else 'write it with'} {fix}",
                        *shown,
                    ]
                )
            )


def _lines(count: int) -> str:
    return f"1 line of its {INDEX_NAME} disagrees" if count == 1 else f"{count} lines of its {INDEX_NAME} disagree"


def _indexed_datasets(cfg: Config) -> list[tuple[str, str, Path]]:
    """(config key, the dataset as the config names it, the local folder it is planned from) of each cached
    dataset a run of `cfg` reads: `data.path`'s, and the held-out `validation.dataset` when the run measures
    its loss."""
    found = []
    if data_source(cfg).reads_folders:
        specs = dataset_specs(cfg.data)
        found += [
            (
                dataset_key(specs, i),
                str(spec.path) if is_url(spec.path) else str(planning_folder(spec.path)),
                planning_folder(spec.path),
            )
            for i, spec in enumerate(specs)
        ]
    if measures_held_out_loss(cfg.validation) and cfg.validation.dataset:
        found.append(("validation.dataset", str(Path(cfg.validation.dataset)), Path(cfg.validation.dataset)))
    return found


# The problems of one index a report lists; a dataset re-encoded under its index can have thousands.
_PROBLEMS_SHOWN = 20


def check_global_batch(cfg: Config, dims: ParallelDims) -> None:
    """`train.global_batch` gives each of the step's `dp x grad_accum` micro-batches a sample at least."""
    want, micro_batches = cfg.train.global_batch, dims.dp * cfg.train.grad_accum
    if cfg.data.pack and 0 < want < micro_batches:
        raise ConfigError(
            f"config key 'train.global_batch' is {want}, but a step gives each of its {micro_batches} micro-batches "
            f"(dp {dims.dp} x train.grad_accum {cfg.train.grad_accum}) a sample: set it to at least "
            f"{micro_batches} or lower train.grad_accum"
        )


def device_memory_gib(device_kind: str) -> float:
    """This rank's device memory in GiB: the GPU's total as torch reports it on CUDA, the plan's default
    card elsewhere. A launch plans against every rank's least (`agree_job_device`)."""
    from ..plan import DEFAULT_DEVICE_MEMORY_GIB, GIB

    if device_kind != "cuda":
        return DEFAULT_DEVICE_MEMORY_GIB
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.cuda.get_device_properties(index).total_memory / GIB


@dataclass(frozen=True)
class JobDevice:
    """What every rank of a launch plans against (`agree_job_device`): the least device memory of its ranks
    in GiB, and the slowest GPU kind among them (a `plan.step_time.DEVICE_KINDS` key, for the step time)."""

    memory_gib: float
    gpu_kind: str


def own_job_device(device_kind: str) -> JobDevice:
    """This rank's `JobDevice`: its memory (`device_memory_gib`) and, on CUDA, the kind its GPU's name says;
    elsewhere the plan's default card."""
    from ..plan.step_time import DEFAULT_DEVICE, device_kind_of

    gpu = DEFAULT_DEVICE
    if device_kind == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        gpu = device_kind_of(torch.cuda.get_device_name(index))
    return JobDevice(device_memory_gib(device_kind), gpu)


def agree_job_device(device: torch.device, own: JobDevice | None = None) -> JobDevice:
    """The job's `JobDevice`: every rank's least memory and slowest kind (`own`, default `own_job_device`),
    agreed in one MIN all-reduce over the default group, once at start.

    Memory and kind decide `auto`'s recompute policies and tables. Ranks whose cards report different
    totals (another kind of card, a MIG slice) would each take their own, and issue different collectives.
    """
    from ..plan.step_time import DEVICE_KINDS

    own = own or own_job_device(device.type)
    # DEVICE_KINDS lists the cards slowest first: the least index is the slowest kind.
    kinds = list(DEVICE_KINDS)
    least = torch.tensor([own.memory_gib, float(kinds.index(own.gpu_kind))], dtype=torch.float64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    memory, kind = least.tolist()
    return JobDevice(memory, kinds[int(kind)])


def run_plan(
    cfg: Config,
    dims: ParallelDims,
    device_kind: str,
    memory_gib: float | None = None,
    fused_norm: bool | None = None,
) -> MemoryPlan:
    """The memory plan of this run on its mesh and device (`memory_gib` defaults to `device_memory_gib`), with
    the kernels of `device_kind`: what the start prints and what `model.activation_checkpointing: auto`
    takes its blocks' policies from (`blueprint.draw`). `fused_norm` overrides the norm kernel this
    torch runs on `device_kind` (a plan of another torch's run)."""
    from ..plan import estimate

    memory_gib = device_memory_gib(device_kind) if memory_gib is None else memory_gib
    return estimate(
        planned_model_dims(cfg)[0], dims, cfg, device_memory_gib=memory_gib, device=device_kind, fused_norm=fused_norm
    )
