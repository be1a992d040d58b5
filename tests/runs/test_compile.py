"""`model.compile`: regional torch.compile of each transformer block equals the eager step.

Two gloo ranks at sp = 2 under FSDP2 train two steps of the tiny FL2VA model through the CLI, once
eager and once compiled, with selective checkpointing so that a compiled block is also
recomputed in backward. The compiled blocks use `fullgraph=True`: a graph break in the Ulysses
processor fails the run. The test compiles with `aot_eager` (dynamo and AOT autograd, eager
kernels): inductor's C++ codegen costs about a minute per graph on a small CPU machine, and what
this test guards, tracing the processor, is the same for both; inductor stays the default.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from helpers.paths import TINY_FL2VA

from helpers.launch import dump_dir, read_metrics, run_env, run_h3train, tiny_args

from helpers.reference import reference_step, relative_l2

TOL = 1e-5


def _overrides(run_dir) -> list[str]:
    return [
        "parallel.sp=2",
        "train.steps=2",
        "debug.dump_step=2",
        "model.activation_checkpointing=selective",
        "model.checkpoint_every=2",
        f"data.path={run_dir / 'data'}",
    ]


def _train(run_dir, extra: list[str], env: dict[str, str] | None = None):
    """Metrics, step 2's dumped gradients and the run's stderr."""
    overrides = [*_overrides(run_dir), *extra]
    proc = run_h3train(tiny_args(run_dir, *overrides), nproc=2, timeout=240, env=env)
    return read_metrics(run_dir), load_file(dump_dir(run_dir, 2) / "grads.safetensors"), proc.stderr


@pytest.mark.slow
def test_compiled_blocks_equal_eager_at_sp2_under_fsdp2(tmp_path) -> None:
    eager_metrics, eager_grads, _ = _train(tmp_path / "eager", [])
    compiled_metrics, compiled_grads, log = _train(
        tmp_path / "compiled",
        ["model.compile=true", "model.compile_backend=aot_eager"],
        # dynamo prints each graph it traces: the blocks were compiled, Ulysses' all-to-alls inside.
        env=run_env(TORCH_LOGS="graph_code"),
    )
    assert "TRACED GRAPH" in log and "all_to_all_single" in log

    # The eager run is right: the unsharded diffusers step on the dumped weights. tiny_fl2va packs
    # 51 rows, so sp = 2 pads one, and block 0 is recomputed with the real sequence length.
    _, ref_grads, _ = reference_step(TINY_FL2VA, _overrides(tmp_path / "eager"), dump_dir(tmp_path / "eager", 2), 1, 2)
    for name, g in ref_grads.items():
        assert relative_l2(eager_grads[name], g) <= TOL, name
    assert len(eager_metrics) == len(compiled_metrics) == 2
    for e, c in zip(eager_metrics, compiled_metrics):
        assert c["loss"] == pytest.approx(e["loss"], rel=TOL, abs=1e-7)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=TOL, abs=1e-7)
    # Step 2's gradients, after one update: the compiled forward and backward of every parameter.
    assert eager_grads.keys() == compiled_grads.keys()
    for name, g in eager_grads.items():
        err = relative_l2(compiled_grads[name], g)
        assert err <= TOL, f"{name}: compiled gradient off by relative L2 {err:.2e}"
