"""`model.compile`: regional torch.compile of each transformer block equals the eager step.

Two gloo ranks at sp = 2 under FSDP2 train two steps of the tiny FL2VA model through the CLI, once
eager and once compiled, with selective checkpointing, so that every compiled block saves its attention
output and recomputes the rest in backward (the selective checkpoint traced inside the compiled graph).
In one process, a model whose blocks checkpoint differently (one selective, one full) is compiled and
its backward graphs read. The compiled blocks use `fullgraph=True`: a graph break in the Ulysses
processor or the checkpoint fails the run. The test compiles with `aot_eager` (dynamo and AOT autograd, eager
kernels): inductor's C++ codegen costs about a minute per graph on a small CPU machine, and what
this test guards, tracing the processor, is the same for both; inductor stays the default.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from h3train.config import load_config
from h3train.model.build import build_model
from h3train.model.sp_forward import SequenceParallelH3
from h3train.objective import micro_batch_inputs
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.synthetic import SyntheticSource

from helpers.launch import dump_dir, read_metrics, run_env, run_forked, run_h3train, tiny_args
from helpers.paths import TINY_FL2VA
from helpers.reference import reference_step, relative_l2

TOL = 1e-5


def _overrides(run_dir) -> list[str]:
    return [
        "parallel.sp=2",
        "train.steps=2",
        "debug.dump_step=2",
        "model.activation_checkpointing=selective",
        f"data.path={run_dir / 'data'}",
    ]


def _train(run_dir, extra: list[str], env: dict[str, str] | None = None):
    """Metrics, step 2's dumped gradients and the run's stderr: on forked ranks, or under torchrun when the
    run has an environment of its own (torch reads `TORCH_LOGS` when it is imported)."""
    overrides = [*_overrides(run_dir), *extra]
    launch = run_forked if env is None else run_h3train
    proc = launch(tiny_args(run_dir, *overrides), nproc=2, timeout=240, env=env)
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
    # The selective checkpoint is traced inside each block's graph, not run around it.
    assert "tag_activation_checkpoint" in log

    # The eager run is right: the unsharded diffusers step on the dumped weights. tiny_fl2va packs
    # 51 rows, so sp = 2 pads one, and every block is recomputed with the real sequence length.
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


def _capturing_backend(dynamo_graphs: list, aot_graphs: list):
    """`aot_eager` that keeps each graph's ops: dynamo's graphs (`dynamo_graphs`) and AOT autograd's
    partitioned forward and backward graphs (`aot_graphs`, as `(kind, op counts)`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def ops(gm) -> Counter:
        return Counter(str(node.target) for node in gm.graph.nodes if node.op == "call_function")

    def compiler(kind: str):
        def compile_graph(gm, example_inputs):
            aot_graphs.append((kind, ops(gm)))
            return make_boxed_func(gm.forward)

        return compile_graph

    aot = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )

    def backend(gm, example_inputs):
        dynamo_graphs.append(ops(gm))
        return aot(gm, example_inputs)

    return backend


def test_compiled_blocks_of_mixed_policies_equal_eager_and_keep_attention() -> None:
    """Block 0 selective, block 1 full, both compiled, float64, sp = 1: every gradient and the output
    without gradients equal the eager model's that recomputes nothing; block 0's backward graph recomputes
    its projections but not attention, whose output its forward graph saves."""
    cfg = load_config(TINY_FL2VA)
    sample = SyntheticSource(cfg.data.synthetic, cfg.model.config["text_dim"], cfg.train.seed)[0]
    inputs = micro_batch_inputs(cfg, sample, step=1, slot=0).model_inputs
    dynamo_graphs: list = []
    aot_graphs: list = []

    def run(policy, backend=None) -> tuple[dict, tuple]:
        torch._dynamo.reset()
        model = build_model(cfg, seed=0).to(torch.float64)
        wrapped = SequenceParallelH3(
            model,
            SequenceParallel(None),
            activation_checkpointing=policy,
            compile_blocks=backend is not None,
            compile_backend=backend,
        )
        out = wrapped(**inputs)
        (out[0].square().mean() + out[1].square().mean()).backward()
        with torch.no_grad():
            inference = wrapped(**inputs)
        return {name: p.grad for name, p in model.named_parameters()}, inference

    expected, expected_inference = run("none")
    got, inference = run(("selective", "full"), _capturing_backend(dynamo_graphs, aot_graphs))
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-15, msg=name)
    torch.testing.assert_close(inference, expected_inference, rtol=1e-12, atol=1e-15)

    # The selective block's graph holds the checkpoint; the full block is checkpointed around its graph.
    checkpointed = ["tag_activation_checkpoint" in " ".join(ops) for ops in dynamo_graphs]
    assert checkpointed.count(True) >= 1 and checkpointed.count(False) >= 1, checkpointed
    attention = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    forward = [ops for kind, ops in aot_graphs if kind == "forward"]
    backward = [ops for kind, ops in aot_graphs if kind == "backward"]
    assert len(backward) == 2 and all(ops[attention] == 1 for ops in forward), aot_graphs
    # Neither backward graph runs attention forward again (the full block runs its forward graph again)...
    assert all(ops[attention] == 0 and ops[attention.replace(".default", "_backward.default")] == 1 for ops in backward)
    # ... and one, the selective block's, recomputes its projections.
    assert backward[0]["aten.mm.default"] != backward[1]["aten.mm.default"], backward
