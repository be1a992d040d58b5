"""Packed attention: each sample of a packed sequence attends over its own rows, in one varlen call where
one runs (torch's `varlen_attn` on CUDA in half precision, flash-attn's with the flash backend), else
once per sample; `model.compile` takes packs only where the one call runs, so that a compiled block
runs every pack composition on one graph.

On the CPU: the path chooser, the refusals, the per-sample path against dense attention under a
block-diagonal mask (float64), and the compile counts of a one-call path whose kernel is a stand-in
custom op (segment by segment, opaque to dynamo like the real one), through `segment_attention` and
through the compiled blocks of a packed model. On CUDA with torch >= 2.10: `varlen_attn` against the
per-sample path in bf16, and the compile counts with the real kernel under inductor, backward included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from h3train.cli import main
from h3train.config import load_config
from h3train.config import values as config_checks
from h3train.config.values import packed_compile_missing, resolve_compile
from h3train.errors import ConfigError
from h3train.ops import attention
from h3train.ops.attention import (
    FLASH_VARLEN,
    PER_SAMPLE,
    TORCH_VARLEN,
    Segments,
    packed_attention_path,
    packed_offsets,
    segment_attention,
    segments_on,
    torch_varlen_available,
)

from helpers.launch import tiny_args
from helpers.paths import TINY_FL2VA

PACK = "data.pack=200"
VARLEN = torch_varlen_available()
CPU = torch.device("cpu")

needs_cuda_varlen = pytest.mark.skipif(
    not (torch.cuda.is_available() and VARLEN),
    reason="torch's varlen_attn runs on CUDA only, and needs torch >= 2.10",
)


# -- which path a pack takes, and when `model.compile` takes packs ---------------------------------------


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "varlen", "path"),
    [
        # The CPU attends sample by sample, whatever the kernel and dtype.
        (None, "cpu", torch.bfloat16, True, PER_SAMPLE),
        ("native", "cpu", torch.float64, True, PER_SAMPLE),
        ("flash", "cpu", torch.bfloat16, True, PER_SAMPLE),
        # CUDA in half precision: torch's one call for every kernel but flash-attn's own.
        (None, "cuda", torch.bfloat16, True, TORCH_VARLEN),
        ("native", "cuda", torch.bfloat16, True, TORCH_VARLEN),
        ("native", "cuda", torch.float16, True, TORCH_VARLEN),
        ("_native_cudnn", "cuda", torch.bfloat16, True, TORCH_VARLEN),
        ("flash", "cuda", torch.bfloat16, True, FLASH_VARLEN),
        ("flash", "cuda", torch.bfloat16, False, FLASH_VARLEN),
        # float32 compute, or a torch without varlen_attn: sample by sample.
        ("native", "cuda", torch.float32, True, PER_SAMPLE),
        ("native", "cuda", torch.bfloat16, False, PER_SAMPLE),
    ],
)
def test_the_path_a_pack_takes(backend: str | None, device: str, dtype: torch.dtype, varlen: bool, path: str) -> None:
    assert packed_attention_path(backend, device, dtype, varlen) == path


def test_the_config_and_the_kernel_agree_on_torch_varlen() -> None:
    # The config package asks torch itself (it imports no h3train module): both must say the same.
    assert config_checks.torch_varlen_available() is torch_varlen_available()
    for dtype, compute in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        for device in ("cpu", "cuda"):
            cfg = load_config(TINY_FL2VA, [f"model.dtype={dtype}", PACK])
            one_call = packed_attention_path("native", device, compute, VARLEN) == TORCH_VARLEN
            assert (packed_compile_missing(cfg, device) is None) is one_call, (dtype, device)


@pytest.mark.parametrize(
    ("overrides", "device", "compiles"),
    [
        (["model.dtype=bfloat16"], "cuda", VARLEN),
        (["model.compile=true", "model.dtype=bfloat16"], "cuda", VARLEN),
        (["model.dtype=bfloat16"], "cpu", False),
        (["model.dtype=float32"], "cuda", False),
        (["model.compile=false", "model.dtype=bfloat16"], "cuda", False),
        (["model.compile=false"], "cpu", False),
    ],
)
def test_auto_compiles_packs_where_they_attend_in_one_call(overrides: list[str], device: str, compiles: bool) -> None:
    cfg = load_config(TINY_FL2VA, [*overrides, PACK])
    if overrides[0] == "model.compile=true" and not VARLEN:
        with pytest.raises(ConfigError, match="has none; set model.compile=false"):
            resolve_compile(cfg, device)
    else:
        assert resolve_compile(cfg, device) is compiles


def test_true_with_packs_on_the_cpu_is_one_line_naming_the_key() -> None:
    cfg = load_config(TINY_FL2VA, ["model.compile=true", "model.dtype=bfloat16", PACK])
    with pytest.raises(ConfigError) as caught:
        resolve_compile(cfg, "cpu")
    assert str(caught.value) == (
        "config key 'model.compile' is true with data.pack=200: a packed sequence compiles as one call only with "
        "CUDA's varlen attention (torch >= 2.10, bfloat16 compute), but this run trains on the CPU; "
        "set model.compile=false"
    )


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["model.dtype=float32"], "but model.dtype is 'float32'; set model.compile=false"),
        (["model.dtype=bfloat16", "parallel.backend=gloo"], "but this run trains on the CPU; set model.compile=false"),
    ],
)
def test_what_the_values_rule_out_is_refused_as_the_config_loads(
    overrides: list[str], why: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=why):
        load_config(TINY_FL2VA, ["model.compile=true", *overrides, PACK])
    assert main(["check", str(TINY_FL2VA), "model.compile=true", *overrides, PACK]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "config key 'model.compile' is true with data.pack=200" in lines[0], lines


def test_a_packed_compiling_run_on_the_cpu_is_refused_in_one_line(tmp_path, capsys: pytest.CaptureFixture) -> None:
    args = tiny_args(tmp_path / "run", "model.compile=true", "model.dtype=bfloat16", PACK, "train.steps=1")
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("h3train: error: ")]
    assert len(lines) == 1 and lines[0].endswith("but this run trains on the CPU; set model.compile=false"), lines
    # Refused with the config's other checks, before any process group, model or run folder.
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not VARLEN, reason="torch < 2.10 has no varlen_attn op")
def test_a_selective_block_saves_the_varlen_call() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    from h3train.model.sp_forward import attention_saving_policy

    op = torch.ops.torch_attn._varlen_attn.default
    assert attention_saving_policy(None, op) == CheckpointPolicy.MUST_SAVE


# -- what a pack computes ---------------------------------------------------------------------------------


def _qkv(lengths: tuple[int, ...], heads: int, dim: int, **kw) -> tuple[torch.Tensor, ...]:
    rows = sum(lengths)
    return tuple(torch.randn(1, rows, heads, dim, **kw) for _ in range(3))


def _dense_block_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Dense softmax attention over all rows `[1, S, H, D]`, a row seeing only its own sample's rows."""
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    blocked = sample[:, None] != sample[None, :]
    scores = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(blocked, float("-inf")).softmax(-1)
    return torch.einsum("bhst,bthd->bshd", weights, v)


