"""The AdaLN lookups of the trainer's model: diffusers' forward, gradients summed in float32."""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
from torch.overrides import TorchFunctionMode

from h3train.config import LossWeights, TimestepConfig, load_config
from h3train.model import adaln
from h3train.model.architecture import model_kwargs
from h3train.model.build import build_meta_model, build_model
from h3train.objective import make_training_inputs
from h3train.tasks.synthetic import clip_sample
from h3train.tools import bench

from helpers.paths import TINY_FL2VA

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BfloatSums(TorchFunctionMode):
    """`index_select(0, ...)` of a bfloat16 table whose backward adds row by row in bfloat16.

    What CUDA's backward of `index_select` does (bfloat16 atomic adds); the CPU's already sums in float32,
    so on the CPU this mode stands in for the GPU's lookup.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.index_select, torch.index_select) and args[0].dtype == torch.bfloat16 and args[1] == 0:
            return args[0][args[2]]  # indexing's backward, `index_put_(accumulate=True)`, adds in the table's dtype
        return func(*args, **(kwargs or {}))


def _diffusers_lookup():
    return BfloatSums() if DEVICE.type == "cpu" else contextlib.nullcontext()


def test_trainer_models_get_the_lookup_and_stay_diffusers_models() -> None:
    cfg = load_config(TINY_FL2VA)
    for model in (build_model(cfg, seed=0), build_meta_model(cfg)):
        plain = type(model)(**model_kwargs(dict(model.config)))
        assert type(model) is type(plain) and list(model.state_dict()) == list(plain.state_dict())
        for block in model.transformer_blocks:
            assert isinstance(block, MiniMaxH3TransformerBlock) and block.forward.__func__ is adaln.block_forward
        assert model.norm_out.forward.__func__ is adaln.norm_out_forward
        adaln.accumulate_adaln_in_float32(model)  # idempotent
        assert model.transformer_blocks[0].forward.__func__ is adaln.block_forward


def test_float32_forward_and_gradients_are_diffusers_own() -> None:
    dims = model_kwargs({**bench.REDUCED_DIMS, "num_layers": 2})
    sample = clip_sample(bench.REDUCED_CLIP, int(dims["text_dim"]), seed=0)
    inputs = make_training_inputs(
        sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights()
    ).model_inputs
    plain = bench.build_bench_model(dims, torch.device("cpu"), torch.float32, seed=0)
    patched = copy.deepcopy(plain)
    adaln.accumulate_adaln_in_float32(patched)
    results = []
    for model in (plain, patched):
        video, audio = model(**inputs, return_dict=False)
        (video.square().mean() + audio.square().mean()).backward()
        results.append((video, audio, {n: p.grad for n, p in model.named_parameters()}))
    (v0, a0, g0), (v1, a1, g1) = results
    assert torch.equal(v0, v1) and torch.equal(a0, a1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_bfloat16_table_gradient_is_the_float32_sum_rounded_once(monkeypatch) -> None:
    # Chunks of 100 rows: the sum runs over several widened pieces.
    monkeypatch.setattr(adaln, "CHUNK_ELEMENTS", 100 * 64)
    gen = torch.Generator().manual_seed(0)
    rows, entries = 4096, 9
    index = torch.randint(0, entries, (rows,), generator=gen)
    grad = torch.randn(rows, 64, generator=gen).bfloat16()
    table = torch.randn(entries, 64, generator=gen).bfloat16().requires_grad_()
    out = adaln.gather_rows(table, index)
    assert torch.equal(out, table.index_select(0, index))
    out.backward(grad)
    assert table.grad.dtype == torch.bfloat16
    assert torch.equal(table.grad, torch.zeros(entries, 64).index_add_(0, index, grad.float()).bfloat16())

    exact = torch.zeros(entries, 64, dtype=torch.float64).index_add_(0, index, grad.double())
    bf16 = table.detach().clone().requires_grad_()
    with BfloatSums():
        bf16.index_select(0, index).backward(grad)

    def error(g):
        return float((g.double() - exact).norm() / exact.norm())

    assert error(bf16.grad) > 5 * error(table.grad)


def test_adaln_weight_gradient_in_bfloat16_is_closer_to_float32() -> None:
    """One block over 2,048 rows and 3 table entries (about 683 rows each): the gradient of its AdaLN
    projection, in bfloat16, against float32, with diffusers' lookup and with `gather_rows`."""
    gen = torch.Generator().manual_seed(0)
    rows, timesteps, hidden = 2048, 1, 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = MiniMaxH3TransformerBlock(hidden, 4, 16, 128, 32, 1e-6, 1e-6).to(DEVICE)
    x = torch.randn(1, rows, hidden, generator=gen).to(DEVICE)
    temb = torch.randn(timesteps, 32, generator=gen).to(DEVICE)
    index = torch.randint(0, 3 * timesteps, (rows,), generator=gen).to(DEVICE)
    angles = (torch.rand(rows, 16, generator=gen) * 6.28).to(DEVICE)
    weight = torch.randn(1, rows, hidden, generator=gen).to(DEVICE)

    def adaln_grad(dtype, patched, lookup=contextlib.nullcontext):
        b = copy.deepcopy(block).to(dtype)
        if patched:
            b.forward = types.MethodType(adaln.block_forward, b)
        with lookup():
            out = b(x.to(dtype), temb, index, (angles.cos().to(dtype), angles.sin().to(dtype)))
            (out.float() * weight).sum().backward()
        return b.adaln_proj.linear.weight.grad.float()

    reference = adaln_grad(torch.float32, False)

    def error(g):
        return float((g - reference).norm() / reference.norm())

    before = error(adaln_grad(torch.bfloat16, False, _diffusers_lookup))
    after = error(adaln_grad(torch.bfloat16, True))
    assert after < before / 2, (before, after)
    assert after == pytest.approx(error(adaln_grad(torch.bfloat16, True, _diffusers_lookup)))
