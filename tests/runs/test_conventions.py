"""H3's training conventions, each computed here from diffusers' own code rather than from h3train's.

The expected values come from `MiniMaxH3Scheduler` (`set_timesteps`, `scale_noise`, `step`) and the
pipeline's blocks (`MiniMaxH3PrepareConditionLatentsStep`, `build_row_timesteps`, `keyframe_noise_aug`),
fed the same clean rows and the same generator draws `make_training_inputs` documents (base sigma, video
noise rows, audio noise rows). A change to any of h3train's noising, timestep or velocity code that
departs from diffusers fails here; `scripts/check_mutations.py` checks that it does.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import before_denoise
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareConditionLatentsStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

from h3train.config import CfgConfig, LossWeights, TimestepConfig, load_config
from h3train.data.sample_file import CachedSample
from h3train.data.synthetic_dataset import synthetic_sample
from h3train.objective import make_training_inputs, micro_batch_inputs
from h3train.tasks.layout import PATCH_SIZE
from h3train.tasks.synthetic import SyntheticSource

from helpers.paths import TINY_FL2VA

# The pipeline's two schedules, as its timestep step describes them (the video one is also the
# scheduler's default; the audio one is the released `audio_scheduler` config).
_SHIFTS = re.search(
    r"`shift = ([\d.]+)` for video, `shift = ([\d.]+)` for audio", MiniMaxH3SetTimestepsStep().description
)
VIDEO_SHIFT, AUDIO_SHIFT = float(_SHIFTS[1]), float(_SHIFTS[2])
SEEDS = (0, 5, 11, 1234)


def _pipeline() -> MiniMaxH3ModularPipeline:
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(
        scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT), audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT)
    )
    return pipe


def scheduler_sigma(shift: float, base: float) -> float:
    """The scheduler's own shifted sigma at one base sigma: `set_timesteps` run on the grid `[base, 0]`."""
    scheduler = MiniMaxH3Scheduler(shift=shift)
    with mock.patch.object(torch, "linspace", return_value=torch.tensor([base, 0.0], dtype=torch.float32)):
        scheduler.set_timesteps(2)
    return float(scheduler.sigmas[0])


def _draws(seed: int, cached: CachedSample, packed) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The base sigma and noise rows `make_training_inputs` draws from `Generator(seed)`, in its order."""
    g = torch.Generator().manual_seed(seed)
    base = float(torch.rand((), generator=g, dtype=torch.float64))
    return base, torch.randn(packed.video_rows.shape, generator=g), torch.randn(packed.audio_rows.shape, generator=g)


def _inverse_patchify(rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The latent tensor of `shape` whose `patchify_video_latents` rows are `rows`."""
    where = patchify_video_latents(torch.arange(torch.Size(shape).numel()).reshape(shape).double(), PATCH_SIZE)
    out = torch.empty(torch.Size(shape).numel())
    out[where.long().flatten()] = rows.flatten()
    return out.reshape(shape)


def _conditioning(cached: CachedSample) -> list[torch.Tensor]:
    """The visual conditioning latents `[1, 24, f, h, w]` in packed order, as the pipeline receives them."""
    return [k[None] for k in cached.keyframes] + [r.video[None] for r in cached.references if r.video is not None]


CASES = [("fl2va", 2), ("fl2va", 3), ("ref2va", 1), ("ref2va", 4)]


def test_shift_is_the_schedulers() -> None:
    from h3train.objective import shift_sigma

    for shift in (VIDEO_SHIFT, AUDIO_SHIFT):
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(40)
        base = torch.linspace(1.0, 0.0, 40, dtype=torch.float64)
        ours = torch.tensor([shift_sigma(float(b), shift) for b in base], dtype=torch.float64)
        assert torch.allclose(ours, scheduler.sigmas.double(), atol=1e-6, rtol=0)


def test_default_shifts_are_the_pipelines() -> None:
    assert MiniMaxH3Scheduler().shift == VIDEO_SHIFT and AUDIO_SHIFT == 3.0
    tcfg = TimestepConfig()
    assert (tcfg.video_shift, tcfg.audio_shift) == (VIDEO_SHIFT, AUDIO_SHIFT)


