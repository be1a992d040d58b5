"""The bench's backend parity: every attention backend's gradients against a float32 step, in units of native's
error. Kernels with planted bugs (softmax scale +2 %, dq dropped on a few rows) fail it; SDPA's math kernel passes."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from h3train.model.architecture import model_kwargs
from h3train.ops import attention
from h3train.tools import bench
from h3train.tools.bench import parity

# diffusers kernels no h3train backend runs: the planted kernels stand in for them while the tests run.
SCALE_SLOT, DQ_SLOT = AttentionBackendName._NATIVE_EFFICIENT, AttentionBackendName._NATIVE_FLASH
# Rows of every attention call whose query gradient the planted backward drops, evenly spaced.
DROPPED_ROWS = 16


def _sdpa(query, key, value, scale=None):
    """SDPA's math kernel on diffusers' `[B, S, H, D]` layout."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.permute(0, 2, 1, 3)


def scaled_softmax(query, key, value, scale=None, **_):
    """Attention whose softmax scale is 2 % too large."""
    return _sdpa(query, key, value, scale=1.02 / math.sqrt(query.shape[-1]))


class _DropDq(torch.autograd.Function):
    """The identity on q `[B, S, H, D]`; its backward zeroes the gradient of `DROPPED_ROWS` rows."""

    @staticmethod
    def forward(ctx, query):
        return query.view_as(query)

    @staticmethod
    def backward(ctx, grad):
        rows = torch.linspace(0, grad.shape[1] - 1, DROPPED_ROWS, device=grad.device).long()
        grad = grad.clone()
        grad[:, rows] = 0
        return grad


def dropped_dq(query, key, value, scale=None, **_):
    """Attention whose backward loses the query gradient of a few rows."""
    return _sdpa(_DropDq.apply(query), key, value, scale=scale)


PLANTED = {"scaled_softmax": (SCALE_SLOT, scaled_softmax), "dropped_dq": (DQ_SLOT, dropped_dq)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One parity run on the bench's reduced model: native, native again, math and the planted kernels."""
    added = []
    with pytest.MonkeyPatch.context() as mp:
        for name, (slot, kernel) in PLANTED.items():
            mp.setitem(_AttentionBackendRegistry._backends, slot, kernel)
            attention.register_attention_backend(attention.AttentionBackend(name, slot.value, trains=False))
            added.append(name)
        attention.register_attention_backend(attention.AttentionBackend("native_again", "native", trains=False))
        added.append("native_again")
        active = _AttentionBackendRegistry._active_backend
        try:
            dims = model_kwargs({**bench.REDUCED_DIMS, "num_layers": 2})
            backends = ["native", "native_again", "math", *PLANTED]
            yield parity.backend_parity(
                dims, bench.REDUCED_CLIP, backends, torch.device("cpu"), 0, tmp_path_factory.mktemp("parity")
            )
        finally:
            _AttentionBackendRegistry.set_active_backend(active)
            for name in added:
                attention.ATTENTION_BACKENDS.pop(name)


def _by_name(run) -> dict[str, parity.Parity]:
    return {p.backend: p for p in run.results}


def test_native_is_its_own_unit_and_a_second_native_step_is_the_same(run) -> None:
    results = _by_name(run)
    assert [p.backend for p in run.results][0] == "native"
    for name in ("native", "native_again"):
        p = results[name]
        assert p.error is None and p.ok and p.ratio == pytest.approx(1.0, abs=1e-6), p
        # bfloat16 against float32: a real error, of the size bfloat16 rounding gives.
        assert 1e-3 < p.max_rel_l2 < 0.1 and p.global_rel_l2 <= p.max_rel_l2
        assert p.parameters > 0


def test_sdpa_math_kernel_passes(run) -> None:
    p = _by_name(run)["math"]
    assert p.error is None and p.ok and p.ratio < 0.8 * p.gate, p


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_kernel_bugs_fail(run, name: str) -> None:
    p = _by_name(run)[name]
    assert p.error is None and not p.ok and p.ratio > 1.25 * p.gate, p
    assert run.ok is False
