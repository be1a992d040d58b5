"""Selective activation checkpointing: a `selective` block keeps its attention kernel's outputs and recomputes
everything else, with the gradients of a block that recomputes nothing.

The tiny FL2VA model runs in float64, where recomputation repeats the same kernels on the same values:
each parameter's gradient under `selective` (or a mixed per-block tuple) equals its gradient under `none`
exactly, one sample and a packed sequence, at sp = 1 and on two gloo ranks at sp = 2 under FSDP2. The
attention op runs once per block forward (not again in backward) while the projections run twice, and what a
`selective` block keeps beyond a `full` one is exactly its attention output and logsumexp.
"""

from __future__ import annotations

import sys
import types
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from h3train.config import load_config
from h3train.model import sp_forward
from h3train.model.build import build_model
from h3train.model.sp_forward import ATTENTION_OPS, SequenceParallelH3
from h3train.objective import micro_batch_inputs
from h3train.packing import pack_inputs
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.synthetic import SyntheticSource

from helpers.paths import TINY_FL2VA

# tiny_fl2va: 4 heads x 16 (a = 64), 2 transformer blocks, 1 refiner block; one sample packs 51 rows.
MIXED = ("selective", "full")
POLICIES = ["selective", MIXED, ("none", "selective")]
# The CPU's SDPA kernel, for float64 as for float32 and bfloat16: one op, its output and logsumexp.
CPU_ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _config():
    return load_config(TINY_FL2VA)


def _sample_inputs(cfg, index: int = 0):
    sample = SyntheticSource(cfg.data.synthetic, cfg.model.config["text_dim"], cfg.train.seed)[index]
    return micro_batch_inputs(cfg, sample, step=1, slot=0)


def _inputs(cfg, packed: bool) -> dict:
    """The forward's keyword arguments: one sample, or two samples packed (with their segments)."""
    if not packed:
        return dict(_sample_inputs(cfg).model_inputs)
    pack = pack_inputs([_sample_inputs(cfg, 0), _sample_inputs(cfg, 1)])
    return pack.forward_kwargs()


def _wrapped(cfg, policy, group=None, packed: bool = False) -> SequenceParallelH3:
    model = build_model(cfg, seed=0).to(torch.float64)
    return SequenceParallelH3(model, SequenceParallel(group), activation_checkpointing=policy, packed=packed)


def _loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0].square().mean() + out[1].square().mean()


def _grads(cfg, policy, packed: bool = False) -> dict[str, torch.Tensor]:
    wrapped = _wrapped(cfg, policy, packed=packed)
    _loss(wrapped(**_inputs(cfg, packed))).backward()
    return {name: p.grad for name, p in wrapped.transformer.named_parameters()}


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert g.dtype == torch.float64
        assert torch.equal(got[name], g), f"{what}: gradient of {name} differs by {(got[name] - g).abs().max():.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["one_sample", "packed"])
def test_selective_gradients_equal_none_at_sp1(packed: bool) -> None:
    cfg = _config()
    expected = _grads(cfg, "none", packed)
    assert any(g.abs().sum() > 0 for g in expected.values())
    for policy in POLICIES:
        _assert_equal(_grads(cfg, policy, packed), expected, f"{policy}, packed={packed}")


