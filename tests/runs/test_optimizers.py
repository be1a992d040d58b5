"""`optim.name`: AdamW with states below float32 (torchao's quantized moments, bfloat16 with stochastic rounding).

The update rule is AdamW's for every kind; what is checked is what each stores, that its checkpoint
resumes bitwise (and under another sharding), that a run's first step (loss, grad_norm) does not
depend on the kind, and that the plan counts the bytes each keeps.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from h3train.cli import main
from h3train.config import load_config
from h3train.model.architecture import model_dims
from h3train.model.build import build_meta_model, store_trainable
from h3train.optim.kinds import build_optimizer, state_bytes, state_bytes_per_value, weights_dtype
from h3train.optim.lowbit import QUANT_BLOCK, BF16AdamW, stochastic_round_bf16, torchao_missing
from h3train.parallel.dims import ParallelDims
from h3train.plan import checkpoint_bytes, estimate

from helpers.launch import checkpoint_tensors, read_metrics, run_forked, tiny_args
from helpers.paths import TINY_FL2VA

pytestmark = pytest.mark.slow


def _ckpt(log_dir, step: int):
    return log_dir / "checkpoints" / f"step_{step:08d}"


def _weights(log_dir, step: int) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(_ckpt(log_dir, step), "model.")


# -- the bfloat16 AdamW ---------------------------------------------------------------------------


def test_bf16_adamw_on_float32_weights_is_torch_adamw() -> None:
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(48, 20))
    ref = torch.nn.Parameter(ours.detach().clone())
    a = BF16AdamW([ours], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    b = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(4):
        grad = torch.randn(48, 20)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours, ref)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(a.state[ours][key], b.state[ref][key])


def test_stochastic_rounding_is_unbiased_and_lands_updates_rounding_to_nearest_loses() -> None:
    value = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way between two bfloat16 values
    rounded = stochastic_round_bf16(value, key=7, offset=0).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - (1.0 + 2**-10)) < 2e-5
    signed = torch.randn(10_000)
    out = stochastic_round_bf16(signed, key=3, offset=0).float()
    # Always one of the two neighbours: never more than one bfloat16 step away, sign kept.
    assert ((out - signed).abs() <= signed.abs() * 2**-7).all() and (torch.sign(out) == torch.sign(signed)).all()

    sr = torch.nn.Parameter(torch.ones(50_000, dtype=torch.bfloat16))
    nearest = torch.nn.Parameter(torch.ones(50_000, dtype=torch.bfloat16))
    opt_sr, opt_nearest = BF16AdamW([sr], lr=1e-4), torch.optim.AdamW([nearest], lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        sr.grad, nearest.grad = torch.ones_like(sr), torch.ones_like(nearest)
        opt_sr.step()
        opt_nearest.step()
    assert opt_sr.state[sr]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(nearest, torch.ones_like(nearest)), "each 1e-4 update rounds away in bfloat16"
    assert abs(sr.float().mean().item() - (1.0 - 20e-4)) < 2e-4


def test_bf16_moments_follow_the_gradient_size_as_float32_adamw_does() -> None:
    """exp_avg_sq moves 0.1 % a step, under half a bfloat16 step: rounded to nearest it would stall
    (at about 0.43 of float32 AdamW's after 1,000 steps here, and stay there when the gradient shrinks)."""
    n = 4096
    grad = torch.rand(n) * 0.5 + 0.75
    ours, ref = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(n))
    a, b = BF16AdamW([ours], lr=1e-4), torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0)
    for step in range(1500):
        g = grad * (1.0 if step < 700 else 0.01)
        ours.grad, ref.grad = g.to(torch.bfloat16), g.clone()
        a.step()
        b.step()
        if step + 1 in (700, 1500):
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = a.state[ours][key].float().mean(), b.state[ref][key].mean()
                assert abs(got / want - 1) < 0.01, (step + 1, key, float(got / want))
    assert abs(ours.float().mean() / ref.mean() - 1) < 0.01


def test_stochastic_rounding_draws_by_element_not_by_shard() -> None:
    value = torch.randn(64, 33) * 3
    whole = stochastic_round_bf16(value, key=11, offset=0)
    rows = [stochastic_round_bf16(value[i : i + 16], key=11, offset=i * 33) for i in range(0, 64, 16)]
    assert torch.equal(torch.cat(rows), whole)
    assert not torch.equal(stochastic_round_bf16(value, key=12, offset=0), whole)


