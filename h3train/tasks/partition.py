"""Which of H3's two released checkpoint partitions a run trains, and which sample tasks fit it.

diffusers' MiniMax-H3 pipeline runs `t2va` and `fl2va` requests on the `transformer` partition and
`ref2va` requests on `transformer_ref` (`MiniMaxH3Ref2VACoreDenoiseStep` loads `transformer_ref`).
A fine-tune of one partition therefore only helps the tasks inference routes to it, so:

- `task.name=fl2va` trains `transformer` (t2va + fl2va samples), `ref2va` trains `transformer_ref`.
- `task.name=mixed` from a pretrained folder must name the partition (`model.subfolder`), and is
  refused when the data holds samples of a task inference would run on the other partition.
- `task.name=mixed` on a model built from `model.config` (random init) trains every task into one
  model: there is no released partition to fit.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from .table import PARTITIONS, partition_tasks


def mixed_subfolder(cfg: Config) -> str:
    """`model.subfolder` for a mixed run from a pretrained folder; there is no default to fall back on."""
    if cfg.model.subfolder:
        return cfg.model.subfolder
    raise ConfigError(
        "config key 'model.subfolder' is needed with task.name=mixed and model.pretrained: H3 ships two partitions; "
        "set model.subfolder=transformer (t2va, fl2va samples) or model.subfolder=transformer_ref (ref2va samples)"
    )


def check_partition(cfg: Config, sample_tasks: Callable[[Config], Counter[str] | None]) -> str | None:
    """For `task.name=mixed`: refuse data that does not fit the partition, and say what is trained.

    `sample_tasks(cfg)`: how many samples of each sample task the data holds (`DataSource.sample_tasks`;
    None when that cannot be known yet), read only for a mixed run.

    Returns the line (printed on rank 0 here, so it is said once at start); None for other tasks.
    Raises `ConfigError` for a pretrained mixed run without `model.subfolder`, a subfolder that is
    not one of the partitions, or samples that inference runs on the other partition.
    """
    if cfg.task.name != "mixed":
        return None
    tasks = sample_tasks(cfg)
    if cfg.model.config or not cfg.model.pretrained:
        line = (
            "task.name=mixed: training one model built from model.config on t2va, fl2va and ref2va samples "
            "(no released partition: export it into the partition you will serve it from)"
        )
    else:
        subfolder = mixed_subfolder(cfg)
        partition = Path(subfolder).name
        if partition not in PARTITIONS:
            raise ConfigError(
                f"config key 'model.subfolder' is '{subfolder}', not one of H3's partitions; with task.name=mixed "
                "use transformer (t2va, fl2va samples) or transformer_ref (ref2va samples)"
            )
        fits = partition_tasks(partition)
        if tasks is not None:
            misfits = {task: n for task, n in sorted(tasks.items()) if task not in fits}
            if misfits:
                listed = ", ".join(f"{n} {task}" for task, n in misfits.items())
                other = next(p for p in PARTITIONS if p != partition)
                raise ConfigError(
                    f"config key 'task.name' is 'mixed' training partition '{partition}' ({', '.join(fits)}), but "
                    f"the data holds {listed} samples, which diffusers runs on '{other}'; train those with "
                    f"model.subfolder={other} (or task.name=ref2va / fl2va) on their own dataset"
                )
        served = ", ".join(fits)
        line = f"task.name=mixed: training partition '{partition}' ({served} samples) of {cfg.model.pretrained}"
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return line
