"""`model.attention_backend`: resolution, the errors when unavailable, and that the backend reaches attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers.models.transformers import transformer_minimax_h3

from h3train import config
from h3train.cli import main
from h3train.config import LossWeights, TimestepConfig, load_config
from h3train.errors import ConfigError
from h3train.model import sp_forward
from h3train.model.build import build_model
from h3train.model.sp_forward import SequenceParallelH3, UlyssesAttnProcessor
from h3train.objective import make_training_inputs
from h3train.ops import attention
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.synthetic import SyntheticSource

from helpers.paths import TINY_FL2VA


def test_auto_and_native_resolve_to_sdpa_on_cpu() -> None:
    assert attention.resolve_attention_backend("auto", "cpu", "bfloat16") == "native"
    assert attention.resolve_attention_backend("native", "cpu", "bfloat16") == "native"


@pytest.mark.parametrize("name", ["flash", "cudnn"])
def test_gpu_backends_on_cpu_are_a_one_line_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="'model.attention_backend'") as info:
        attention.resolve_attention_backend(name, "cpu", "bfloat16")
    assert "\n" not in str(info.value) and name in str(info.value)


def test_cuda_resolution_follows_flash_attn_availability(monkeypatch) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    with pytest.raises(ConfigError, match="'model.attention_backend'.*flash-attn is not installed") as info:
        attention.resolve_attention_backend("flash", "cuda", "bfloat16")
    assert "\n" not in str(info.value)
    assert attention.resolve_attention_backend("auto", "cuda", "bfloat16") == "native"
    assert attention.resolve_attention_backend("cudnn", "cuda", "bfloat16") == "_native_cudnn"
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.resolve_attention_backend("auto", "cuda", "bfloat16") == "flash"
    assert attention.resolve_attention_backend("flash", "cuda", "bfloat16") == "flash"


def test_train_with_flash_on_cpu_exits_2_with_one_line(capsys) -> None:
    assert main(["train", str(TINY_FL2VA), "model.attention_backend=flash"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'model.attention_backend'" in err


def _tiny():
    cfg = load_config(TINY_FL2VA)
    sample = SyntheticSource(cfg.data.synthetic, 16, seed=0)[0]
    ti = make_training_inputs(sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights())
    return cfg, ti


def _spy(monkeypatch, module) -> list:
    """Record the `backend` every attention call of `module` dispatches to."""
    seen: list = []
    real = module.dispatch_attention_fn

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "dispatch_attention_fn", spy)
    return seen


def _step(model: SequenceParallelH3, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    video, audio = model(**inputs)
    (video.square().mean() + audio.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.transformer.named_parameters()}
    return video.detach(), audio.detach(), grads


def test_ulysses_processor_same_forward_and_backward_with_native_and_math(monkeypatch) -> None:
    cfg, ti = _tiny()
    seq_len = ti.model_inputs["position_ids"].shape[0]
    ulysses_seen = _spy(monkeypatch, sp_forward)
    diffusers_seen = _spy(monkeypatch, transformer_minimax_h3)
    runs = {}
    for backend in ("native", "_native_math"):
        transformer = build_model(cfg, seed=0)
        transformer.set_attention_backend(backend)
        model = SequenceParallelH3(transformer, SequenceParallel(None))
        # sp = 1 keeps diffusers' processor; install the Ulysses one by hand so it runs here too.
        for block in transformer.transformer_blocks:
            proc = UlyssesAttnProcessor(model.sp)
            proc._attention_backend = block.attn.processor._attention_backend
            proc.seq_len = seq_len
            block.attn.set_processor(proc)
        ulysses_seen.clear()
        diffusers_seen.clear()
        runs[backend] = _step(model, ti.model_inputs)
        layers, refiner = cfg.model.config["num_layers"], cfg.model.config["num_refiner_layers"]
        assert ulysses_seen == [backend] * layers
        assert diffusers_seen == [backend] * refiner  # the text refiner keeps diffusers' processor

    native, math_ = runs["native"], runs["_native_math"]
    torch.testing.assert_close(native[0], math_[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(native[1], math_[1], rtol=1e-5, atol=1e-6)
    assert native[2].keys() == math_[2].keys()
    for name in native[2]:
        torch.testing.assert_close(native[2][name], math_[2][name], rtol=1e-4, atol=1e-6, msg=name)

    # And the Ulysses processor at sp = 1 is the diffusers forward, to float32 rounding.
    transformer = build_model(cfg, seed=0)
    reference = _step(SequenceParallelH3(transformer, SequenceParallel(None)), ti.model_inputs)
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-6)
    for name in native[2]:
        torch.testing.assert_close(native[2][name], reference[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_backend_set_before_wrapping_reaches_every_processor() -> None:
    cfg, _ = _tiny()
    transformer = build_model(cfg, seed=0)
    transformer.set_attention_backend("_native_math")
    SequenceParallelH3(transformer, SequenceParallel(None))
    for block in transformer.transformer_blocks:
        assert isinstance(block.attn.processor, transformer_minimax_h3.MiniMaxH3AttnProcessor)
        assert block.attn.processor._attention_backend == "_native_math"
    # At sp > 1 the Ulysses processors replace diffusers' and copy the backend (no group needed to build).
    transformer = build_model(cfg, seed=0)
    transformer.set_attention_backend("_native_math")
    wrapped = SequenceParallelH3(transformer, SimpleNamespace(size=2, rank=0, enabled=True))
    assert len(wrapped.processors) == len(transformer.transformer_blocks)
    for block, proc in zip(transformer.transformer_blocks, wrapped.processors):
        assert block.attn.processor is proc and proc._attention_backend == "_native_math"


def test_half_precision_kernels_need_bf16(monkeypatch) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.resolve_attention_backend("auto", "cuda", "bfloat16") == "flash"
    assert attention.resolve_attention_backend("auto", "cuda", "float32") == "native"
    for name in ("flash", "cudnn"):
        with pytest.raises(ConfigError, match="model.dtype"):
            attention.resolve_attention_backend(name, "cuda", "float32")


def test_config_choices_are_the_tables() -> None:
    # The config package imports nothing from h3train but errors: its value check keeps a copy of the table's names.
    assert config.choices("model.attention_backend") == attention.CONFIG_CHOICES
    trained = tuple(name for name, b in attention.ATTENTION_BACKENDS.items() if b.trains)
    assert attention.CONFIG_CHOICES[0] == "auto" and attention.CONFIG_CHOICES[1:] == trained


def test_math_runs_in_the_bench_but_is_no_training_choice() -> None:
    assert attention.unavailable("math", "cpu", "float32") is None
    assert attention.ATTENTION_BACKENDS["math"].diffusers == "_native_math"
    with pytest.raises(ConfigError, match="choose one of auto, native, flash, cudnn"):
        attention.resolve_attention_backend("math", "cpu", "float32")


def test_bench_and_training_read_one_availability_check(monkeypatch) -> None:
    from h3train.tools import bench

    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    names, notes = bench.select_backends(None, torch.device("cuda"), "bfloat16")
    why = attention.unavailable("flash", "cuda", "bfloat16")
    assert names == ["cudnn", "native"] and notes == [f"flash skipped: {why}"] and "flash-attn" in why
    with pytest.raises(ConfigError, match="flash-attn is not installed"):
        bench.select_backends("flash", torch.device("cuda"), "bfloat16")
