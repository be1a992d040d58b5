"""The CFG-calibrated objective against independently written formulas."""

from __future__ import annotations

import pytest
import torch

from h3train.config import CfgConfig, load_config
from h3train.model.build import build_model
from h3train.objective import compute_loss, guidance_for, micro_batch_inputs
from h3train.tasks.synthetic import SyntheticSource

from helpers.paths import TINY_FL2VA


class CountingForward:
    def __init__(self, model) -> None:
        self.model, self.calls, self.grad_calls = model, 0, 0

    def __call__(self, **inputs):
        self.calls += 1
        self.grad_calls += torch.is_grad_enabled()
        return self.model(**inputs, return_dict=False)


def _setup(overrides: list[str], index: int = 0):
    cfg = load_config(TINY_FL2VA, overrides)
    model = build_model(cfg, seed=0)
    sample = SyntheticSource(cfg.data.synthetic, model.config.text_dim, cfg.train.seed)[index]
    return cfg, model, sample, micro_batch_inputs(cfg, sample, step=3, slot=0)


def _mse(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = mask.bool()
    return ((a[0][rows] - b[rows]) ** 2).mean()


def test_scale_one_is_plain_flow_matching_with_one_forward() -> None:
    _, model, _, ti = _setup(["cfg.scale=1"])
    assert ti.uncond_inputs is None
    fwd = CountingForward(model)
    parts = compute_loss(fwd, ti)
    parts.loss.backward()
    assert fwd.calls == 1
    got = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    video, audio = model(**ti.model_inputs, return_dict=False)
    plain = ti.weight_video * _mse(video, ti.target_video, ti.loss_mask_video) + ti.weight_audio * _mse(
        audio, ti.target_audio, ti.loss_mask_audio
    )
    plain.backward()
    assert torch.allclose(parts.loss, plain, rtol=1e-6, atol=0)
    assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-8) for a, p in zip(got, model.parameters()))


def test_scale_one_is_bit_identical_to_cfg_absent() -> None:
    results = []
    for overrides in ([], ["cfg.scale=1.0", "cfg.curvature_power=0.7", "cfg.schedule=sigma"]):
        _, model, _, ti = _setup(overrides)
        loss = compute_loss(CountingForward(model), ti).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_k0_is_guided_target_and_u_is_constant() -> None:
    s = 3.0
    _, model, _, ti = _setup([f"cfg.scale={s}", "cfg.curvature_power=0"])
    fwd = CountingForward(model)
    parts = compute_loss(fwd, ti)
    parts.loss.backward()
    assert (fwd.calls, fwd.grad_calls) == (2, 1)
    got = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    with torch.no_grad():
        u_v, u_a = model(**ti.uncond_inputs, return_dict=False)
    p_v, p_a = model(**ti.model_inputs, return_dict=False)
    target_v = u_v[0] + s * (ti.target_video - u_v[0])
    target_a = u_a[0] + s * (ti.target_audio - u_a[0])
    ref = ti.weight_video * _mse(p_v, target_v, ti.loss_mask_video) + ti.weight_audio * _mse(
        p_a, target_a, ti.loss_mask_audio
    )
    ref.backward()
    assert torch.allclose(parts.loss, ref, rtol=1e-5)
    for a, p in zip(got, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7)


def test_uncond_branch_rebuilds_layout_but_keeps_rows_and_times() -> None:
    _, _, sample, ti = _setup(["cfg.scale=2", "cfg.negative_visual=drop"])
    cond, unc = ti.model_inputs, ti.uncond_inputs
    assert torch.equal(cond["hidden_states"], unc["hidden_states"])
    assert torch.equal(cond["audio_hidden_states"], unc["audio_hidden_states"])
    assert torch.equal(unc["encoder_hidden_states"][0], sample.negative_prompt_embeds)
    assert (
        unc["position_ids"].shape[0]
        == cond["position_ids"].shape[0] - sample.text_token_tags.numel() + sample.negative_prompt_embeds.shape[0]
    )
    # Same distinct timesteps; each row keeps its time (text rows follow the video time).
    assert torch.equal(cond["timestep"], unc["timestep"])
    assert torch.equal(
        cond["timestep"][cond["timestep_indices"][cond["video_indices"]]],
        unc["timestep"][unc["timestep_indices"][unc["video_indices"]]],
    )
    kept = micro_batch_inputs(load_config(TINY_FL2VA, ["cfg.scale=2"]), sample, 3, 0).uncond_inputs
    assert (kept["token_tags"][kept["text_indices"]] == 0).sum() == (sample.text_token_tags == 0).sum()