def test_the_per_sample_path_is_dense_attention_under_a_block_diagonal_mask() -> None:
    torch.manual_seed(0)
    lengths = (7, 1, 12, 5)
    q, k, v = _qkv(lengths, heads=3, dim=8, dtype=torch.float64)
    segments = segments_on(lengths, CPU)
    assert segments.offsets is None  # the CPU attends sample by sample
    out = segment_attention(q, k, v, segments, None)
    expected = _dense_block_diagonal(q, k, v, lengths)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # Not the same as attending over the whole sequence: the mask matters at these lengths.
    whole = _dense_block_diagonal(q, k, v, (sum(lengths),))
    assert (out - whole).abs().max() > 1e-3


def test_the_offsets() -> None:
    offsets = packed_offsets((7, 1, 12), CPU)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 7, 8, 20]


# -- compile counts on the CPU, with a stand-in for the one-call kernel -----------------------------------


@torch.library.custom_op("h3train_tests::segment_attention", mutates_args=())
def _stand_in(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """`varlen_attn`'s signature (q, k, v `[T, H, D]`, int32 offsets `[N + 1]`) on the CPU, segment by segment."""
    bounds = cu_seq_q.tolist()
    assert bounds == cu_seq_k.tolist() and bounds[-1] == query.shape[0]
    # The bound it is handed must bound every sample, as the real kernel's grid needs.
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= min(max_q, max_k)
    outs = [
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (query, key, value))).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs)


@_stand_in.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    return torch.empty_like(query)


@pytest.fixture
def one_call_on_the_cpu(monkeypatch: pytest.MonkeyPatch):
    """The one-call path on the CPU: offsets on the CPU too, the stand-in kernel as `varlen_attn`."""
    from h3train.model import sp_forward

    def path(backend, device_type, dtype, torch_varlen) -> str:
        return TORCH_VARLEN

    monkeypatch.setattr(attention, "packed_attention_path", path)
    monkeypatch.setattr(attention, "_VARLEN_ATTN", torch.ops.h3train_tests.segment_attention)
    monkeypatch.setattr(sp_forward, "segments_on", lambda lengths, device: _cpu_segments(lengths))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cpu_segments(lengths: tuple[int, ...]) -> Segments:
    return Segments(tuple(lengths), packed_offsets(lengths, CPU))


