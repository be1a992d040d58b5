"""A start's decisions, made once: the `Blueprint` every builder of a run's parts reads.

A start decides, from its config, its mesh and the device every rank agreed on (`preflight.agree_job_device`),
whether the blocks compile (`config.values.resolve_compile`), which attention backend runs, whether the AdaLN
tables are served (`plan.tables.choose_tables` under `auto` on CUDA), the memory plan of the setting it takes
(`preflight.run_plan`), what each block recomputes (the plan's choice under `auto` on CUDA), the dtype the
trainable parameters are kept in, and how each step's samples are composed. `draw` makes each of these
decisions once; nothing downstream re-derives one from `cfg`: the model builder, the trainer's
start-up lines, `h3train check`, the rehearsal and the benches take them from the record.

The config-level decisions (compile, attention backend) are taken by `preflight`, before any process group, so
that a refusal is said once per node; the device-level ones need the agreed device, so they follow it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..data.step_composition import StepComposer
from ..optim.kinds import weights_dtype
from ..parallel.dims import ParallelDims
from ..plan import MemoryPlan
from ..plan.step_time import Rates, rates_of_kind
from ..plan.tables import TablesChoice
from .checks import Checked
from .preflight import JobDevice, run_plan


@dataclass(frozen=True)
class Blueprint:
    """Every decision of one start.

    `cfg`: the config with `parallel.adaln_tables` decided (a bool); `configured_tables`: the value as
    configured, which `config.yaml` and checkpoints record. `mesh`: the launch's sizes; `device_kind`: `cuda`
    or `cpu`, whose kernels the plan models; `job`: the memory and card every rank plans against.
    `model_dims`: the transformer's constructor arguments. `memory_plan`: the plan of the setting taken;
    `policies`: one activation-checkpointing policy per block (`plan.BLOCK_POLICIES`); `compile_blocks`:
    whether each block is compiled; `attention_backend`: the diffusers backend name; `trainable_dtype`: what
    the trainable parameters are stored in outside diffusers' float32 islands (`optim.weights_dtype`; the
    blocks compute in `model.dtype`, the islands in float32); `composer`: what each
    step's samples are and where they train (`data.step_composition`); `tables`: both table settings'
    estimates where `auto` weighed them on CUDA, else None.
    """

    cfg: Config
    configured_tables: bool | str
    mesh: ParallelDims
    device_kind: str
    job: JobDevice
    model_dims: Mapping[str, Any]
    memory_plan: MemoryPlan
    policies: tuple[str, ...]
    compile_blocks: bool
    attention_backend: str
    trainable_dtype: torch.dtype
    composer: StepComposer
    tables: TablesChoice | None = None

    def start_lines(self) -> list[str]:
        """What rank 0 prints of the blueprint at start: the tables' choice where `auto` weighed it, the
        memory plan's verdict and what the data's filters leave out."""
        from ..plan import summary
        from ..plan.tables import tables_line

        plan = self.memory_plan
        lines = [tables_line(self.tables)] if self.tables is not None and self.tables.given == "auto" else []
        lines.append(f"memory plan: {summary(plan)} ({plan.rows_origin})")
        return lines + self.data_lines()

    def data_lines(self) -> list[str]:
        """What the data's filters leave out of the run (`task.name`'s sample tasks, `data.max_rows`)."""
        from ..data.source import left_out_lines
        from ..plan import dropped_line

        return [line for line in (*left_out_lines(self.cfg), dropped_line(self.cfg)) if line]

    def announce(self, is_main: bool | None = None) -> None:
        """Print `start_lines` (rank 0; default: `RANK` 0) and, on a GPU, refuse a run over its memory plan
        (`plan.refuse_over_plan`; `train.ignore_memory_plan` overrides). Every rank decides alike."""
        from ..plan import refuse_over_plan

        if is_main if is_main is not None else int(os.environ.get("RANK", "0")) == 0:
            for line in self.start_lines():
                print(line, flush=True)
        refuse_over_plan(self.memory_plan, self.device_kind, self.cfg.train.ignore_memory_plan)


def draw(
    checked: Checked,
    mesh: ParallelDims,
    job: JobDevice,
    *,
    device_kind: str | None = None,
    ranks_per_node: int | None = None,
    plan_of: Callable[[Config], MemoryPlan] | None = None,
    compile_blocks: bool | None = None,
    both_tables: bool = False,
    rates: Rates | None = None,
) -> Blueprint:
    """The blueprint of a start that `preflight` checked as `checked`, on `mesh` and `job`'s agreed device.

    `device_kind` defaults to the checked one (`h3train check` draws a CUDA run's on any machine);
    `ranks_per_node` (default `LOCAL_WORLD_SIZE`, else the world) places the tables' exchanges on links;
    `plan_of(cfg)` plans one setting's memory (default `run_plan` on the mesh, `device_kind` and the job's
    memory; the rehearsal plans its own sample's rows). `compile_blocks` overrides the checked decision
    (the rehearsal compiles nothing on its fake tensors). `both_tables`: on CUDA, estimate both table settings
    even where the config names one (`h3train check` prints them side by side), at `rates` (default: the
    assumed ones of `job`'s card).
    """
    cfg = checked.cfg
    kind = device_kind or checked.device_kind
    if plan_of is None:

        def plan_of(setting: Config) -> MemoryPlan:
            return run_plan(setting, mesh, kind, job.memory_gib)

    rates = rates or rates_of_kind(job.gpu_kind)
    cfg, tables, plan = _tables_and_plan(
        cfg, mesh, checked.model_dims, kind, rates, ranks_per_node, plan_of, both_tables
    )
    layers = int(checked.model_dims["num_layers"])
    policies = _policies(cfg, kind, plan, layers)
    if compile_blocks is None and kind == checked.device_kind:
        compile_blocks = checked.compile_blocks
    if compile_blocks is None:
        from ..config.values import resolve_compile

        compile_blocks = resolve_compile(cfg, kind)
    return Blueprint(
        cfg=cfg,
        configured_tables=checked.cfg.parallel.adaln_tables,
        mesh=mesh,
        device_kind=kind,
        job=job,
        model_dims=checked.model_dims,
        memory_plan=plan,
        policies=policies,
        compile_blocks=compile_blocks,
        attention_backend=checked.attention_backend,
        trainable_dtype=weights_dtype(cfg.optim),
        composer=StepComposer.of(cfg, mesh.dp, checked.model_dims),
        tables=tables,
    )


def _tables_and_plan(
    cfg: Config,
    mesh: ParallelDims,
    model_dims: Mapping[str, Any],
    kind: str,
    rates: Rates,
    ranks_per_node: int | None,
    plan_of: Callable[[Config], MemoryPlan],
    both: bool,
) -> tuple[Config, TablesChoice | None, MemoryPlan]:
    """`cfg` with `parallel.adaln_tables` decided, the choice behind it, and the memory plan of the setting
    taken: each setting planned once. `true` and `false` are kept; `auto` is off on the CPU (no step time to
    estimate) and on CUDA the estimate's choice at `rates` (`plan.tables.choose_tables`, which
    `both` asks for a named setting too)."""
    from ..plan.tables import choose_tables, with_tables

    given = cfg.parallel.adaln_tables
    if kind != "cuda" or (given != "auto" and not both):
        cfg = with_tables(cfg, False) if given == "auto" else cfg
        return cfg, None, plan_of(cfg)
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(mesh.world_size)))
    choice = choose_tables(
        cfg,
        mesh,
        model_dims,
        rates,
        ranks_per_node=per_node,
        plan_of=lambda setting, _mesh: plan_of(setting),
    )
    return with_tables(cfg, choice.served), choice, choice.plans[choice.served]


def _policies(cfg: Config, kind: str, plan: MemoryPlan, layers: int) -> tuple[str, ...]:
    """One policy per block: `auto` takes the plan's choice on CUDA (the least recompute that fits the job's
    memory) and recomputes nothing on the CPU, which has no device memory to fit; a policy as given elsewhere."""
    mode = cfg.model.activation_checkpointing
    if mode != "auto":
        return (mode,) * layers
    if kind != "cuda":
        return ("none",) * layers
    if len(plan.policies) != layers:
        raise ValueError(f"the plan chose {len(plan.policies)} block policies for a model of {layers} blocks")
    return tuple(plan.policies)
