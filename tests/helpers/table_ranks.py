"""What the ranks of `tests/runs/test_adaln_tables.py` run: step 1's float64 gradients of several configs.

`table_steps` runs on every rank of one process group (`pack_ranks.run_on_ranks`): for each named list
of overrides it builds a trainer (`build_trainer`, float64 as in `pack_ranks.float64_training`, adapters
too), trains step 1 through `Trainer.forward_backward`, gathers each parameter's full gradient and takes
the update (for the logged loss and grad norm). Each record also says whether the run computed its AdaLN
tables where their weights live, and which of its parameters no FSDP2 unit manages.
"""

from __future__ import annotations

from typing import Any

from helpers.pack_ranks import MicroBatches, StepRecord, close_trainer, float64_training, train_step_one


def _fsdp_unmanaged(model: Any) -> set[str]:
    """Names of the parameters no FSDP2 unit of `model` all-gathers."""
    from torch.distributed.fsdp import FSDPModule

    managed: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            if group is not None:
                managed.update(id(p.sharded_param) for p in group.fsdp_params)
    return {name for name, p in model.named_parameters() if id(p) not in managed}


def float64_adapters() -> None:
    """Adapters (built in float32 by their transform) are trained in float64 too, so that their gradients,
    summed over micro-batches in another order at another layout, agree to float64 rounding."""
    import torch

    import h3train.model.build as build

    def store_trainable(model: Any, dtype: torch.dtype) -> None:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.float64)

    # The builder stores the trainable parameters through `build.apply_transforms`.
    build.store_trainable = store_trainable


def table_steps(config: str, runs: dict[str, list[str]]) -> dict[str, tuple[StepRecord, bool, set[str]]]:
    """On each rank, step 1 of `config` under each entry of `runs`; by name: (record, tables served,
    the parameters no FSDP2 unit manages)."""
    import torch.distributed as dist

    from h3train.config import load_config
    from h3train.run.assemble import build_trainer

    float64_training()
    float64_adapters()
    out = {}
    for name, overrides in runs.items():
        recorder = MicroBatches()
        trainer = build_trainer(load_config(config, overrides), hooks=[recorder])
        start = trainer.parts.batches.state_dict()
        record = train_step_one(trainer, recorder, start, update=True)
        served = getattr(trainer.model, "tables", None) is not None
        out[name] = (record, served, _fsdp_unmanaged(trainer.model))
        close_trainer(trainer)
    dist.barrier()
    dist.destroy_process_group()
    return out
