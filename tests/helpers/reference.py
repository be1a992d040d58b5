"""Helpers to run h3train as users do and to recompute its numbers with plain diffusers.

The reference is single-process and unsharded: `MiniMaxH3Transformer3DModel.forward` on the same
weights and the same inputs, the loss built from the dumped targets, masks and weights.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from ranks import collective_checks, fork_ranks
from safetensors.torch import load_file

from h3train.checkpoint import step_dir_name
from h3train.config import load_config
from h3train.data.source import build_sampler, build_source, load_shared_negative
from h3train.objective import compute_loss, micro_batch_inputs

ROOT = Path(__file__).resolve().parents[1]
TINY_FL2VA = ROOT / "configs" / "tiny_fl2va.yaml"


# -- a tiny run: its arguments and the folders it writes -------------------------------------------


def tiny_overrides(log_dir: Path | str, *overrides: str) -> list[str]:
    """The overrides of a run in `log_dir` without a progress bar, then `overrides` (a later one wins)."""
    return [f"logging.dir={log_dir}", "logging.progress=false", *overrides]


def tiny_args(log_dir: Path | str, *overrides: str, config: Path | str = TINY_FL2VA) -> list[str]:
    """`train CONFIG` and `tiny_overrides(log_dir, *overrides)`: `h3train`'s arguments for a run of `config`
    (for `h3train.cli.main`, `run_h3train` and `h3train_command`)."""
    return ["train", str(config), *tiny_overrides(log_dir, *overrides)]


def checkpoint_dir(log_dir: Path | str, step: int) -> Path:
    """The checkpoint that a run in `log_dir` saves at `step` (under the default `checkpoint.dir`)."""
    return Path(log_dir) / "checkpoints" / step_dir_name(step)


def dump_dir(log_dir: Path | str, step: int) -> Path:
    """The folder of `debug.dump_step=step` of a run in `log_dir`."""
    return Path(log_dir) / "dump" / f"step_{step}"


# -- launching h3train -------------------------------------------------------------------------------


def h3train_command(args: list[str], nproc: int = 1, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m h3train ARGS`, or under `torchrun --standalone` when nproc > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "h3train", *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*torchrun, *launcher_args, "-m", "h3train", *args]


def run_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a launched run: one thread per rank, wandb offline, unbuffered output, and
    process groups that check every collective across their ranks.

    `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`ranks.collective_checks`) wraps each gloo group so that, before
    every collective, its ranks compare the op, shapes and dtypes: a rank that issues a collective its
    peers do not fails there with `Detected mismatch between collectives`, where NCCL on a cluster
    would hang.
    """
    env = os.environ if base is None else base
    return {
        **collective_checks(),
        **env,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def run_h3train(
    args: list[str],
    nproc: int = 1,
    timeout: float = 180,
    check: bool = True,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
):
    """Run `h3train ARGS` as a user launches it (see `h3train_command`), in the environment of `run_env`."""
    proc = run_process_group(h3train_command(args, nproc, launcher_args), env or run_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"h3train {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def torchrun_error_line(stderr: str) -> str:
    """The one `h3train: error:` line of a run that torchrun launched and that failed cleanly.

    A rank prints it once; after torchrun's own report (its traceback and table) it is printed again,
    as the last line of stderr.
    """
    ours = [line for line in stderr.splitlines() if line.startswith("h3train: error: ")]
    assert len(ours) == 2 and ours[0] == ours[1], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ours[0], stderr[-3000:]
    return ours[0]


# Mount a tmpfs of $1 bytes on $2, run the rest, then copy what the tmpfs holds to $3 (it goes with
# the namespace) and exit with the run's code.
_ON_SMALL_DISK = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; d="$2"; k="$3"; shift 3; "$@"; rc=$?; ' + (
    'cp -a "$d/." "$k"; exit $rc'
)


@functools.cache
def _namespaces() -> str | None:
    """Why this machine cannot mount a private tmpfs (None: it can)."""
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt || mount -t tmpfs tmpfs /tmp"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available: {exc}"
    return None if proc.returncode == 0 else f"no private mount namespace here: {proc.stderr.strip()}"


def on_small_disk(folder: Path, size: int, args: list[str], nproc: int = 1) -> tuple[subprocess.CompletedProcess, Path]:
    """`h3train ARGS` with a tmpfs of `size` bytes mounted on `folder`, in a mount namespace of its own
    (`unshare -rm`), so that writes there fail with ENOSPC as on a full disk. Returns the run and a copy
    of what the tmpfs held (`<folder>.kept`; the tmpfs goes with the namespace). A machine that cannot
    make such a namespace skips the test, saying why."""
    reason = _namespaces()
    if reason is not None:
        pytest.skip(reason)
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder.with_name(folder.name + ".kept")
    kept.mkdir()
    cmd = ["unshare", "-rm", "sh", "-c", _ON_SMALL_DISK, "sh", str(size), str(folder), str(kept)]
    proc = run_process_group([*cmd, *h3train_command(args, nproc)], run_env(), timeout=240)
    assert proc.returncode != 97, proc.stderr
    return proc, kept


def run_forked(
    args: list[str], nproc: int = 1, timeout: float = 180, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`h3train ARGS` in `nproc` fresh processes forked from a server that has imported h3train (`ranks`):
    one as `python -m h3train` runs, more as torchrun's workers of one node run. For what a run
    computes and writes; tests of the launch itself (signals sent from outside, restarts, what a node
    prints, scripts) use `run_h3train`."""
    proc = fork_ranks(args, nproc, env or run_env(), ROOT, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"h3train {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def train(args: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> str:
    """`h3train ARGS` to completion: one process in this one (`h3train.cli.main`, no interpreter to start,
    no imports to repeat), more as forked ranks (`run_forked`, in `env`). A run that signals itself
    (`debug.fault=[sigterm@...]`, `kill...`) must use `run_forked`. Returns the forked ranks' stdout
    (empty for a run in this process)."""
    if nproc > 1:
        return run_forked(args, nproc=nproc, env=env).stdout
    from h3train.cli import main

    assert main(args) == 0, f"h3train {' '.join(args)} failed"
    return ""


def run_process_group(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own; on timeout kill the whole session (torchrun's workers too)."""
    with start_in_session(cmd, env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# The signals a test sends to a process it launched (or a run sends itself through `debug.fault`).
SENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def default_signals() -> None:
    """`preexec_fn` of a launched process: the default disposition for `SENT_SIGNALS`, whatever pytest's is.

    An ignored signal stays ignored through fork and exec, and pytest may be started with SIGINT ignored
    (a background job of a non-interactive shell, some CI runners) or SIGHUP (`nohup`). bash cannot trap
    a signal that was ignored when it started, and Python installs no KeyboardInterrupt handler then: a
    Ctrl-C test would train on unsignalled. Each launched process gets what an interactive shell gives it.
    """
    for signum in SENT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def start_in_session(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` in ROOT in a session of its own (so that `os.killpg` reaches torchrun's workers), with the
    default disposition of every signal a test sends (`default_signals`) and stdout and stderr piped as text."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )


def signal_after_steps(
    proc: subprocess.Popen, log_dir: Path, signum: int, steps: int = 1, timeout: float = 120, group: bool = False
) -> tuple[str, str]:
    """Once `log_dir/metrics.jsonl` holds `steps` lines, send `signum` to `proc` (with `group`, to its whole
    process group, as a terminal's Ctrl-C reaches torchrun and its workers); return its (stdout, stderr).

    On a timeout or a failed assertion the process's whole session is killed.
    """
    metrics = Path(log_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
            assert proc.poll() is None and time.monotonic() < deadline, "training never logged a step"
            time.sleep(0.1)
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def checkpoint_tensors(checkpoint: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a DCP checkpoint whose keys start with `prefix` (e.g. `model.`), read in this
    process, keyed without the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }
    dcp.load(out, storage_reader=reader, no_dist=True)
    return {k.removeprefix(prefix): v for k, v in out.items()}


def checkpoint_tensor_bytes(checkpoint: Path) -> int:
    """Bytes of the tensors a DCP checkpoint holds, by its metadata (shapes and dtypes; DCP's framing aside)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * m.properties.dtype.itemsize for m in metadata.values() if hasattr(m, "size"))


def run_cli(capsys, args: list[str]) -> tuple[int, str, str]:
    """`h3train ARGS` in this process: its exit code, stdout and stderr; a traceback on stderr fails."""
    from h3train.cli import main

    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return rc, out, err


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines() if line]


def reference_step(config: Path, overrides: list[str], dump_dir: Path, dp: int, step: int = 1):
    """Unsharded loss, per-parameter gradients and grad norm of optimizer step `step`.

    Rank 0's inputs are read from the dump; the other DP ranks' inputs are rebuilt from the same
    deterministic sampler and RNG (and rank 0's rebuild is checked against the dump).
    """
    cfg = load_config(config, overrides)
    meta = json.loads((dump_dir / "meta.json").read_text())
    model = MiniMaxH3Transformer3DModel(**meta["model_config"])
    model.load_state_dict(load_file(dump_dir / "weights.safetensors"), strict=True)
    model.float()
    return _reference_backward(cfg, meta, model, dump_dir, dp, step)


def reference_model_from_dump(dump_dir: Path) -> MiniMaxH3Transformer3DModel:
    """The dumped step's model rebuilt with diffusers and peft alone, float32, trained parameters unfrozen.

    Full fine-tuning: every parameter trains. LoRA: the base is loaded under its diffusers names, the
    adapter added from the dumped peft config, its factors set with `set_peft_model_state_dict`, and
    the parameters with a dumped gradient (adapters, `lora.train_modules`) are the trained ones.
    """
    from peft import LoraConfig, set_peft_model_state_dict

    meta = json.loads((dump_dir / "meta.json").read_text())
    weights = load_file(dump_dir / "weights.safetensors")
    trained = set(load_file(dump_dir / "grads.safetensors"))
    model = MiniMaxH3Transformer3DModel(**meta["model_config"])
    if meta.get("lora") is None:
        model.load_state_dict(weights, strict=True)
        return model.float()
    is_factor = [k for k in weights if ".lora_A." in k or ".lora_B." in k]
    model.load_state_dict({k: v for k, v in weights.items() if k not in is_factor}, strict=True)
    lora = {k: v for k, v in meta["lora"].items() if k not in ("peft_type", "peft_version", "auto_mapping")}
    model.add_adapter(LoraConfig(**lora))
    result = set_peft_model_state_dict(model, {k: weights[k] for k in is_factor})
    assert not result.unexpected_keys, result.unexpected_keys
    model.float()
    for name, param in model.named_parameters():
        param.requires_grad_(lora_file_name(name) in trained)
    assert {lora_file_name(n) for n, p in model.named_parameters() if p.requires_grad} == trained
    return model


def lora_file_name(name: str) -> str:
    """A live peft parameter path -> the dump's name for it (diffusers name / peft state-dict name)."""
    return (
        name.replace(".base_layer.", ".")
        .replace(".lora_A.default.", ".lora_A.")
        .replace(".lora_B.default.", ".lora_B.")
    )


def reference_step_from_dump(config: Path, overrides: list[str], dump_dir: Path, dp: int, step: int):
    """`reference_step` for any dump, full or LoRA: (loss, gradients of the trained parameters, norm)."""
    cfg = load_config(config, overrides)
    meta = json.loads((dump_dir / "meta.json").read_text())
    return _reference_backward(cfg, meta, reference_model_from_dump(dump_dir), dump_dir, dp, step)


def _reference_backward(cfg, meta: dict, model, dump_dir: Path, dp: int, step: int):
    dumped = load_file(dump_dir / "inputs.safetensors")

    source = build_source(cfg, meta["model_config"]["text_dim"])
    shared = load_shared_negative(cfg)
    accum = cfg.train.grad_accum
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(dp):
        sampler = build_sampler(source, cfg, rank, dp)
        sampler.position = (step - 1) * accum * dp
        for micro in range(accum):
            sample = source[sampler.next_index()]
            ti = micro_batch_inputs(cfg, sample, step, micro * dp + rank, shared)
            if rank == 0:
                branches = {"": ti.model_inputs, "uncond.": ti.uncond_inputs or {}}
                for prefix, inputs in branches.items():
                    for name, value in inputs.items():
                        key = f"m{micro}.{prefix}{name}"
                        assert torch.equal(dumped[key], value), f"dumped {key} differs"
            loss = compute_loss(lambda **kw: model(**kw, return_dict=False), ti).loss
            (loss / (accum * dp)).backward()
            total += loss.detach().double()
    grads = {lora_file_name(name): p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
    return float(total / (accum * dp)), grads, float(norm)


@dataclass
class Parity:
    """One dumped step of a launched run against the unsharded reference."""

    loss: float
    ref_loss: float
    grad_norm: float
    ref_norm: float
    grads: dict[str, torch.Tensor]
    ref_grads: dict[str, torch.Tensor]
    output: str = ""  # what the run printed (forked ranks only)

    def worst(self) -> tuple[float, str]:
        """The largest per-parameter relative L2 gradient error, and its parameter."""
        return max((relative_l2(self.grads[n], g), n) for n, g in self.ref_grads.items() if g.abs().sum() > 0)


def parity_step(
    config: Path,
    extra: list[str],
    run_dir: Path,
    nproc: int,
    dp: int,
    steps: int = 1,
    env: dict[str, str] | None = None,
) -> Parity:
    """Train `steps` steps of `config` on `nproc` ranks (in `env`) with a debug dump of step 1, then
    recompute step 1 unsharded (its loss, gradients and norm do not depend on the steps after it)."""
    overrides = [f"train.steps={steps}", "debug.dump_step=1", f"data.path={run_dir / 'data'}", *extra]
    output = train(tiny_args(run_dir, *overrides, config=config), nproc=nproc, env=env)
    dump = dump_dir(run_dir, 1)
    ref_loss, ref_grads, ref_norm = reference_step(config, overrides, dump, dp=dp)
    metrics = read_metrics(run_dir)[0]
    return Parity(
        metrics["loss"],
        ref_loss,
        metrics["grad_norm"],
        ref_norm,
        load_file(dump / "grads.safetensors"),
        ref_grads,
        output,
    )


def lora_parity_run(config: Path, extra: list[str], run_dir: Path, nproc: int, dp: int, step: int = 2) -> Parity:
    """Train `step` steps of a LoRA `config` on `nproc` ranks with a dump at `step`, recompute it with peft.

    The dump is not at step 1: lora_B starts at zero, so lora_A's first gradient is zero and would
    compare nothing.
    """
    overrides = [
        f"train.steps={step}",
        f"debug.dump_step={step}",
        "checkpoint.every=0",
        f"data.path={run_dir / 'data'}",
        *extra,
    ]
    train(tiny_args(run_dir, *overrides, config=config), nproc=nproc)
    dump = dump_dir(run_dir, step)
    ref_loss, ref_grads, ref_norm = reference_step_from_dump(config, overrides, dump, dp=dp, step=step)
    metrics = read_metrics(run_dir)[step - 1]
    return Parity(
        metrics["loss"], ref_loss, metrics["grad_norm"], ref_norm, load_file(dump / "grads.safetensors"), ref_grads
    )


def dump_forward_inputs(dump: Path) -> dict[str, torch.Tensor]:
    """The forward arguments of a dump's first micro-batch (`m0.<arg>`), under the argument names."""
    from h3train.model.sp_forward import FORWARD_ARGS

    tensors = load_file(dump / "inputs.safetensors")
    return {name: tensors[f"m0.{name}"] for name in FORWARD_ARGS}


@torch.no_grad()
def forward_outputs(model, inputs: dict) -> torch.Tensor:
    """A diffusers model's video and audio predictions for `inputs`, flattened into one float64 vector."""
    video, audio = model(**inputs, return_dict=False)
    return torch.cat([video.flatten(), audio.flatten()]).double()


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm()
    return float((a.double() - b.double()).norm() / denom) if denom > 0 else float(a.double().norm())