class _OpCounts(TorchDispatchMode):
    """How often each aten op runs (an op whose saved output a selective block hands back does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _run_counted(cfg, policy, packed: bool = False) -> tuple[Counter[str], Counter[str]]:
    """(ops run, calls of each block's q projection: `refiner` or `block i`) over one forward and backward."""
    wrapped = _wrapped(cfg, policy, packed=packed)
    m = wrapped.transformer
    calls: Counter[str] = Counter()
    for name, blocks in (("refiner", m.token_refiner.refiner_blocks), ("block", m.transformer_blocks)):
        for i, block in enumerate(blocks):
            block.attn.to_q.register_forward_hook(lambda *_, key=f"{name} {i}": calls.update([key]))
    inputs = _inputs(cfg, packed)
    with _OpCounts() as ops:
        _loss(wrapped(**inputs)).backward()
    return ops.counts, calls


@pytest.mark.parametrize("packed", [False, True], ids=["one_sample", "packed"])
def test_selective_runs_attention_once_and_recomputes_the_projections(packed: bool) -> None:
    cfg = _config()
    samples = 2 if packed else 1  # a packed sequence attends once per sample, in every block
    none_ops, none_calls = _run_counted(cfg, "none", packed)
    # The attention op that ran is the one the policy saves: no decomposition into math ops.
    assert CPU_ATTENTION.removesuffix(".default").replace("aten.", "aten::") in ATTENTION_OPS
    attention = [op for op in none_ops if "attention" in op and "backward" not in op]
    assert attention == [CPU_ATTENTION]
    assert none_ops[CPU_ATTENTION] == 3 * samples  # the refiner block and 2 transformer blocks
    assert none_calls == {"refiner 0": 1, "block 0": 1, "block 1": 1}

    ops, calls = _run_counted(cfg, "selective", packed)
    assert ops[CPU_ATTENTION] == 3 * samples
    assert ops[f"{CPU_ATTENTION.removesuffix('.default')}_backward.default"] == 3 * samples
    # The projections are recomputed in backward, the refiner left alone.
    assert calls == {"refiner 0": 1, "block 0": 2, "block 1": 2}
    assert ops["aten.mm.default"] > none_ops["aten.mm.default"]

    ops, calls = _run_counted(cfg, MIXED, packed)
    # Block 1 and the refiner are recomputed whole, attention included; block 0 keeps its attention.
    assert ops[CPU_ATTENTION] == 3 * samples + 2 * samples
    assert calls == {"refiner 0": 2, "block 0": 2, "block 1": 2}


def test_selective_keeps_the_attention_output_and_logsumexp_per_row() -> None:
    """A `selective` block keeps, beyond a `full` one, its attention output (a values per row) and the
    kernel's logsumexp (one value per head and row): float64 here, on the CPU's kernel."""
    from h3train.tools.bench_memory import saved_activation_bytes

    cfg = _config()
    inputs = _inputs(cfg, packed=False)
    rows = inputs["position_ids"].shape[0]
    model_cfg = cfg.model.config
    heads, a = model_cfg["num_attention_heads"], model_cfg["num_attention_heads"] * model_cfg["attention_head_dim"]
    saved = {policy: saved_activation_bytes(_wrapped(cfg, policy), inputs) for policy in ("full", MIXED, "selective")}
    assert saved[MIXED] - saved["full"] == rows * (a + heads) * 8
    # Both blocks selective: the refiner is not recomputed, and keeps its own activations.
    assert saved["selective"] - saved["full"] > 2 * rows * (a + heads) * 8


def _sp2_grads(rank: int, world: int) -> dict:
    """On each of two ranks at sp = 2 under FSDP2: every parameter's full gradient for each policy, one
    sample and two packed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    cfg = _config()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for packed in (False, True):
        inputs = _inputs(cfg, packed)
        for policy in ("none", *POLICIES):
            wrapped = _wrapped(cfg, policy, group=dist.group.WORLD, packed=packed)
            m = wrapped.transformer
            for block in [*m.token_refiner.refiner_blocks, *m.transformer_blocks]:
                fully_shard(block, mesh=mesh)
            fully_shard(wrapped, mesh=mesh)
            _loss(wrapped(**inputs)).backward()
            results[packed, policy] = {name: p.grad.full_tensor() for name, p in m.named_parameters()}
    return results


@pytest.mark.slow
def test_selective_gradients_equal_none_at_sp2_under_fsdp2() -> None:
    from helpers.ranks import run_ranks

    cfg = _config()
    ranks = run_ranks(_sp2_grads, 2)
    for packed in (False, True):
        unsharded = _grads(cfg, "none", packed)
        for rank, results in enumerate(ranks):
            expected = results[packed, "none"]
            for policy in POLICIES:
                _assert_equal(results[packed, policy], expected, f"rank {rank}, {policy}, packed={packed}")
            # And sp = 2 gives the unsharded gradient (the contract), to float64 rounding.
            for name, g in unsharded.items():
                torch.testing.assert_close(expected[name], g, rtol=1e-10, atol=1e-13, msg=name)


def test_flash_attn_ops_are_saved_by_the_names_its_interface_calls(monkeypatch) -> None:
    """flash-attn's interface module, where loaded, names the ops it calls; the policy saves their outputs."""
    policy = sp_forward.attention_saving_policy
    assert policy(None, torch.ops.aten.addmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    interface = types.ModuleType(sp_forward.FLASH_ATTN_INTERFACE)
    interface._wrapped_flash_attn_forward = torch.ops.aten.addmm  # a packet, as flash-attn assigns its op
    interface._wrapped_flash_attn_varlen_forward = torch.ops.aten.baddbmm.default
    monkeypatch.setitem(sys.modules, sp_forward.FLASH_ATTN_INTERFACE, interface)
    assert policy(None, torch.ops.aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.baddbmm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE
