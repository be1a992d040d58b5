"""`h3train bench` in its reduced CPU mode, and the FLOP arithmetic behind its MFU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from h3train.cli import main
from h3train.config import LossWeights, TimestepConfig
from h3train.model import quant
from h3train.model.architecture import model_kwargs
from h3train.model.sp_forward import SequenceParallelH3
from h3train.objective import compute_loss, make_training_inputs
from h3train.parallel.ulysses import SequenceParallel
from h3train.tasks.released import SHORT_ROWS
from h3train.tasks.synthetic import Clip, clip_sample
from h3train.tools import bench, gpu_checks, step_report

from helpers.paths import ROOT


def _training_inputs(clip: Clip, dims: dict):
    sample = clip_sample(clip, int(dims["text_dim"]), seed=0)
    return make_training_inputs(sample, torch.Generator().manual_seed(0), TimestepConfig(), LossWeights())


def test_reduced_bench_runs_through_the_cli_and_writes_its_figures(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--reduced", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "result: ok" in printed and "gradient parity on hidden 64" in printed

    report = json.loads(out.read_text())
    assert report["ok"] is True and report["mode"] == "reduced" and report["device"] == "cpu"
    assert [b["name"] for b in report["backends"]] == ["native", "math"]
    for b in report["backends"]:
        assert b["status"] == "ok" and b["sync_check"] == "n/a" and b["mfu"] is None
        assert math.isfinite(b["tokens_per_s"]) and b["tokens_per_s"] > 0
        assert math.isfinite(b["loss"]) and b["loss"] > 0
        assert b["tokens_per_s"] == pytest.approx(report["layout"]["seq_len"] / b["step_time_s"])
        # The trainer's two halves, each timed, and the step their sum.
        assert b["forward_backward_s"] > 0 and b["update_s"] > 0 and math.isfinite(b["grad_norm"])
        assert b["step_time_s"] == pytest.approx(b["forward_backward_s"] + b["update_s"])
    # The same weights and inputs under both kernels: the same loss to float32 rounding.
    assert report["backends"][0]["loss"] == pytest.approx(report["backends"][1]["loss"], rel=1e-5)

    # Each backend against the float32 step, in units of native's error, on the bench's own model in bf16.
    assert [p["backend"] for p in report["parity"]] == ["native", "math"]
    assert report["parity_model"]["hidden_size"] == 64 and report["parity_model"]["dtype"] == "bfloat16"
    assert report["parity_model"]["rows"] == report["layout"]["seq_len"]
    for parity in report["parity"]:
        assert parity["reference"] == "native" and parity["ok"] is True and parity["error"] is None
        assert parity["ratio"] <= parity["gate"] == bench.PARITY_GATE and parity["parameters"] > 0
        assert 0 < parity["global_rel_l2"] <= parity["max_rel_l2"] < 0.1
    assert report["parity"][0]["ratio"] == 1.0

    lay = report["layout"]
    assert lay["seq_len"] == lay["text"] + lay["video"] + lay["audio"]
    assert lay["video"] == lay["keyframe"] + lay["target_video"] and lay["keyframe"] == 2 * 4 * 6
    assert report["flops"]["total"] == sum(v for k, v in report["flops"].items() if isinstance(v, int) and k != "total")


def test_failed_parity_exits_1(tmp_path, capsys) -> None:
    # A gate below 1 fails every backend, native included (its ratio is 1 by construction).
    out = tmp_path / "bench.json"
    assert main(["bench", "--reduced", "--parity-tol", "0.5", "--repeats", "1", "--out", str(out)]) == 1
    assert "FAILED" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["ok"] is False and [p["ok"] for p in report["parity"]] == [False, False]


def test_unavailable_backend_exits_2_with_one_line(capsys) -> None:
    assert main(["bench", "--reduced", "--backends", "native,flash"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--backends" in err and "'flash'" in err and "CUDA" in err


def test_step_flops_match_torch_flop_counter_on_the_reduced_model() -> None:
    dims = model_kwargs({**bench.REDUCED_DIMS, "num_layers": 2})
    ti = _training_inputs(bench.REDUCED_CLIP, dims)
    model = bench.build_bench_model(dims, torch.device("cpu"), torch.float32, seed=0)
    # The math kernel decomposes into matmuls the counter sees, forward and backward.
    bench.set_backend(model, "_native_math")
    with FlopCounterMode(display=False) as counter:
        compute_loss(SequenceParallelH3(model, SequenceParallel(None)), ti).loss.backward()
    assert bench.step_flops(dims, bench.rows_of(ti)).total == counter.get_total_flops()


def test_full_bench_layout_is_the_released_5s_clip_and_its_flops() -> None:
    dims = model_kwargs({"num_layers": 4})
    assert (dims["hidden_size"], dims["num_attention_heads"], dims["attention_head_dim"]) == (5376, 56, 128)
    assert (dims["ffn_dim"], dims["text_dim"]) == (14336, 5120)
    rows = bench.rows_of(_training_inputs(bench.FULL_CLIP, dims))
    assert rows.seq_len == SHORT_ROWS == 41_774
    assert (rows.video - rows.keyframe, rows.keyframe, rows.audio, rows.text) == (37 * 24 * 42, 2 * 1008, 2 * 207, 2048)

    flops = bench.step_flops(dims, rows)
    # H3_NOTES: about 38.5 GFLOP per row forward for the linears of 50 blocks.
    per_row_fwd_50 = flops.blocks_linear / 3 / rows.seq_len / 4 * 50
    assert per_row_fwd_50 == pytest.approx(38.5e9, rel=1e-3)
    assert flops.blocks_attention == 3 * 4 * 4 * rows.seq_len**2 * 56 * 128
    assert flops.total == pytest.approx(9.9745e14, rel=1e-4)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(name: str, peak: float | None) -> None:
    assert bench.peak_tflops_for(name) == peak


def test_a_sync_in_the_timed_step_is_reported_with_its_phase_and_the_mode_restored(monkeypatch) -> None:
    # No CUDA here: the CUDA calls around the step are stand-ins; the step itself raises the error
    # torch raises under set_sync_debug_mode("error").
    modes: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: SimpleNamespace(record=lambda: None))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def syncing_loss():
        raise RuntimeError("called a synchronizing CUDA operation\nmore detail")

    class Trainer:
        phase = "start-up"

        def forward_backward(self, step: int):
            self.phase = f"forward of step {step}"
            syncing_loss()

    cuda = torch.device("cuda")
    timed = bench.timed_step(Trainer(), 1, bench.Clock(cuda), sync_check=True)
    sync = timed.sync
    assert timed.stats is None and timed.forward_backward_s == timed.update_s == 0.0
    assert sync.phase.startswith("forward") and sync.message == "called a synchronizing CUDA operation"
    assert any("syncing_loss" in frame for frame in sync.frames)
    assert modes == ["error", 0]

    res = bench.BackendResult(
        name="flash",
        backend="flash",
        step_time_s=1.0,
        tokens_per_s=1.0,
        achieved_tflops=1.0,
        loss=1.0,
        sync_check="sync",
        sync_error=sync,
    )
    table = bench.format_report(_report_with(res))
    assert "host-device sync during forward" in table and "result: FAILED" in table


def _report_with(res: bench.BackendResult, ok: bool | None = False) -> bench.BenchReport:
    report = bench.BenchReport(
        device="test",
        mode="reduced",
        dtype="bfloat16",
        precision="",
        gradient_checkpointing=False,
        model={"num_layers": 1, "num_refiner_layers": 1},
        parameters=1,
        layout={
            "height": 32,
            "width": 32,
            "frames": 22,
            "seq_len": 1,
            "text": 1,
            "keyframe": 0,
            "audio": 0,
            "target_video": 0,
            "timesteps": 1,
        },
        flops={"total": 1},
        peak_tflops=None,
        peak_tflops_source="",
        plan_memory_bytes=0,
        backends=[res],
    )
    if ok is not None:
        assert report.ok is ok
    return report


class _FakeTrainer:
    """A trainer stand-in whose step "syncs" where told to: in its forward, or in its update's read-back."""

    def __init__(self, modes: list, sync_in_forward: bool) -> None:
        self.modes, self.sync_in_forward, self.phase = modes, sync_in_forward, "start-up"

    def _sync(self) -> None:
        # What torch does on a synchronizing call under each sync debug mode.
        if self.modes[-1] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")
        if self.modes[-1] == "warn":
            import warnings

            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)

    def _reduce_step(self) -> float:
        self._sync()
        return 1.0

    def forward_backward(self, step: int) -> object:
        self.phase = f"forward of step {step}"
        if self.sync_in_forward:
            self._sync()
        return object()

    def update(self, step: int, grads: object) -> dict:
        self.phase = f"reduce of step {step}"
        return {"loss": self._reduce_step(), "grad_norm": 1.0}