@pytest.mark.parametrize(("task", "index"), CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_training_inputs_are_the_schedulers_forward_process(task: str, index: int, seed: int) -> None:
    cached = synthetic_sample(task, index, seed=3, text_dim=8)
    packed = cached.to_packed()
    ti = make_training_inputs(packed, torch.Generator().manual_seed(seed), TimestepConfig(), LossWeights())
    base, noise_video, noise_audio = _draws(seed, cached, packed)
    ncv, nca = packed.layout.num_condition_video_rows, packed.layout.num_condition_audio_rows
    assert ti.sigma == base

    # Time: t = 1 - sigma, each modality through its own scheduler's shift.
    t_video = 1.0 - scheduler_sigma(VIDEO_SHIFT, base)
    t_audio = 1.0 - scheduler_sigma(AUDIO_SHIFT, base)
    assert ti.t_video == pytest.approx(t_video, abs=1e-6) and ti.t_audio == pytest.approx(t_audio, abs=1e-6)

    # Target rows: `scale_noise` at the modality's t.
    scheduler = MiniMaxH3Scheduler()
    xt_video, xt_audio = ti.model_inputs["hidden_states"][0], ti.model_inputs["audio_hidden_states"][0]
    expected = scheduler.scale_noise(packed.video_rows[ncv:], t_video, noise_video[ncv:])
    assert torch.allclose(xt_video[ncv:], expected, atol=1e-5, rtol=0)
    expected = scheduler.scale_noise(packed.audio_rows[nca:], t_audio, noise_audio[nca:])
    assert torch.allclose(xt_audio[nca:], expected, atol=1e-5, rtol=0)

    # Visual conditioning rows: the pipeline's own conditioning step, given the same noise.
    pipe = _pipeline()
    conditions = _conditioning(cached)
    assert (ncv > 0) == bool(conditions)
    if conditions:
        sizes = [patchify_video_latents(c, PATCH_SIZE).shape[0] for c in conditions]
        offsets = torch.tensor([0, *sizes]).cumsum(0)
        noises = [_inverse_patchify(noise_video[a:b], c.shape) for a, b, c in zip(offsets, offsets[1:], conditions)]
        state = PipelineState()
        for key, value in {"num_condition_video_rows": ncv, "condition_latents": conditions, "generator": None}.items():
            state.set(key, value)
        with mock.patch.object(before_denoise, "randn_tensor", side_effect=noises):
            MiniMaxH3PrepareConditionLatentsStep()(pipe, state)
        assert torch.allclose(xt_video[:ncv], state.get("condition_rows"), atol=1e-6, rtol=0)
    # Reference soundtracks ride clean.
    assert torch.equal(xt_audio[:nca], packed.audio_rows[:nca])

    # Row timesteps: the pipeline's plan with its own anchor level and clean reference audio.
    layout = packed.layout
    timestep, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_indices, layout.audio_indices, ncv, nca, layout.text_indices.numel(),
        t_video, t_audio, max(t_video, pipe.keyframe_noise_aug), 1.0,
    )  # fmt: skip
    assert torch.allclose(ti.model_inputs["timestep"], timestep, atol=1e-6, rtol=0)
    assert torch.equal(ti.model_inputs["timestep_indices"], indices)

    # Velocity: one scheduler step to sigma = 0 with the target as the model output lands on x0.
    for shift, t, xt, target, x0, rows in (
        (VIDEO_SHIFT, t_video, xt_video, ti.target_video, packed.video_rows, slice(ncv, None)),
        (AUDIO_SHIFT, t_audio, xt_audio, ti.target_audio, packed.audio_rows, slice(nca, None)),
    ):
        step = MiniMaxH3Scheduler(shift=shift)
        step.set_timesteps(sigmas=[1.0 - t, 0.0])
        landed = step.step(target[rows], step.timesteps[0], xt[rows]).prev_sample
        assert torch.allclose(landed, x0[rows], atol=1e-4, rtol=0)