# -- bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_state_bytes_are_the_bytes_torchao_allocates(name: str) -> None:
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name]
    for numel in (1000, 4096, 4096 + QUANT_BLOCK[name] // 2, 12_800):
        p = torch.nn.Parameter(torch.zeros(numel))
        opt = cls([p], lr=1e-3)
        held = 0
        for signed in (True, False):
            buf = opt._new_buffer(p, signed)
            inner = buf.__tensor_flatten__()[0] if hasattr(buf, "__tensor_flatten__") else []
            held += sum(getattr(buf, n).nbytes for n in inner) if inner else buf.nbytes
        assert held == state_bytes(name, numel), (numel, held)
    assert 2.0 < state_bytes_per_value("adamw8bit") < 2.05 and 1.0 < state_bytes_per_value("adamw4bit") < 1.1


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamw4bit", "adamw_bf16"])
def test_plan_counts_each_optimizers_weights_gradients_and_moments(name: str) -> None:
    """The plan's per-rank state against the parameters a built model trains, sharded 4-way, with
    `state_bytes` (checked against torchao above) for each shard. The plan counts every matrix
    quantized, as all of the released model's are; here the narrow ones of the tiny widths (text
    and time inputs of 16) are not, which is most of the 10 % allowed."""
    dims_over = [
        "model.config.hidden_size=256",
        "model.config.ffn_dim=512",
        "model.config.num_attention_heads=8",
        "model.config.attention_head_dim=32",
    ]
    cfg = load_config(TINY_FL2VA, [f"optim.name={name}", *dims_over])
    model = build_meta_model(cfg)
    store_trainable(model, weights_dtype(cfg.optim))
    shard = 4
    weights = moments = 0
    for p in model.parameters():
        local = -(-p.shape[0] // shard) * (p.numel() // p.shape[0])
        weights += local * p.element_size()
        kind = name if name != "adamw_bf16" or p.dtype == torch.bfloat16 else "adamw"
        moments += state_bytes(kind, local)
    plan = estimate(model_dims(cfg), ParallelDims(dp_replicate=1, dp_shard=4, sp=1, world_size=4), cfg)
    assert plan.master_weights_bytes == plan.grads_bytes
    assert abs(plan.master_weights_bytes - weights) <= 0.01 * weights
    assert abs(plan.optimizer_bytes - moments) <= 0.10 * moments, (plan.optimizer_bytes, moments)
    plain_cfg = load_config(TINY_FL2VA, dims_over)
    plain = estimate(model_dims(cfg), ParallelDims(dp_replicate=1, dp_shard=4, sp=1, world_size=4), plain_cfg)
    if name != "adamw":
        assert plan.total_bytes < plain.total_bytes
        assert checkpoint_bytes(model_dims(cfg), cfg) < checkpoint_bytes(model_dims(cfg), plain_cfg)


def test_missing_torchao_is_one_line(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert torchao_missing("adamw_bf16") is None
    assert "pip install 'h3train[lowbit]'" in torchao_missing("adamw8bit")
    assert main(["check", str(TINY_FL2VA), "optim.name=adamw4bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.name" in err[0] and "torchao" in err[0]


def test_unknown_optimizer_is_one_line(capsys) -> None:
    assert main(["check", str(TINY_FL2VA), "optim.name=adafactor"]) == 2
    err = capsys.readouterr().err
    assert "optim.name" in err and "adamw8bit" in err


# -- runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """adamw8bit over 2 ranks (sp=2), three steps, a checkpoint after each."""
    log_dir = tmp_path_factory.mktemp("adamw8bit")
    run_forked(_run(log_dir, "optim.name=adamw8bit", "parallel.sp=2"), nproc=2, timeout=600)
    return log_dir


def _run(log_dir, *extra: str) -> list[str]:
    return tiny_args(log_dir, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=0", *extra)


def _resume_copy(src, dst, step: int, *extra: str, nproc: int) -> None:
    shutil.copytree(src, dst)
    run_forked(_run(dst, f"checkpoint.resume={_ckpt(dst, step)}", *extra), nproc=nproc, timeout=600)


def test_adamw8bit_resumes_bitwise_and_under_another_sharding(quantized, tmp_path) -> None:
    same, other = tmp_path / "same", tmp_path / "other"
    _resume_copy(quantized, same, 2, "optim.name=adamw8bit", "parallel.sp=2", nproc=2)
    straight, resumed = _weights(quantized, 3), _weights(same, 3)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "a resumed 8-bit step differs"
    # One rank: the 8-bit moments reshard (DCP over torchao's subclass; a shard torchao kept in
    # float32 at 2 ranks is quantized at 1). The step they drive lands within the quantization's
    # share of the 2-rank step, which zeroed or misplaced moments would not (a whole step off).
    _resume_copy(quantized, other, 2, "optim.name=adamw8bit", nproc=1)
    before, after = _weights(quantized, 2), _weights(other, 3)
    for key in straight:
        step = (straight[key] - before[key]).abs().max()
        assert (after[key] - straight[key]).abs().max() <= 0.25 * step + 1e-7, key
    assert [m["loss"] for m in read_metrics(other)][-1] == pytest.approx(read_metrics(quantized)[-1]["loss"], rel=1e-3)


def test_adamw4bit_steps_as_adamw8bit_does_resumes_bitwise_and_a_changed_kind_is_refused(quantized, tmp_path) -> None:
    four = tmp_path / "adamw4bit"
    run_forked(tiny_args(four, "train.steps=2", "checkpoint.every=1", "optim.name=adamw4bit"), timeout=600)
    m8, m4 = read_metrics(quantized), read_metrics(four)
    # Step 1 comes before any update (and sp=2 equals sp=1); step 2 follows the first update, which
    # either kind computes in float32 from zero moments before storing them quantized.
    for key in ("loss", "grad_norm"):
        assert m4[0][key] == pytest.approx(m8[0][key], rel=1e-5, abs=1e-6), key
    assert m4[1]["loss"] == pytest.approx(m8[1]["loss"], rel=1e-4)
    moved, second = _weights(four, 1), _weights(four, 2)
    assert all((moved[k] - second[k]).abs().max() > 0 for k in moved), "a 4-bit step left a tensor unchanged"
    # The 4-bit moments resume bitwise.
    again = tmp_path / "adamw4bit_resumed"
    shutil.copytree(four, again)
    args = tiny_args(again, "train.steps=2", "checkpoint.every=1", "optim.name=adamw4bit")
    run_forked([*args, f"checkpoint.resume={_ckpt(again, 1)}"], timeout=600)
    resumed = _weights(again, 2)
    assert all(torch.equal(second[k], resumed[k]) for k in second), "a resumed 4-bit step differs"
    proc = run_forked(
        _run(quantized, "optim.name=adamw", "parallel.sp=2", "train.steps=4"), nproc=2, check=False, timeout=300
    )
    assert proc.returncode == 2
    assert "holds adamw8bit optimizer states" in proc.stderr and "optim.name=adamw8bit" in proc.stderr


def test_adamw_bf16_is_the_same_under_sp_and_resumes_bitwise(tmp_path) -> None:
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    run_forked(_run(one, "optim.name=adamw_bf16"))
    run_forked(_run(two, "optim.name=adamw_bf16", "parallel.sp=2"), nproc=2)
    a, b = _weights(one, 3), _weights(two, 3)
    islands = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")
    for key, value in a.items():
        island = key.removeprefix("transformer.").split(".")[0] in islands
        assert value.dtype == (torch.float32 if island else torch.bfloat16), key
        if island:
            torch.testing.assert_close(value, b[key], rtol=1e-5, atol=1e-6)
            continue
        # The gradients differ by reduction order only (1e-7), and each element draws the same
        # random bits at either layout: a rounding decision flips rarely (and moves what follows by
        # a step or two).
        assert (value != b[key]).float().mean() <= 0.01, key
        torch.testing.assert_close(value.float(), b[key].float(), rtol=2**-6, atol=1e-5)
    moved = sum(int((a[k] != _weights(one, 1)[k]).sum()) for k in a)
    assert moved > 0
    _resume_copy(two, resumed, 2, "optim.name=adamw_bf16", "parallel.sp=2", nproc=2)
    c = _weights(resumed, 3)
    assert all(torch.equal(b[k], c[k]) for k in b), "a resumed adamw_bf16 step differs"
    assert [m["loss"] for m in read_metrics(two)] == [m["loss"] for m in read_metrics(resumed)]


def test_build_optimizer_kinds() -> None:
    model = torch.nn.Linear(8, 4)
    cfg = load_config(TINY_FL2VA, ["optim.name=adamw_bf16"])
    assert isinstance(build_optimizer(model, cfg.optim, seed=3), BF16AdamW)
    quantized = build_optimizer(model, load_config(TINY_FL2VA, ["optim.name=adamw8bit"]).optim)
    # The scheduler writes float LRs; the optimizer keeps them floats between steps.
    assert all(isinstance(g["lr"], float) for g in quantized.param_groups)