def _fake_cuda(monkeypatch, modes: list) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    event = SimpleNamespace(record=lambda: None, elapsed_time=lambda other: 250.0)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: event)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)


def test_whole_step_check_counts_the_read_back_and_restores_the_mode(monkeypatch) -> None:
    modes: list = [0]
    _fake_cuda(monkeypatch, modes)
    trainer = _FakeTrainer(modes, sync_in_forward=False)
    timed = bench.timed_step(trainer, 1, bench.Clock(torch.device("cuda")), sync_check=True)
    stats, sync, read_back = timed.stats, timed.sync, timed.read_back_syncs
    assert sync is None and stats["loss"] == 1.0 and timed.forward_backward_s == timed.update_s == 0.25
    # The step under "error"; only its update, which holds the designed read-back, under "warn", syncs counted.
    assert read_back == 1 and modes == [0, "error", "warn", "error", 0]
    assert "_reduce_step" not in vars(trainer)


def test_whole_step_check_reports_a_sync_outside_the_read_back(monkeypatch) -> None:
    modes: list = [0]
    _fake_cuda(monkeypatch, modes)
    trainer = _FakeTrainer(modes, sync_in_forward=True)
    timed = bench.timed_step(trainer, 3, bench.Clock(torch.device("cuda")), sync_check=True)
    stats, sync = timed.stats, timed.sync
    assert stats is None and timed.forward_backward_s == timed.update_s == 0.0
    assert sync.phase == "forward of step 3" and sync.message == "called a synchronizing CUDA operation"
    assert any("forward_backward" in frame for frame in sync.frames) and modes[-1] == 0

    step = bench.BackendResult(
        name="flash", backend="flash", step_time_s=1.0, tokens_per_s=1.0, achieved_tflops=1.0, loss=1.0
    )
    step.sync_check, step.sync_error = "sync", sync
    fine = bench.BackendResult(
        name="native", backend="native", step_time_s=1.0, tokens_per_s=1.0, achieved_tflops=1.0, loss=1.0
    )
    report = _report_with(fine, ok=True)
    report.backends.append(step)
    assert report.ok is False
    assert "host-device sync during forward of step 3" in bench.format_report(report)


def test_more_than_the_designed_read_back_in_update_is_a_sync(monkeypatch) -> None:
    modes: list = [0]
    _fake_cuda(monkeypatch, modes)
    trainer = _FakeTrainer(modes, sync_in_forward=False)
    trainer.update = lambda step, grads: {"loss": trainer._reduce_step() + trainer._reduce_step(), "grad_norm": 1.0}
    timed = bench.timed_step(trainer, 2, bench.Clock(torch.device("cuda")), sync_check=True)
    # A warning stops nothing: the step ran and was timed, and both syncs are named.
    assert timed.stats["loss"] == 2.0 and timed.update_s == 0.25 and timed.read_back_syncs == 2
    assert timed.sync.phase == "update of step 2" and len(timed.sync.frames) == 2
    assert all("test_bench.py" in frame for frame in timed.sync.frames) and modes[-1] == 0

    res = bench.BackendResult(
        name="native", backend="native", step_time_s=1.0, tokens_per_s=1.0, achieved_tflops=1.0, loss=1.0
    )
    res.sync_check, res.sync_error, res.read_back_syncs = "sync", timed.sync, timed.read_back_syncs
    assert "host-device sync during update of step 2" in bench.format_report(_report_with(res, ok=False))


def test_unchecked_step_sets_no_sync_mode_and_counts_nothing(monkeypatch) -> None:
    modes: list = [0]
    _fake_cuda(monkeypatch, modes)
    timed = bench.timed_step(_FakeTrainer(modes, sync_in_forward=False), 1, bench.Clock(torch.device("cuda")), False)
    assert timed.sync is None and timed.read_back_syncs is None and modes == [0]