def test_sigma_schedule_uses_each_modality_sigma() -> None:
    cfg = CfgConfig(scale=4.0, schedule="sigma")
    g = guidance_for(cfg, sigma_video=0.5, sigma_audio=0.25)
    assert (g.scale_video, g.scale_audio) == (2.5, 1.75)
    g = guidance_for(CfgConfig(scale=4.0, audio_scale=2.0), 0.5, 0.25)
    assert (g.scale_video, g.scale_audio) == (4.0, 2.0)
    _, _, _, ti = _setup(["cfg.scale=4", "cfg.schedule=sigma"])
    assert ti.guidance.scale_video == pytest.approx(1 + 3 * (1 - ti.t_video))
    assert ti.guidance.scale_audio == pytest.approx(1 + 3 * (1 - ti.t_audio))
    assert ti.guidance.scale_video != ti.guidance.scale_audio


def test_text_dropout_is_deterministic_and_replaces_the_prompt() -> None:
    cfg = load_config(TINY_FL2VA, ["cfg.text_dropout=0.5", "cfg.negative_visual=drop"])
    source = SyntheticSource(cfg.data.synthetic, 16, 0)
    dropped = []
    for i in range(16):
        sample = source[i]
        a = micro_batch_inputs(cfg, sample, 1, 0)
        b = micro_batch_inputs(cfg, sample, 1, 1)
        is_dropped = torch.equal(a.model_inputs["encoder_hidden_states"][0], sample.negative_prompt_embeds)
        assert is_dropped == torch.equal(b.model_inputs["encoder_hidden_states"][0], sample.negative_prompt_embeds)
        dropped.append(is_dropped)
    assert 0 < sum(dropped) < 16


def test_full_size_ref2va_cfg_config_loads_and_fits(tmp_path) -> None:
    import inspect
    import json

    from diffusers import MiniMaxH3Transformer3DModel

    from h3train.model.architecture import model_dims
    from h3train.parallel.dims import ParallelDims
    from h3train.plan import estimate

    sig = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    dims = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    (tmp_path / "transformer_ref").mkdir()
    (tmp_path / "transformer_ref" / "config.json").write_text(json.dumps(dims, default=list))
    cfg = load_config(TINY_FL2VA.parent / "h3_ref2va_cfg_a100.yaml", [f"model.pretrained={tmp_path}"])
    assert cfg.task.name == "ref2va" and cfg.cfg.scale > 1 and cfg.model.dtype == "bfloat16"
    plan = estimate(model_dims(cfg), ParallelDims.from_config(cfg.parallel, 8), cfg, rows=41_774)
    assert plan.fits


def test_dropped_prompt_trains_at_scale_one_with_the_runs_forwards() -> None:
    """A dropped prompt makes both CFG branches identical: plain flow matching under the negative, with the
    negative forward run all the same (no gradient), so its rank issues the collectives of a kept prompt."""
    cfg = load_config(TINY_FL2VA, ["cfg.scale=3", "cfg.curvature_power=0.5", "cfg.text_dropout=0.9"])
    model = build_model(cfg, seed=0)
    source = SyntheticSource(cfg.data.synthetic, model.config.text_dim, cfg.train.seed)
    negative = source[0].negative_visual_prompt_embeds
    found = []
    for i in range(8):
        ti = micro_batch_inputs(cfg, source[i], step=3, slot=0)
        if torch.equal(ti.model_inputs["encoder_hidden_states"][0], source[i].negative_visual_prompt_embeds):
            found.append(ti)
    assert found and negative is not None
    ti = found[0]
    assert ti.uncond_inputs is not None and (ti.guidance.scale_video, ti.guidance.scale_audio) == (1.0, 1.0)
    fwd = CountingForward(model)
    parts = compute_loss(fwd, ti)
    assert (fwd.calls, fwd.grad_calls) == (2, 1)
    with torch.no_grad():
        video, audio = model(**ti.model_inputs, return_dict=False)
    plain = ti.weight_video * _mse(video, ti.target_video, ti.loss_mask_video) + ti.weight_audio * _mse(
        audio, ti.target_audio, ti.loss_mask_audio
    )
    assert torch.allclose(parts.loss.detach(), plain, rtol=1e-6, atol=0)
