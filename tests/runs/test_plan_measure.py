"""The memory plan against measurement on two gloo ranks: the state a training step leaves on each rank
and the activations a forward keeps, each within `TOLERANCE` of `h3train.plan.estimate`.

One launch (`helpers.ranks.run_ranks`) measures every configuration in one process group:

- state: the trainer's own tensors after one step (`build_trainer`, `Trainer.train_step`), the local
  shards' bytes of the parameters, of their gradients and of AdamW's state on each rank, against the
  plan's weights, gradients and AdamW lines; full fine-tune and LoRA, sharded over both ranks;
- activations: `saved_activation_bytes` of the forward and loss of the config's sample (on the model
  unsharded, as that measure needs), plus, with full checkpointing, what one recomputed block keeps
  (the same measure on the last block alone, without its output, which the recompute drops), against
  the plan's activation line; full fine-tune and LoRA, checkpointing none and full, two widths, sp 1
  and 2. The sp = 1 cases are shared out between the ranks, the sp = 2 ones run on both.

The sample's text rows are about half of a rank's rows at sp = 2, so a plan that left out the text
refiner, or counted a LoRA run's frozen base as trained, misses by far more than the tolerance.
`tests/unit/test_plan.py` holds a trained block's constant exactly at sp = 1.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from h3train.model.architecture import model_dims
from h3train.parallel.shards import local_tensor
from h3train.plan import estimate

from helpers.activations import HEADS_ONLY, KINDS, QUANT, TOLERANCE, VARIANTS, WIDTHS, activations, config
from helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

WORLD = 2
# (adapter, width, compute dtype, checkpointing, sp): every pairing in float32, the tiny configs'
# compute dtype, and a few in bfloat16, whose rotary and prompt casts and norm upcasts differ.
ACTIVATION_CASES = [
    (kind, width, "float32", ckpt, sp)
    for kind in KINDS
    for width in WIDTHS
    for ckpt in ("none", "full")
    for sp in (1, 2)
] + [(kind, "h256", "bfloat16", ckpt, 2) for kind, ckpt in (("full", "none"), ("lora", "full"))]
ACTIVATION_CASES += [
    (kind, "h256", "float32", ckpt, sp)
    for kind in VARIANTS
    for ckpt, sp in (("none", 1 if kind in HEADS_ONLY else 2), ("full", 1))
]
STATE_KINDS = ("full", "lora", f"lora_{QUANT}")
STATE_WIDTH = "h256"


def _case_id(case: tuple) -> str:
    kind, width, dtype, ckpt, sp = case
    return f"{kind}-{width}-{dtype}-ckpt_{ckpt}-sp{sp}"


def _local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _state(rank: int, world: int, log_dir: str) -> dict[str, dict[str, tuple[int, int]]]:
    """Planned and held bytes of weights, gradients and AdamW state on this rank, after one step."""
    from h3train.run.assemble import build_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    out = {}
    for kind in STATE_KINDS:
        cfg = config(kind, STATE_WIDTH, f"logging.dir={log_dir}/{kind}", "train.grad_accum=1")
        trainer = build_trainer(cfg)
        try:
            # The gradients are measured between the step's halves: the update frees them.
            step = trainer.forward_backward(1)
            params = list(trainer.model.parameters())
            grads = _local_bytes(p.grad for p in params if p.grad is not None)
            trainer.update(1, step)
            state = [
                t for s in trainer.parts.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ]
            plan = estimate(model_dims(cfg), trainer.ctx.dims, cfg)
            out[kind] = {
                "weights": (plan.master_weights_bytes, _local_bytes(params)),
                "gradients": (plan.grads_bytes, grads),
                "adamw": (plan.optimizer_bytes, _local_bytes(state)),
            }
        finally:
            # The group stays: the activation cases run in it next.
            trainer.close(clean=False)
    return out


def _worker(rank: int, world: int, log_dir: str) -> dict:
    torch.set_num_threads(1)
    # Every measure collects garbage twice; the imported modules' objects need no second look.
    gc.freeze()
    out: dict = {"state": _state(rank, world, log_dir), "activations": {}}
    alone = 0
    for case in ACTIVATION_CASES:
        if case[-1] == 1:
            alone += 1
            if alone % world != rank:  # another rank measures this one
                continue
        out["activations"][case] = activations(*case)
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("plan_measure")))


def _within(planned: int, held: int) -> None:
    assert held > 0 and abs(planned / held - 1) <= TOLERANCE, f"planned {planned:,} B, measured {held:,} B"


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("term", ["weights", "gradients", "adamw"])
def test_sharded_state_matches_the_trainers_tensors(measured: list[dict], kind: str, term: str) -> None:
    for rank in measured:
        _within(*rank["state"][kind][term])


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=_case_id)
def test_activations_match_what_the_forward_keeps(measured: list[dict], case: tuple) -> None:
    found = [rank["activations"][case] for rank in measured if case in rank["activations"]]
    assert len(found) == (WORLD if case[-1] > 1 else 1)
    for planned, held in found:
        _within(planned, held)