@pytest.mark.slow
def test_gpu_check_script_runs_the_reduced_check_on_cpu_and_prints_its_json(tmp_path) -> None:
    out = tmp_path / "check.json"
    script = ROOT / "scripts" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(script), "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gpu_check: JSON {out}" in done.stdout and "no CUDA device" in done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["mode"] == "reduced"
    assert report["step_setup"]["master_weights"] == "float32"
    assert [s["name"] for s in report["steps"]] == ["native", "math"]
    for step in report["steps"]:
        assert step["status"] == "ok" and step["sync_check"] == "n/a"
        assert step["step_time_s"] > 0 and math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])

    # The trainer checks after the bench, in the same JSON: every one ran on CPU ranks over gloo and passed.
    checks = report["checks"]
    assert checks["ok"] is True and checks["device"] == "cpu" and checks["model"]["dtype"] == "float32"
    results = {r["name"]: r for r in checks["results"]}
    assert list(results) == [name for name, _, _ in gpu_checks.CHECKS]
    # FSDP2 shards integer parameters from torch 2.12: before it the trainer refuses an int8 base, as the check says.
    refused = () if quant.INTEGER_CODES_SHARD else ("lora_int8",)
    for name in refused:
        reason = results[name]["reason"]
        assert results[name]["status"] == "skipped" and f"torch {quant.FIRST_INTEGER_CODES_TORCH}" in reason
    ran = {name: r for name, r in results.items() if name not in (*refused, "block_memory_vs_rehearsal")}
    assert all(r["status"] == "passed" and r["reason"] is None and r["seconds"] > 0 for r in ran.values()), ran
    # No device allocator on the CPU: the rehearsal of the block runs, the comparison is skipped.
    block = results["block_memory_vs_rehearsal"]
    if importlib.util.find_spec("h3train.run.rehearse") is None:
        assert block["status"] == "not run" and block["reason"].startswith("not yet")
    else:
        assert block["status"] == "skipped" and block["reason"].startswith("no CUDA"), block
        assert block["numbers"]["rehearsed_peak_bytes"] > 0 and block["numbers"]["rows"] == report["layout"]["seq_len"]

    averaging = results["averaging"]["numbers"]
    assert averaging["backend"] == {"dp_shard_sp": "gloo"} and averaging["ranks"] == {"dp_shard_sp": 1}
    assert averaging["probe_values"] == {"dp_shard_sp reduce-scatter": 1.0, "dp_shard_sp all-reduce": 1.0}
    assert all(err == 0.0 for errs in averaging["direct_rel_l2"].values() for err in errs.values())
    assert averaging["probe_summed"] == [] and "multi-rank probe runs at every training start" in averaging["coverage"]

    stepped = [name for name in ran if name.startswith(("optim_", "lora_"))]
    assert len(stepped) == 4 - len(refused)
    for name in stepped:
        n = results[name]["numbers"]
        assert math.isfinite(n["loss"]) and math.isfinite(n["grad_norm"]) and n["skipped_steps"] == 0, name
        assert 0 < n["changed_tensors"] <= n["trainable_tensors"] and n["max_abs_change"] > 0, name
        assert n["step_s"] == pytest.approx(n["forward_backward_s"] + n["update_s"]) and n["update_s"] > 0, name
        if name.startswith("lora_"):
            codes = {"lora_int8": "int8", "lora_float8": "float8_e4m3fn"}[name]
            assert n["quantized_layers"] > 0 and n["code_dtypes"] == [codes] and n["base_codes_changed"] == 0
    assert results["optim_adamw8bit"]["numbers"]["moments"]["OptimState8bit"] > 0
    assert results["optim_adamw_bf16"]["numbers"]["moments"]["bfloat16"] > 0

    save = results["async_save"]["numbers"]
    assert save["differing_from_blocking"] == 0 and save["tensors"] > 0 and save["changed_by_next_step"] > 0
    assert save["save_call_s"] > 0 and save["step_after_save_s"] > 0
    if save["staging"].startswith("background"):  # torch >= 2.9: DCP's DefaultStager, pinned only on CUDA
        assert save["pinned_requested"] is False and save["staged_bytes"] >= save["bytes"]
    else:
        assert "synchronous copy" in save["staging"]
    assert "checks: ok" in done.stdout and "result: ok" in done.stdout


def test_a_check_that_raises_fails_the_checks_and_the_others_still_run(monkeypatch) -> None:
    def broken(setup, res):
        raise RuntimeError("NCCL error: unhandled system error\nmore detail")

    def skipped(setup, res):
        res.status, res.reason = gpu_checks.SKIPPED, "needs something absent here"

    def passed(setup, res):
        res.numbers["value"] = 1.5

    table = (("broken", "raises", broken), ("skipped", "skips", skipped), ("fine", "passes", passed))
    monkeypatch.setattr(gpu_checks, "CHECKS", table)
    report = gpu_checks.run_checks(reduced=True, device=torch.device("cpu"))
    statuses = {r.name: (r.status, r.reason) for r in report.results}
    assert statuses == {
        "broken": ("failed", "RuntimeError: NCCL error: unhandled system error"),
        "skipped": ("skipped", "needs something absent here"),
        "fine": ("passed", None),
    }
    assert report.ok is False and report.to_json()["ok"] is False
    assert any("broken" in line for line in report.results[0].numbers["traceback"])
    assert "checks: FAILED" in gpu_checks.format_checks(report)
    # A skip is no failure.
    monkeypatch.setattr(gpu_checks, "CHECKS", table[1:])
    assert gpu_checks.run_checks(reduced=True, device=torch.device("cpu")).ok is True


