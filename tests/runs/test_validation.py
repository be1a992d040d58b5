"""Held-out loss: fixed noise, the live sharded model, no effect on training, the same at every layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from h3train.cli import main
from h3train.config import CfgConfig, load_config
from h3train.data.base_predictions import pair_bytes
from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import write_index
from h3train.data.location import INDEX_NAME, SAMPLE_SUFFIX
from h3train.data.sample_file import read_header
from h3train.data.sampler import assigned_indices
from h3train.data.synthetic_dataset import write_synthetic_dataset
from h3train.model.build import build_model
from h3train.objective import make_training_inputs
from h3train.plan import base_predictions_line
from h3train.run.assemble import build_trainer
from h3train.tools.curves import metrics_figure
from h3train.train.validation import HeldOutLoss, heldout_generator, sigma_label

from helpers.launch import read_metrics, run_forked
from helpers.paths import TINY_FL2VA

SIGMAS = [0.2, 0.5, 0.9]


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> str:
    # Three samples: with dp = 2 one rank evaluates two and the other one plus a weightless repeat.
    folder = tmp_path_factory.mktemp("heldout") / "data"
    write_synthetic_dataset(folder, task="fl2va", num_samples=3, seed=7, text_dim=16)
    return str(folder)


def _args(log_dir, heldout: str, *extra: str) -> list[str]:
    return [
        f"logging.dir={log_dir}",
        "train.steps=4",
        "logging.progress=false",
        "checkpoint.every=0",
        f"validation.dataset={heldout}",
        f"validation.sigmas=[{','.join(map(str, SIGMAS))}]",
        *extra,
    ]


def _rows(log_dir, kind: str | None) -> list[dict]:
    return [m for m in read_metrics(log_dir) if m.get("kind") == kind]


def _fit_with_heldout(cfg) -> HeldOutLoss:
    """Train `cfg` in this process with only the held-out hook; return the hook (it counts forwards)."""
    hook = HeldOutLoss(cfg)
    trainer = build_trainer(cfg, hooks=[hook])
    try:
        trainer.fit()
    finally:
        trainer.close()
    return hook


def _mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    rows = mask.bool()
    return float((pred[0][rows].double() - target[rows].double()).square().mean())


def test_samples_are_split_across_dp_groups_exactly_once() -> None:
    for n in (1, 3, 4, 7):
        for dp in (1, 2, 3):
            per_rank = [assigned_indices(n, r, dp) for r in range(dp)]
            assert len({len(p) for p in per_rank}) == 1, "ranks must run the same number of forwards"
            counted = sorted(i for p in per_rank for i in p if i is not None)
            assert counted == list(range(n))


def test_sigma_labels_are_distinct() -> None:
    assert sigma_label(0.5, [0.5, 0.25]) == "0.50"
    assert {sigma_label(s, [0.501, 0.502]) for s in (0.501, 0.502)} == {"0.501", "0.502"}


def test_heldout_loss_equals_an_unsharded_diffusers_forward_on_the_same_noise(tmp_path, heldout) -> None:
    cfg = load_config(TINY_FL2VA, _args(tmp_path, heldout, "validation.at_start=true"))
    hook = _fit_with_heldout(cfg)
    got = _rows(tmp_path, "validation")[0]
    assert got["step"] == 0
    # Every (sample, sigma) pair: the conditional forward, and the negative prompt's for retention.
    assert hook.forwards == 2 * 3 * len(SIGMAS)

    # The same random init as the run, evaluated by plain diffusers, one sample at a time.
    model = build_model(cfg, cfg.train.seed).eval()
    samples = CachedDataset(heldout, "fl2va")
    for sigma in SIGMAS:
        video, audio = [], []
        for i in range(len(samples)):
            sample = samples[i]
            ti = make_training_inputs(
                sample,
                heldout_generator(cfg.validation.seed, sample.sample_id, sigma),
                cfg.train.timestep,
                cfg.train.loss_weights,
                sigma=sigma,
            )
            with torch.no_grad():
                p_video, p_audio = model(**ti.model_inputs, return_dict=False)
            video.append(_mse(p_video, ti.target_video, ti.loss_mask_video))
            if sample.has_audio:
                audio.append(_mse(p_audio, ti.target_audio, ti.loss_mask_audio))
        label = sigma_label(sigma, SIGMAS)
        assert got[f"val/loss_video@{label}"] == pytest.approx(sum(video) / len(video), rel=1e-5)
        assert got[f"val/loss_audio@{label}"] == pytest.approx(sum(audio) / len(audio), rel=1e-5)


def test_validation_leaves_training_bitwise_unchanged(tmp_path, heldout) -> None:
    plain, validated = tmp_path / "plain", tmp_path / "validated"
    assert main(["train", str(TINY_FL2VA), *_args(plain, heldout)]) == 0
    assert main(["train", str(TINY_FL2VA), *_args(validated, heldout, "validation.every=2")]) == 0
    keys = ("loss", "loss_video", "loss_audio", "grad_norm", "lr")
    a, b = _rows(plain, None), _rows(validated, None)
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]
    assert [m["step"] for m in _rows(validated, "validation")] == [2, 4]

    labels = metrics_figure(validated / "metrics.jsonl").axes[0].get_legend_handles_labels()[1]
    assert "loss_video" in labels and "val/loss_video (held out)" in labels


def test_validation_also_runs_after_a_last_step_off_its_period(tmp_path, heldout) -> None:
    # 3 steps, every 2: step 2, then the trained model at step 3 (at 4 steps, every 2: 2 and 4, once each).
    assert main(["train", str(TINY_FL2VA), *_args(tmp_path, heldout, "train.steps=3", "validation.every=2")]) == 0
    assert [m["step"] for m in _rows(tmp_path, "validation")] == [2, 3]


def test_cfg_runs_report_the_plain_and_the_calibrated_loss(tmp_path, heldout) -> None:
    cfg = load_config(
        TINY_FL2VA, _args(tmp_path, heldout, "validation.at_start=true", "train.steps=1", "cfg.scale=3.0")
    )
    hook = _fit_with_heldout(cfg)
    row = _rows(tmp_path, "validation")[0]
    assert hook.forwards == 2 * 3 * len(SIGMAS), "CFG's negative forward is the one retention uses"
    assert row["val/loss_cfg"] != row["val/loss"] and row["val/loss_video_cfg"] > 0


def _reference_retention(cfg, trained, base, heldout: str) -> dict[str, float]:
    """Drift, guidance ratio and cosine per modality (and per sigma) from two plain diffusers models."""
    sums: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    for sample in CachedDataset(heldout, "fl2va"):
        for sigma in SIGMAS:
            # The negative branch as the CFG objective builds it (cfg.negative=per_sample, keep).
            ti = make_training_inputs(
                sample,
                heldout_generator(cfg.validation.seed, sample.sample_id, sigma),
                cfg.train.timestep,
                cfg.train.loss_weights,
                CfgConfig(scale=2.0),
                sigma=sigma,
            )
            with torch.no_grad():
                p, p_neg = trained(**ti.model_inputs, return_dict=False), trained(**ti.uncond_inputs, return_dict=False)
                b, b_neg = base(**ti.model_inputs, return_dict=False), base(**ti.uncond_inputs, return_dict=False)
            label = sigma_label(sigma, SIGMAS)
            for m, (name, target, mask) in enumerate(
                (("video", ti.target_video, ti.loss_mask_video), ("audio", ti.target_audio, ti.loss_mask_audio))
            ):
                if name == "audio" and not sample.has_audio:
                    continue
                rows = mask.bool()
                pm, bm, t = p[m][0][rows].double(), b[m][0][rows].double(), target[rows].double()
                g, gb = pm - p_neg[m][0][rows].double(), bm - b_neg[m][0][rows].double()
                add(f"moved_{name}", float((pm - bm).square().mean()))
                add(f"error_{name}", float((bm - t).square().mean()))
                for suffix in ("", f"@{label}"):
                    add(f"norm_{name}{suffix}", float(g.norm()))
                    add(f"base_norm_{name}{suffix}", float(gb.norm()))
                    add(f"dot_{name}{suffix}", float((g * gb).sum()))
                    add(f"sq_{name}{suffix}", float(g.square().sum()))
                    add(f"base_sq_{name}{suffix}", float(gb.square().sum()))
    out = {}
    for name in ("video", "audio"):
        out[f"val/drift_{name}"] = sums[f"moved_{name}"] / sums[f"error_{name}"]
        for suffix in ["", *(f"@{sigma_label(s, SIGMAS)}" for s in SIGMAS)]:
            out[f"val/guidance_ratio_{name}{suffix}"] = sums[f"norm_{name}{suffix}"] / sums[f"base_norm_{name}{suffix}"]
            both = sums[f"sq_{name}{suffix}"] * sums[f"base_sq_{name}{suffix}"]
            out[f"val/guidance_cos_{name}{suffix}"] = sums[f"dot_{name}{suffix}"] / both**0.5
    return out


def test_retention_of_a_full_fine_tune_equals_an_unsharded_diffusers_computation(tmp_path, heldout) -> None:
    run = tmp_path / "run"
    args = _args(run, heldout, "validation.every=4", "checkpoint.every=4", "optim.lr=2e-2")
    assert main(["train", str(TINY_FL2VA), *args]) == 0
    stored = json.loads((run / "base_predictions" / "meta.json").read_text())
    assert stored["samples"] == 3 and stored["pairs"] == 3 * len(SIGMAS)
    # The size `h3train check` plans is what the store holds.
    samples = CachedDataset(heldout, "fl2va")
    planned = sum(pair_bytes(read_header(samples.path(i)).geometry) for i in range(3)) * len(SIGMAS)
    assert planned == stored["bytes"]
    line = base_predictions_line(cfg := load_config(TINY_FL2VA, args))
    assert f"{planned / 2**20:.2f} MiB in {run / 'base_predictions'} for 9 held-out pairs" in line, line
    assert sum(p.stat().st_size for p in (run / "base_predictions").glob("*.safetensors")) > stored["bytes"]
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    trained = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "export").eval()
    base = build_model(cfg, cfg.train.seed).eval()  # the run's own random init, as stored
    got = _rows(run, "validation")[-1]
    want = _reference_retention(cfg, trained, base, heldout)
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    # Trained at a high rate for 4 steps: the guidance has moved, measurably.
    assert got["val/drift_video"] > 1e-3 and got["val/guidance_cos_video"] < 0.9999


def test_stored_base_predictions_are_refused_for_other_pairs_and_read_as_they_are_otherwise(
    tmp_path, heldout, capsys
) -> None:
    run = tmp_path / "run"
    first = _args(run, heldout, "validation.every=2", "checkpoint.every=2", "train.steps=2")
    assert main(["train", str(TINY_FL2VA), *first]) == 0
    capsys.readouterr()
    store = run / "base_predictions"
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    for changed in ("validation.sigmas=[0.2,0.5]", "validation.seed=3", "validation.num_samples=2"):
        assert main(["train", str(TINY_FL2VA), *first, "train.steps=4", changed]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "were computed for another held-out set or other validation settings" in err[0], err
    # The same settings resume and read the store as it is: not a byte rewritten.
    assert main(["train", str(TINY_FL2VA), *first, "train.steps=4"]) == 0
    capsys.readouterr()
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert _rows(run, "validation")[-1]["val/guidance_ratio_video"] > 0
    # A damaged file is found before any step, named, and not used.
    damaged = bytearray((store / "000001.safetensors").read_bytes())
    damaged[-3] ^= 0xFF
    (store / "000001.safetensors").write_bytes(bytes(damaged))
    assert main(["train", str(TINY_FL2VA), *first, "train.steps=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "000001.safetensors" in err[0] and "does not match its digest" in err[0], err
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    # A full fine-tune whose store is gone cannot compute its base again: it says so and goes on without.
    shutil.rmtree(store)
    assert main(["train", str(TINY_FL2VA), *first, "train.steps=6"]) == 0
    assert "drift and guidance retention are off for this run" in capsys.readouterr().err
    assert "val/guidance_ratio_video" not in _rows(run, "validation")[-1]


def test_a_heldout_set_without_sound_logs_null_audio_not_zero(tmp_path) -> None:
    # Synthetic fl2va sample 2 has no soundtrack: keep it alone.
    folder = write_synthetic_dataset(tmp_path / "silent", task="fl2va", num_samples=3, seed=7, text_dim=16)
    for sample in sorted(folder.glob(f"*{SAMPLE_SUFFIX}"))[:2]:
        sample.unlink()
    (folder / INDEX_NAME).unlink()
    write_index(folder)
    assert [s.has_audio for s in CachedDataset(folder, "fl2va")] == [False]
    cfg = load_config(
        TINY_FL2VA, _args(tmp_path / "run", str(folder), "validation.at_start=true", "train.steps=1", "cfg.scale=3.0")
    )
    _fit_with_heldout(cfg)
    row = _rows(tmp_path / "run", "validation")[0]
    audio_keys = [k for k in row if k.startswith("val/loss_audio")]
    assert len(audio_keys) == 2 + len(SIGMAS) and all(row[k] is None for k in audio_keys), row
    # The totals are the video terms alone (loss_weights.video is 1).
    assert row["val/loss"] == row["val/loss_video"] > 0 and row["val/loss_cfg"] == row["val/loss_video_cfg"] > 0
    assert "nonfinite" not in row


@pytest.mark.slow
def test_heldout_loss_is_the_same_at_sp_2_at_dp_2_and_across_a_resume(tmp_path, heldout) -> None:
    common = ("validation.at_start=true", "validation.every=2")
    straight = tmp_path / "straight"
    run_forked(["train", str(TINY_FL2VA), *_args(straight, heldout, *common)])
    reference = _rows(straight, "validation")
    assert [m["step"] for m in reference] == [0, 2, 4]

    layouts = {
        "sp2": ["parallel.sp=2"],
        # The same global batch of two: one micro-batch on each of two DP ranks.
        "dp2": ["parallel.dp_shard=2", "train.grad_accum=1"],
    }
    for name, extra in layouts.items():
        run_forked(["train", str(TINY_FL2VA), *_args(tmp_path / name, heldout, *common, *extra)], nproc=2)
        got = _rows(tmp_path / name, "validation")
        assert [m["step"] for m in got] == [0, 2, 4], name
        for want, row in zip(reference, got):
            for key, value in want.items():
                if key.startswith("val/"):
                    assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, want["step"], key)

    # Preempted after step 2 and resumed: the step-4 evaluation is bitwise the straight run's.
    resumed = tmp_path / "resumed"
    run_forked(["train", str(TINY_FL2VA), *_args(resumed, heldout, *common, "debug.fault=[sigterm@2]")])
    run_forked(["train", str(TINY_FL2VA), *_args(resumed, heldout, *common)])
    assert _rows(resumed, "validation")[-1] == reference[-1]
    shutil.rmtree(tmp_path)


def test_a_resumed_runs_summary_compares_with_the_runs_first_evaluation(tmp_path, heldout, capsys) -> None:
    common = ("validation.at_start=true", "validation.every=2", "checkpoint.every=2")
    assert main(["train", str(TINY_FL2VA), *_args(tmp_path, heldout, *common, "train.steps=2")]) == 0
    capsys.readouterr()
    assert main(["train", str(TINY_FL2VA), *_args(tmp_path, heldout, *common, "checkpoint.resume=auto")]) == 0
    out = capsys.readouterr().out
    first, last = _rows(tmp_path, "validation")[0], _rows(tmp_path, "validation")[-1]
    assert (first["step"], last["step"]) == (0, 4)
    line = next(line for line in out.splitlines() if line.startswith("held-out loss"))
    assert line.startswith(f"held-out loss (steps 0 -> 4): {first['val/loss']:.4g} -> {last['val/loss']:.4g}"), line