def test_dropout_decision_does_not_depend_on_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SP ranks of one DP group build their micro-batch apart: each must drop the same prompts.

    Every SP rank calls `micro_batch_inputs` with the same (step, slot, sample); only its process
    identity differs, which is what this varies.
    """
    cfg = load_config(TINY_FL2VA, ["cfg.text_dropout=0.5", "cfg.scale=2", "cfg.negative_visual=drop"])
    source = SyntheticSource(cfg.data.synthetic, 16, 0)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    dropped = []
    for step in (1, 2):
        for i in range(8):
            sample = source[i]
            per_rank = []
            for rank in (0, 1):
                monkeypatch.setenv("RANK", str(rank))
                monkeypatch.setenv("LOCAL_RANK", str(rank))
                monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
                per_rank.append(micro_batch_inputs(cfg, sample, step, slot=0))
            a, b = per_rank
            assert a.model_inputs.keys() == b.model_inputs.keys()
            assert all(torch.equal(a.model_inputs[k], b.model_inputs[k]) for k in a.model_inputs)
            assert (a.uncond_inputs is None) == (b.uncond_inputs is None)
            dropped.append(torch.equal(a.model_inputs["encoder_hidden_states"][0], sample.negative_prompt_embeds))
    assert 0 < sum(dropped) < len(dropped)


def test_dropped_prompt_trains_at_scale_one_on_the_negative_branch() -> None:
    sample = synthetic_sample("fl2va", 2, seed=3, text_dim=8).to_packed()
    cfg = CfgConfig(scale=3.0, curvature_power=0.5)
    kept = make_training_inputs(sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights(), cfg)
    dropped = make_training_inputs(
        sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights(), cfg, drop_text=True
    )
    assert kept.uncond_inputs is not None and kept.guidance.active
    # The negative forward still runs (the run's forwards, not the sample's), on the same inputs.
    assert dropped.uncond_inputs is dropped.model_inputs and not dropped.guidance.active
    assert dropped.full_weights() == (dropped.weight_video, dropped.weight_audio)
    assert torch.equal(dropped.model_inputs["hidden_states"], kept.uncond_inputs["hidden_states"])
    assert torch.equal(dropped.model_inputs["encoder_hidden_states"], kept.uncond_inputs["encoder_hidden_states"])


# --------------------------------------------------------------------------------------------------
# task.name=mixed and H3's two checkpoint partitions (`transformer`: t2va / fl2va, `transformer_ref`: ref2va).


def _pretrained_run(tmp_path, dataset_task: str, *overrides: str) -> list[str]:
    """A config for `h3train check`: the tiny architecture as a pretrained folder of both partitions."""
    import json

    import yaml

    from h3train.data.synthetic_dataset import write_synthetic_dataset
    from h3train.model.architecture import model_config_dict

    tiny = load_config(TINY_FL2VA, [])
    dims = model_config_dict(tiny)
    for partition in ("transformer", "transformer_ref"):
        (tmp_path / "h3" / partition).mkdir(parents=True, exist_ok=True)
        (tmp_path / "h3" / partition / "config.json").write_text(json.dumps(dims))
    data = write_synthetic_dataset(tmp_path / f"data-{dataset_task}", dataset_task, 4, text_dim=dims["text_dim"])
    raw = yaml.safe_load(TINY_FL2VA.read_text())
    raw["model"].pop("config")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    return [
        "check",
        str(tmp_path / "run.yaml"),
        "task.name=mixed",
        f"model.pretrained={tmp_path / 'h3'}",
        "data.source=cached",
        f"data.path={data}",
        *overrides,
    ]


def _one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("h3train: error: "), err
    return err


def test_mixed_from_pretrained_must_name_the_partition(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from h3train.cli import main

    assert main(_pretrained_run(tmp_path, "fl2va")) == 2
    err = _one_line_error(capsys)
    assert "model.subfolder" in err and "transformer_ref" in err


@pytest.mark.parametrize(
    ("dataset_task", "subfolder", "misfit"),
    [("mixed", "transformer", "ref2va"), ("mixed", "transformer_ref", "fl2va"), ("fl2va", "transformer_ref", "t2va")],
)
def test_mixed_refuses_samples_of_the_other_partition(
    dataset_task: str, subfolder: str, misfit: str, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    from h3train.cli import main

    assert main(_pretrained_run(tmp_path, dataset_task, f"model.subfolder={subfolder}")) == 2
    err = _one_line_error(capsys)
    assert f"partition '{subfolder}'" in err and f"{misfit} samples" in err


def test_mixed_says_which_partition_it_trains(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from h3train.cli import main

    assert main(_pretrained_run(tmp_path, "fl2va", "model.subfolder=transformer")) == 0
    out = capsys.readouterr().out
    assert out.count("task.name=mixed: training partition 'transformer' (t2va, fl2va samples)") == 1

    assert main(_pretrained_run(tmp_path, "ref2va", "model.subfolder=transformer_ref")) == 0
    assert "training partition 'transformer_ref' (ref2va samples)" in capsys.readouterr().out


def test_mixed_on_a_config_built_model_trains_every_task(capsys: pytest.CaptureFixture) -> None:
    from h3train.data.source import data_source
    from h3train.tasks.partition import check_partition

    cfg = load_config(TINY_FL2VA, ["task.name=mixed"])
    line = check_partition(cfg, data_source(cfg).sample_tasks)
    assert "model.config" in line and capsys.readouterr().out == line + "\n"
    cfg = load_config(TINY_FL2VA, [])
    assert check_partition(cfg, data_source(cfg).sample_tasks) is None


@pytest.mark.slow
def test_text_dropout_agrees_across_sp_ranks_in_training(tmp_path) -> None:
    """Two SP ranks under torchrun drop the same prompts: the step equals the unsharded reference's.

    A rank that dropped other prompts would pack other sequences than its peer and the reference.
    The step's four samples hold dropped and kept prompts (checked); a decision that also depended on
    the rank would disagree between the two ranks on at least one of them unless all four coincided.
    """
    from h3train.data.sampler import DistributedSampler
    from h3train.objective import text_dropped

    from helpers.reference import parity_step

    extra = ["parallel.sp=2", "cfg.scale=2", "cfg.text_dropout=0.5", "train.grad_accum=4", "train.seed=2"]
    sampler = DistributedSampler(load_config(TINY_FL2VA, extra).data.synthetic.num_samples, 0, 1, 2)
    decisions = [text_dropped(2, 1, f"synthetic-{sampler.next_index():06d}", 0.5) for _ in range(4)]
    assert any(decisions) and not all(decisions)
    result = parity_step(TINY_FL2VA, extra, tmp_path / "run", nproc=2, dp=1)
    worst, name = result.worst()
    assert worst <= 1e-5, f"gradient of {name} off by relative L2 {worst:.3e}"
    assert result.loss == pytest.approx(result.ref_loss, rel=1e-5)
