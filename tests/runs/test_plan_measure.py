"""The memory plan against measurement on two gloo ranks: the state a training step leaves on each rank
and the activations a forward keeps, each within `TOLERANCE` of `h3train.plan.estimate`.

One launch (`h3train.tools.bench_memory.run_ranks`) measures every configuration in one process group:

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
`tests/test_plan.py` holds a trained block's constant exactly at sp = 1.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
import torch.distributed as dist

from h3train.config import load_config
from h3train.data.source import build_source
from h3train.infra.quiet import known_notices
from h3train.lora.transforms import model_transforms
from h3train.model.build import build_model, fp32_island_names
from h3train.model.dims import model_dims
from h3train.model.quant import INTEGER_CODES_SHARD
from h3train.model.sp_forward import SequenceParallelH3
from h3train.objective import micro_batch_inputs
from h3train.ops.attention import resolve_attention_backend
from h3train.parallel.dims import ParallelDims
from h3train.parallel.shards import local_tensor
from h3train.parallel.ulysses import SequenceParallel
from h3train.plan import estimate
from h3train.tools.bench_memory import run_ranks, saved_activation_bytes

from reference import ROOT, TINY_FL2VA

pytestmark = pytest.mark.slow

TOLERANCE = 0.10
WORLD = 2
KINDS = {"full": TINY_FL2VA, "lora": ROOT / "configs" / "tiny_lora.yaml"}
# The other adapters and the quantized base, on tiny_lora: (config key overrides) per kind.
# The quantized base is int8 where this torch's FSDP2 shards integer codes, else float8 (1 byte as well).
QUANT = "int8" if INTEGER_CODES_SHARD else "float8"
VARIANTS = {
    "dora": ["lora.use_dora=true"],
    "lokr": ["lora.kind=lokr"],
    f"lora_{QUANT}": [f"lora.base_quant={QUANT}"],
}
# Adapters on one output projection only: nothing before it keeps activations.
HEADS_ONLY = {"video_only": ["lora.target_modules=[video_only]"], "audio_only": ["lora.target_modules=[audio_only]"]}
VARIANTS.update(HEADS_ONLY)
# Two widths of the tiny configs' architecture (4 heads, 2 blocks, 1 refiner block).
WIDTHS = {
    "h128": {"hidden_size": 128, "attention_head_dim": 32, "ffn_dim": 384},
    "h256": {"hidden_size": 256, "attention_head_dim": 64, "ffn_dim": 768},
}
# 160 text rows, 2 keyframes and 6 latent frames of 6 x 8 rows, 2 x 40 audio rows: 624 packed rows.
SAMPLE = {
    "text_len": 160,
    "vision_tokens": 40,
    "num_latent_frames": 6,
    "latent_height": 12,
    "latent_width": 16,
    "num_audio_latents": 40,
}
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


def _config(kind: str, width: str, *overrides: str):
    model = [f"model.config.{k}={v}" for k, v in WIDTHS[width].items()]
    return load_config(KINDS.get(kind, KINDS["lora"]), [*model, *VARIANTS.get(kind, []), *overrides])


def _local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _state(rank: int, world: int, log_dir: str) -> dict[str, dict[str, tuple[int, int]]]:
    """Planned and held bytes of weights, gradients and AdamW state on this rank, after one step."""
    from h3train.run.assemble import build_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    out = {}
    for kind in STATE_KINDS:
        cfg = _config(kind, STATE_WIDTH, f"logging.dir={log_dir}/{kind}", "train.grad_accum=1")
        trainer = build_trainer(cfg)
        try:
            # The gradients are measured between the step's halves: the update frees them.
            step = trainer.forward_backward(1)
            params = list(trainer.model.parameters())
            grads = _local_bytes(p.grad for p in params if p.grad is not None)
            trainer.update(1, step)
            state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
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


def _recompute_bytes(forward: SequenceParallelH3, inputs: dict) -> int:
    """What one block keeps when the checkpointed backward recomputes it: the last block on the inputs
    it sees in this forward, its input needing a gradient as every block's but the first does."""
    block = forward.transformer.transformer_blocks[-1]
    seen = {}
    handle = block.register_forward_pre_hook(lambda module, args: seen.setdefault("args", args))
    with torch.no_grad():
        forward(**inputs)
    handle.remove()
    hidden, temb, adaln_indices, rotary = seen["args"]
    hidden = hidden.detach().requires_grad_()
    args = {"hidden_states": hidden, "temb": temb, "adaln_indices": adaln_indices, "rotary_emb": rotary}
    # The recomputed output is dropped: the backward reads only what the block saved.
    return saved_activation_bytes(block, args) - hidden.numel() * hidden.element_size()


def _as_computed(transformer: torch.nn.Module, dtype: str) -> None:
    """The parameters in the dtypes FSDP2's mixed precision computes with (`model/fsdp.py`): `model.dtype`,
    the float32 islands float32, whatever they are stored in (a LoRA run's base is bfloat16)."""
    islands = tuple(f"{name}." for name in fp32_island_names(transformer))
    for name, param in transformer.named_parameters():
        # FSDP2 casts every floating-point parameter, float8 codes too; int8 codes it gathers as stored.
        if param.dtype.is_floating_point:
            param.data = param.data.to(torch.float32 if name.startswith(islands) else getattr(torch, dtype))


@functools.cache
def _case_config(kind: str, width: str, dtype: str, ckpt: str):
    """A case's config; its sp is the mesh's (`estimate`'s argument), so the sp = 1 and 2 cases share it."""
    sample = [f"data.synthetic.{k}={v}" for k, v in SAMPLE.items()]
    return _config(kind, width, *sample, f"model.dtype={dtype}", f"model.activation_checkpointing={ckpt}")


def _activations(kind: str, width: str, dtype: str, ckpt: str, sp: int) -> tuple[int, int]:
    """(planned, measured) activation bytes of one case on this rank."""
    cfg = _case_config(kind, width, dtype, ckpt)
    transformer = build_model(cfg, cfg.train.seed)
    for transform in model_transforms(cfg):
        transform(transformer, cfg)
    _as_computed(transformer, dtype)
    with known_notices():
        transformer.set_attention_backend(resolve_attention_backend(cfg.model.attention_backend, "cpu", dtype))
    group = dist.group.WORLD if sp > 1 else None
    forward = SequenceParallelH3(transformer, SequenceParallel(group), activation_checkpointing=ckpt)
    ti = micro_batch_inputs(cfg, build_source(cfg, transformer.config.text_dim)[0], step=1, slot=0)
    measured = saved_activation_bytes(forward, ti)
    plan = estimate(model_dims(cfg), ParallelDims(1, 1, sp, sp), cfg)
    # No block is recomputed when nothing before the output projections trains: none kept anything.
    if ckpt == "full" and not (plan.lora is not None and plan.lora.heads_only):
        measured += _recompute_bytes(forward, ti.model_inputs)
    return plan.activation_bytes, measured


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
        out["activations"][case] = _activations(*case)
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