# Two compositions of 24 rows (two and three samples), then other totals and counts.
COMPOSITIONS = [(10, 14), (3, 17, 4), (5, 6), (2, 2, 2, 2, 9), (30,)]
# Graphs after each composition: the first total, then one more once the row count changes (it turns
# dynamic), whatever the compositions.
GRAPHS = [1, 1, 2, 2, 2]


def test_a_compiled_pack_compiles_once_per_row_count_change_not_per_composition(one_call_on_the_cpu) -> None:
    torch.manual_seed(0)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(segment_attention, backend=counter, fullgraph=True)
    graphs = []
    for lengths in COMPOSITIONS:
        q, k, v = _qkv(lengths, heads=2, dim=8)
        out = compiled(q, k, v, _cpu_segments(lengths), None)
        graphs.append(counter.frame_count)
        expected = _dense_block_diagonal(q, k, v, lengths)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert graphs == GRAPHS


def _packed_inputs(lengths_of: list[str]) -> dict[str, object]:
    """A pack's forward arguments: one tiny synthetic sample per entry, of the geometry its override gives."""
    from h3train.objective import micro_batch_inputs
    from h3train.packing import pack_inputs
    from h3train.tasks.synthetic import SyntheticSource

    items = []
    for slot, override in enumerate(lengths_of):
        cfg = load_config(TINY_FL2VA, [override])
        sample = SyntheticSource(cfg.data.synthetic, cfg.model.config["text_dim"], cfg.train.seed)[slot]
        items.append(micro_batch_inputs(cfg, sample, step=1, slot=slot))
    return pack_inputs(items).forward_kwargs()


def test_the_compiled_blocks_of_a_packed_model_run_every_composition_on_one_graph(one_call_on_the_cpu) -> None:
    """The tiny packed model, its blocks compiled: packs of two geometries in either order (same rows,
    another composition) and a pack of three compile as the first two totals do, and equal the eager
    model, which attends sample by sample."""
    from h3train.model.build import build_model
    from h3train.model.sp_forward import SequenceParallelH3
    from h3train.parallel.ulysses import SequenceParallel

    small, large = "data.synthetic.latent_width=4", "data.synthetic.latent_width=6"
    packs = [[small, large], [large, small], [small, large, small], [large, small, small]]
    cfg = load_config(TINY_FL2VA)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = SequenceParallelH3(
        build_model(cfg, seed=0), SequenceParallel(None), compile_blocks=True, compile_backend=counter, packed=True
    )
    eager = SequenceParallelH3(build_model(cfg, seed=0), SequenceParallel(None), packed=True)
    graphs = []
    with torch.no_grad():
        for pack in packs:
            inputs = _packed_inputs(pack)
            got = compiled(**inputs)
            graphs.append(counter.frame_count)
            with pytest.MonkeyPatch.context() as cpu_path:
                # The same weights, eager, on the CPU's own path: sample by sample.
                cpu_path.setattr(attention, "packed_attention_path", packed_attention_path)
                expected = eager(**inputs)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert graphs[0] >= 1
    # [large, small] is a new composition of the same rows: no new graph. The three-sample packs are a
    # new row count (dynamic from then on), then a new composition of it: at most one graph per block more.
    assert graphs[1] == graphs[0] and graphs[3] == graphs[2] <= 2 * graphs[0], graphs


# -- CUDA: the real kernel ---------------------------------------------------------------------------------


@needs_cuda_varlen
def test_varlen_attn_equals_the_per_sample_path_in_bf16() -> None:
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    lengths = (37, 256, 5, 300, 1)
    q, k, v = _qkv(lengths, heads=4, dim=128, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    segments = segments_on(lengths, cuda)
    assert packed_attention_path(None, "cuda", q.dtype, VARLEN) == TORCH_VARLEN
    out = segment_attention(q, k, v, segments, None)
    per_sample = segment_attention(q, k, v, Segments(lengths), None)  # no offsets: sample by sample
    torch.testing.assert_close(out.float(), per_sample.float(), rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(per_sample, (q, k, v), grad)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2)
    # And both are the block-diagonal attention (float32 reference).
    reference = _dense_block_diagonal(*(t.detach().float() for t in (q, k, v)), lengths)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


@needs_cuda_varlen
def test_a_compiled_pack_compiles_once_per_row_count_change_on_cuda() -> None:
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(segment_attention, backend=counter, fullgraph=True)
    graphs = []
    for lengths in COMPOSITIONS:
        q, k, v = _qkv(lengths, heads=4, dim=64, dtype=torch.bfloat16, device=cuda, requires_grad=True)
        segments = segments_on(lengths, cuda)
        out = compiled(q, k, v, segments, None)
        out.float().square().sum().backward()
        graphs.append(counter.frame_count)
        expected = segment_attention(*(t.detach() for t in (q, k, v)), Segments(lengths), None)
        torch.testing.assert_close(out.detach().float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
    assert graphs == GRAPHS
