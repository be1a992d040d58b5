"""`parallel.cpu_offload`: FSDP2's CPUOffloadPolicy trains exactly as the plain plan does.

On CPU-only torch the policy moves nothing, so this checks the plumbing (the policy reaches every
unit, the optimizer steps the offloaded shards, clip and DTensor state work) and that the numbers
are unchanged: two gloo ranks, dp_shard = 2, three AdamW steps with and without it.

On a GPU the offloaded gradients live on the host while the trainer's gradient norm and clip factor
are on the device, and no kernel multiplies a host tensor by a device tensor. The clip test puts the
norm on a second device of CPU-only torch (its lazy-tensor device), which refuses that product as
CUDA does, and trains through `h3train train`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from h3train.config import load_config
from h3train.model.build import build_model
from h3train.model.fsdp import apply_fsdp
from h3train.model.sp_forward import SequenceParallelH3
from h3train.objective import compute_loss, micro_batch_inputs
from h3train.optim.kinds import build_optimizer
from h3train.parallel.dims import ParallelContext, ParallelDims
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.synthetic import SyntheticSource
from h3train.train.trainer import Trainer

from helpers.launch import checkpoint_dir, checkpoint_tensors, read_metrics, tiny_args, train
from helpers.paths import TINY_FL2VA
from helpers.ranks import run_ranks


def _train(ctx: ParallelContext, cpu_offload: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = load_config(TINY_FL2VA)
    transformer = build_model(cfg, cfg.train.seed)
    model = apply_fsdp(SequenceParallelH3(transformer, SequenceParallel(None)), ctx, "float32", cpu_offload)
    # The five islands share one state: 1 refiner block + 2 blocks + islands + root = 5 units.
    states = {id(s): s for s in (fully_shard.state(m) for m in model.modules() if isinstance(m, FSDPModule))}
    groups = [s._fsdp_param_group for s in states.values()]
    assert len(groups) == 5 and all(isinstance(g.offload_policy, CPUOffloadPolicy) == cpu_offload for g in groups)
    optimizer = build_optimizer(model, cfg.optim)
    source = SyntheticSource(cfg.data.synthetic, transformer.config.text_dim, cfg.train.seed)
    norms = []
    for step in (1, 2, 3):
        ti = micro_batch_inputs(cfg, source[step * 2 + ctx.dp_rank], step=step, slot=ctx.dp_rank)
        compute_loss(model, ti).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        norms.append(float(norm.full_tensor()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict:
    ctx = ParallelContext(ParallelDims(1, world, 1, world), torch.device("cpu"))
    plain, offloaded = _train(ctx, False), _train(ctx, True)
    return {"plain": plain, "offloaded": offloaded}


@pytest.mark.slow
def test_cpu_offload_trains_as_without_it() -> None:
    result = run_ranks(_worker, 2)[0]
    (plain_norms, plain), (off_norms, off) = result["plain"], result["offloaded"]
    assert off_norms == pytest.approx(plain_norms, rel=1e-6)
    assert plain.keys() == off.keys()
    for name, p in plain.items():
        torch.testing.assert_close(off[name], p, rtol=1e-6, atol=1e-7, msg=name)
    # The updates happened: three steps moved the weights away from their initial values.
    first = load_config(TINY_FL2VA)
    init = dict(build_model(first, first.train.seed).named_parameters())
    assert any(not torch.equal(init[n.removeprefix("transformer.")], p) for n, p in plain.items())


@functools.cache
def _second_device() -> torch.device:
    """A device other than the CPU with real values on CPU-only torch: TorchScript's lazy tensors."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")


# Two steps of one micro-batch, each over the norm: every step clips. AdamW with eps = 1 steps by about
# lr * g, so the weights show the clip's factor (at eps = 1e-8 a step is nearly blind to the gradient's scale).
MAX_NORM = 1e-3
CLIPPED = (
    "train.steps=2",
    "train.grad_accum=1",
    "checkpoint.every=2",
    f"train.max_grad_norm={MAX_NORM}",
    "optim.eps=1.0",
)


def test_offloaded_gradients_clip_by_a_norm_on_another_device(tmp_path, monkeypatch, trained_runs) -> None:
    plain = trained_runs.get(*CLIPPED).dir
    grad_norm = Trainer._grad_norm
    devices = []

    def norm_on_the_device(self: Trainer) -> tuple[list[torch.Tensor], torch.Tensor]:
        grads, norm = grad_norm(self)
        devices.append({g.device for g in grads})
        return grads, norm.to(_second_device())

    monkeypatch.setattr(Trainer, "_grad_norm", norm_on_the_device)
    offloaded = tmp_path / "offloaded"
    train(tiny_args(offloaded, *CLIPPED, "parallel.cpu_offload=true"))
    assert devices == [{torch.device("cpu")}] * 2
    rows, off_rows = read_metrics(plain), read_metrics(offloaded)
    assert [r["step"] for r in off_rows] == [1, 2]
    assert all(r["grad_norm"] > MAX_NORM for r in off_rows)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in off_rows] == pytest.approx([r[key] for r in rows], rel=1e-6), key
    weights = checkpoint_tensors(checkpoint_dir(plain, 2), "model.")
    off_weights = checkpoint_tensors(checkpoint_dir(offloaded, 2), "model.")
    assert weights.keys() == off_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(off_weights[name], w, rtol=1e-6, atol=1e-7, msg=name)


def test_check_counts_the_offloaded_state_in_host_memory() -> None:
    from h3train.model.architecture import model_dims
    from h3train.plan import estimate, format_plan

    # Offloaded, FSDP2 gathers the AdaLN projections too (the tables are not computed where they live):
    # the device holds what a run without the tables holds, less the state.
    cfg = load_config(TINY_FL2VA, ["parallel.adaln_tables=false"])
    off = load_config(TINY_FL2VA, ["parallel.cpu_offload=true"])
    mesh = ParallelDims(1, 2, 1, 2)
    dims = model_dims(cfg)
    plain, offloaded = estimate(dims, mesh, cfg), estimate(dims, mesh, off)
    state = plain.master_weights_bytes + plain.grads_bytes + plain.optimizer_bytes
    assert plain.host_bytes == 0 and offloaded.host_bytes == state > 0
    assert offloaded.total_bytes == plain.total_bytes - state
    assert estimate(dims, mesh, load_config(TINY_FL2VA, ["parallel.adaln_tables=true"])).total_bytes < plain.total_bytes
    text = format_plan(offloaded)
    assert "(host: cpu_offload)" in text and "in host memory" in text