def test_float8_lora_runs_below_compute_capability_8_9(monkeypatch, tmp_path) -> None:
    """The float8 base is weight-only (cast to bfloat16, no `_scaled_mm`): an A100 runs its check."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    built: list[dict] = []

    class Built(Exception):
        pass

    def trainer(setup, name, overrides):
        built.append(overrides)
        raise Built

    monkeypatch.setattr(gpu_checks, "_trainer", trainer)
    setup = gpu_checks.check_setup(torch.device("cuda", 0), reduced=False, seed=0, root=tmp_path)
    res = gpu_checks.CheckResult("lora_float8", "")
    with pytest.raises(Built):
        gpu_checks.check_lora("float8")(setup, res)
    assert res.status == "passed" and built and built[0]["lora.base_quant"] == "float8"


def test_sync_counter_counts_host_reads_of_the_training_thread_once() -> None:
    import threading

    from h3train.tools.host_syncs import SyncCounter

    counter = SyncCounter()
    try:
        counter.active = True
        t = torch.arange(3.0)
        float(t.sum())
        t.sum().item()
        t.cpu().tolist()  # one read: the list comes from a tensor already on the host
        worker = threading.Thread(target=lambda: t.sum().item())  # another thread: not the step's
        worker.start()
        worker.join()
        counter.active = False
        t.sum().item()
    finally:
        counter.restore()
    assert sum(counter.calls.values()) == 3, counter.calls
    assert {k.split(" in ")[0] for k in counter.calls} == {"float", "item", "cpu"}
    assert torch.Tensor.item is counter._originals["item"]


def test_step_report_prints_every_row_of_its_table() -> None:
    report = step_report
    sp1 = {"rows": 2058, "step_s": 1.0, "bare_step_s": 0.98, "step_ratio": 1.02, "step_ratio_fused_bare": 1.01,
           "activation_bytes": 200,
           "activation_bytes_checkpointed": 20, "activation_measure": "m", "load_s": 0.04, "noise_s": 0.01}  # fmt: skip
    sp2 = {"step_s": 1.0, "activation_bytes": 100, "activation_bytes_checkpointed": 11, "counted_steps": 2,
           "collectives": {"all_to_all": 16, "all_reduce": 4, "all_gather": 22, "fsdp_all_gather": 20,
                           "fsdp_reduce_scatter": 6, "by_entry": {}},
           "syncs": {"tolist in trainer.py:_reduce_step": 2}, "save_blocking_s": 0.04, "save_staged_wait_s": 0.01,
           "save_background_s": 0.2, "step_after_save_s": 1.2, "save_commit_s": 0.01, "save_first_blocking_s": 0.1,
           "save_first_background_s": 0.3,
           "blocks": 2}  # fmt: skip
    # The same run with the tables off: Ulysses' 4 all-to-alls a block, the tables' 2 a step gone.
    sp2_off = {**sp2, "collectives": {**sp2["collectives"], "all_to_all": 16 - 4}}
    rows = report.build_rows(sp1, {**sp2, "collectives": {**sp2["collectives"], "all_to_all": 16 + 4}}, sp2_off)
    values = {measure.strip(): value for measure, value, _, _ in rows}
    assert values == {
        "step / bare diffusers forward+backward+AdamW, sp=1": "1.020",
        "the same, the bare step with fused AdamW": "1.010",
        "saved activations per rank, sp=2 / sp=1": "0.500",
        "with gradient checkpointing (full)": "0.550",
        "all-to-alls per block per step, tables on": "5",
        "all-to-alls per block per step, tables off": "3",
        "device->host syncs per step, tables on": "1",
        "device->host syncs per step, tables off": "1",
        "extra all-reduces per step": "2",
        "checkpoint save blocking / step": "0.050",
        "FSDP2 collectives per step": "13",
        "data: step / load of a 480p 5 s sample, cold cache": "25.0",
    }
    assert "value" in report.format_rows(rows, "pkg").splitlines()[1]
