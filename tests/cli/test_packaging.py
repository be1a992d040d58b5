"""The cluster path: Dockerfile and shell scripts lint clean, pinned versions agree, scripts behave."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from h3train.parallel.dims import free_port

from helpers.launch import default_signals, signal_after_steps, start_in_session, tiny_overrides
from helpers.paths import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
IMAGE_VERSIONS = ROOT / "docker" / "versions.txt"
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/*.sbatch")])


def _tool(name: str) -> str:
    """The linter next to this interpreter (the venv's bin) or on PATH; skip when it is missing."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install {name}-py (the dev extra)")
    return found


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(reqs: list[str], name: str) -> Requirement:
    for r in map(Requirement, reqs):
        if r.name == name:
            return r
    raise AssertionError(f"pyproject.toml declares no {name}")


def _dockerfile_args() -> dict[str, str]:
    """ARG defaults, first declaration wins, with `${VAR}` references resolved."""
    args: dict[str, str] = {}
    for m in re.finditer(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE):
        args.setdefault(m[1], m[2])
    for key, value in args.items():
        args[key] = re.sub(r"\$\{(\w+)\}", lambda r: args[r[1]], value)
    return args


def _image_pins() -> dict[str, str]:
    """docker/versions.txt as `name -> version`; every line that is not a comment pins one exact version."""
    pins = {}
    for line in IMAGE_VERSIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = spec.version
    return pins


def _flash_attn_wheel(args: dict[str, str]) -> str:
    """The wheel file name the Dockerfile downloads, with the shell's `${X%.*}` applied."""
    url = re.search(r'"(https://github\.com/Dao-AILab/flash-attention/\S+\.whl)"', DOCKERFILE.read_text())[1]

    def expand(m: re.Match) -> str:
        value = args[m[1]]
        return value.rsplit(".", 1)[0] if m[2] == "%.*" else value

    return re.sub(r"\$\{(\w+)(%\.\*)?\}", expand, url).rsplit("/", 1)[1]


def test_hadolint_clean() -> None:
    hadolint = _tool("hadolint")
    config = ROOT / ".hadolint.yaml"
    cmd = [hadolint, *(["--config", str(config)] if config.is_file() else []), str(DOCKERFILE)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_clean() -> None:
    shellcheck = _tool("shellcheck")
    assert {p.name for p in SCRIPTS} >= {"launch.sh", "slurm.sbatch"}
    out = subprocess.run([shellcheck, "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_pins_agree_with_pyproject() -> None:
    project = _pyproject()["project"]
    args = _dockerfile_args()
    torch = Version(args["TORCH_VERSION"])
    assert args["TORCH_VERSION"] in args["BASE_IMAGE"]
    assert _requirement(project["dependencies"], "torch").specifier.contains(torch)
    flash = Version(args["FLASH_ATTN_VERSION"])
    assert _requirement(project["optional-dependencies"]["flash"], "flash-attn").specifier.contains(flash)
    python = re.fullmatch(r"cp3(\d+)", args["PYTHON_TAG"])
    assert python, args["PYTHON_TAG"]
    assert SpecifierSet(project["requires-python"]).contains(Version(f"3.{python[1]}"))


def test_flash_attn_wheel_matches_the_base_image() -> None:
    args = _dockerfile_args()
    wheel = _flash_attn_wheel(args)
    m = re.fullmatch(
        r"flash_attn-(?P<ver>[\d.]+(?:\.post\d+)?)\+cu(?P<cuda>\d+)torch(?P<torch>\d+\.\d+)"
        r"cxx11abi(?P<abi>TRUE|FALSE)-(?P<py>cp\d+)-(?P=py)-linux_x86_64\.whl",
        wheel,
    )
    assert m, wheel
    torch = Version(args["TORCH_VERSION"])
    assert m["ver"] == args["FLASH_ATTN_VERSION"]
    assert m["torch"] == f"{torch.major}.{torch.minor}"
    assert m["py"] == args["PYTHON_TAG"]
    # flash-attn's cu12 wheels run on any CUDA 12 runtime; the base must be CUDA 12 as well.
    assert m["cuda"] == "12" and args["CUDA_VERSION"].split(".")[0] == "12"
    # PyTorch's pip wheels switched to the C++11 ABI in 2.7; a mismatch fails at import.
    assert m["abi"] == ("TRUE" if torch >= Version("2.7") else "FALSE")


def test_dockerfile_runtime_stage() -> None:
    text = DOCKERFILE.read_text()
    final = text[text.rindex("\nFROM ") :]
    assert 'ENTRYPOINT ["h3train"]' in final
    assert re.search(r"^USER (?!root|0\b)\S+", final, re.MULTILINE), "the final stage must not run as root"
    assert "[flash,lowbit]" in final  # h3train is installed with its flash and low-bit optimizer extras
    # Every package installs under docker/versions.txt, and no version is named twice.
    assert "--mount=type=bind,source=docker/versions.txt,target=/tmp/versions.txt" in final
    assert "--constraint /tmp/versions.txt" in final and "got == pins" in final
    assert not re.search(r"\b[\w-]+==", final), "versions belong in docker/versions.txt"
    # Every pip call leaves no cache behind in a layer.
    assert text.count("--no-cache-dir") == len(re.findall(r"pip (?:install|wheel|download)", text))
    # A C and C++ compiler for Triton and inductor, and no CUDA toolkit (the -runtime base, no -devel).
    install = re.search(r"apt-get install -y --no-install-recommends ([^\\\n]+)", final)
    assert install and {"gcc", "g++", "libc6-dev"} <= set(install[1].split()), "no compiler in the runtime stage"
    assert "-runtime" in _dockerfile_args()["BASE_IMAGE"] and not re.search(r"build-essential|nvcc", text)
    # The build runs the self-check that ships in the image, after the install and as the image's user.
    assert final.index("RUN python -m h3train.tools.image_check\n") > final.index("USER ")
    assert "COPY --chmod=0755 scripts/gpu_check.sh /opt/h3train/scripts/gpu_check.sh" in final


def test_dockerfile_pins_equal_the_image_versions_file() -> None:
    """The build arguments that name a version again equal docker/versions.txt, the file the image
    installs from and the image test environment is built from."""
    args, pins = _dockerfile_args(), _image_pins()
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["FLASH_ATTN_VERSION"] == pins["flash-attn"]
    # torchaudio is released in lockstep with torch: the pipeline resamples off-rate references with it.
    assert pins["torchaudio"] == pins["torch"]
    assert not {"TORCHAUDIO_VERSION", "TORCHAO_VERSION"} & set(args), "pinned in docker/versions.txt"


def test_image_versions_satisfy_the_package() -> None:
    """Every pin satisfies pyproject.toml, whose oldest torch is the image's (the oldest a test lane runs)."""
    project = _pyproject()["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["lowbit"]]
    pins = _image_pins()
    for name, version in pins.items():
        for req in (r for r in map(Requirement, reqs) if r.name == name):
            assert req.specifier.contains(Version(version)), f"{name}=={version} against {req}"
    torch_floor = {s.version for s in _requirement(project["dependencies"], "torch").specifier if s.operator == ">="}
    assert torch_floor == {".".join(pins["torch"].split(".")[:2])}


def test_makefile_builds_the_image_lane_from_the_versions_file() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "IMAGE_VERSIONS := docker/versions.txt" in makefile
    assert makefile.count("--constraint $(IMAGE_VERSIONS)") == 2  # torch first, then the package


def test_image_lane_runs_the_pinned_versions() -> None:
    """In the image test environment (`make test` sets H3TRAIN_TEST_LANE=image), every pinned package
    that installs on a CPU machine is at its pin."""
    if os.environ.get("H3TRAIN_TEST_LANE") != "image":
        pytest.skip("not the image test environment (make test runs it second, H3TRAIN_TEST_LANE=image)")
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for name in _image_pins():
        try:
            got[name] = version(name).split("+")[0]
        except PackageNotFoundError:
            got[name] = None
    # flash-attn has no wheel for a CPU machine: the image only.
    assert {n: v for n, v in got.items() if n != "flash-attn"} == {
        n: v for n, v in _image_pins().items() if n != "flash-attn"
    }


def test_dockerignore_admits_what_the_build_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE.read_text(), re.MULTILINE):
        *sources, _dest = [t for t in line.split() if not t.startswith("--")]
        copied.update(s.rstrip("/") for s in sources)
    assert copied <= admitted, copied - admitted
    assert _pyproject()["project"]["readme"] in admitted  # setuptools reads it to build the wheel
    assert "*" in ignore  # everything else (.venv, runs, .git) stays out of the context


def test_launch_script_usage_errors() -> None:
    launch = ROOT / "scripts" / "launch.sh"
    assert os.access(launch, os.X_OK)
    out = subprocess.run([str(launch)], capture_output=True, text=True)
    assert out.returncode == 2 and "Usage: scripts/launch.sh CONFIG" in out.stderr
    out = subprocess.run([str(launch), "missing.yaml"], capture_output=True, text=True)
    assert out.returncode == 2 and "missing.yaml" in out.stderr


@pytest.mark.slow
def test_launch_script_trains_two_cpu_ranks(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "GPUS_PER_NODE": "2",
        # A port free now, not one derived from the pid: another job's store may hold that one.
        "MASTER_PORT": str(free_port()),
    }
    out = subprocess.run(
        [
            str(ROOT / "scripts" / "launch.sh"),
            "configs/tiny_fl2va.yaml",
            *tiny_overrides(tmp_path / "run", "train.steps=1", "parallel.sp=2"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # GPUS_PER_NODE given by hand on a machine without a GPU: ranks, not GPUs.
    assert "node 0/1, 2 ranks, rendezvous" in out.stderr and "GPUs" not in out.stderr
    assert "step 1/1" in out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "code", "why", "group"),
    [(signal.SIGTERM, 0, "TERM", False), (signal.SIGINT, 130, "Ctrl-C", True)],
    ids=["term", "terminal_ctrl_c"],
)
def test_launch_script_stops_on_term_and_ctrl_c_with_a_checkpoint_and_no_traceback(
    tmp_path: Path, signum: int, code: int, why: str, group: bool
) -> None:
    """TERM at the launcher, or a terminal's Ctrl-C (INT to its whole process group): the ranks save and
    exit 0, torchrun exits 0, and the launcher says so in one line, without a traceback; after a
    Ctrl-C its last line says the run was interrupted, not preempted."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "GPUS_PER_NODE": "2",
        "MASTER_PORT": str(20000 + (os.getpid() + signum) % 20000),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    run = tmp_path / "run"
    args = tiny_overrides(run, "train.steps=500", "parallel.sp=2")
    proc = start_in_session([str(ROOT / "scripts" / "launch.sh"), "configs/tiny_fl2va.yaml", *args], env)
    out, err = signal_after_steps(proc, run, signum, group=group)
    assert proc.returncode == code, out[-2000:] + err[-4000:]
    assert f"launch.sh: {why} on" in err and "preempted by SIGTERM: stopped after step" in out
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    # The launcher's start line, its one line for the signal and, after a Ctrl-C, the interrupt it
    # was: nothing from torchrun or the ranks.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("step ")]
    interrupted = [line for line in lines if line.startswith("launch.sh: interrupted by Ctrl-C on")]
    assert lines == [
        next(line for line in lines if line.startswith("launch.sh: ") and "rendezvous" in line),
        next(line for line in lines if line.startswith(f"launch.sh: {why} on")),
        *interrupted,
    ], err[-4000:]
    assert len(interrupted) == (signum == signal.SIGINT), err[-4000:]
    assert any(p.name.startswith("step_") for p in (run / "checkpoints").iterdir())


def _path(stand_ins: Path) -> str:
    """PATH with the stand-in commands first, then this interpreter's bin (for `python -m h3train check`)."""
    return os.pathsep.join([str(stand_ins), str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def test_launch_script_hands_usr1_to_the_ranks(tmp_path: Path) -> None:
    """torchrun ignores USR1 (its default action would kill it); the ranks, its children, get it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ready, got = tmp_path / "ready", tmp_path / "got"
    rank = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGUSR1, lambda *a: (open({str(got)!r}, 'w').write('usr1'), sys.exit(0)))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(30)\n"
    )
    (tmp_path / "rank.py").write_text(rank)
    # A stand-in torchrun: one rank as its child; exits 3 after the rank so the status is checked.
    _executable(
        bin_dir / "torchrun", f"#!/usr/bin/env bash\n{sys.executable} {tmp_path / 'rank.py'} &\nwait $!\nexit 3\n"
    )
    env = {**os.environ, "PATH": _path(bin_dir), "GPUS_PER_NODE": "1"}
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "launch.sh"), "configs/tiny_fl2va.yaml"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    # launch.sh runs `h3train check` before torchrun: seconds of imports, more on a busy machine.
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the rank never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=20)
    assert got.read_text() == "usr1", stderr
    assert proc.returncode == 3, stderr  # torchrun's own status, not the interrupted wait's


def _stand_in_launch(tmp_path: Path, check: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """launch.sh with stand-ins for `python` (the check: `check` is its bash body) and torchrun (prints
    GLOO_SOCKET_IFNAME, or `unset`), on one CPU rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "python", f"#!/usr/bin/env bash\n{check}\n")
    _executable(bin_dir / "torchrun", '#!/usr/bin/env bash\necho "gloo=${GLOO_SOCKET_IFNAME:-unset}"\n')
    base = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    return subprocess.run(
        [str(ROOT / "scripts" / "launch.sh"), "configs/tiny_fl2va.yaml"],
        cwd=ROOT,
        env={**base, "PATH": _path(bin_dir), "GPUS_PER_NODE": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_launch_script_prints_the_output_of_a_failed_check(tmp_path: Path) -> None:
    """The check's report is kept back when it passes; when it fails, all of it, ending with the reason."""
    check = 'echo "config ok: report line"; echo "h3train: error: the reason" >&2; exit 2'
    out = _stand_in_launch(tmp_path, check, {})
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["config ok: report line", "h3train: error: the reason"]
    assert "gloo=" not in out.stdout  # torchrun never started


@pytest.mark.parametrize(
    ("env", "gloo", "warned"),
    [
        ({"NCCL_SOCKET_IFNAME": "lo"}, "lo", False),
        ({"NCCL_SOCKET_IFNAME": "=lo"}, "lo", False),
        ({"NCCL_SOCKET_IFNAME": "^docker0,lo"}, "unset", True),
        ({"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "eth9"}, "eth9", False),
        ({}, "unset", False),
    ],
    ids=["name", "exact_name", "exclusion", "gloo_set", "neither"],
)
def test_launch_script_gives_gloo_the_nccl_interface(
    tmp_path: Path, env: dict[str, str], gloo: str, warned: bool
) -> None:
    """The background save's gloo group uses NCCL's interface when that names this node's interfaces."""
    if not Path("/sys/class/net/lo").exists():
        pytest.skip("needs Linux's /sys/class/net/lo")
    out = _stand_in_launch(tmp_path, "exit 0", env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"gloo={gloo}"
    assert ("set GLOO_SOCKET_IFNAME" in out.stderr) == warned, out.stderr


def _fake_slurm(bin_dir: Path, log: Path) -> None:
    """`scontrol`, `scancel` and `srun` stand-ins. srun records its argv and environment and runs
    until USR1, which it treats as the ranks checkpointing and exiting 0."""
    bin_dir.mkdir()
    _executable(
        bin_dir / "scontrol",
        f"""#!/usr/bin/env bash
if [[ "$1" == show ]]; then printf 'gpu-a01\\ngpu-a02\\n'; exit 0; fi
echo "scontrol $*" >> {log}
""",
    )
    _executable(
        bin_dir / "scancel", f'#!/usr/bin/env bash\necho "scancel $*" >> {log}\nkill -USR1 "$(cat {log}.srun)"\n'
    )
    _executable(
        bin_dir / "srun",
        f"""#!/usr/bin/env bash
echo $$ > {log}.srun
{{ echo "srun $*"; echo "MASTER_ADDR=$MASTER_ADDR NNODES=$NNODES GPUS=$GPUS_PER_NODE RDZV_ID=$RDZV_ID"; }} >> {log}
trap 'echo "ranks saved" >> {log}; exit 0' USR1
for _ in $(seq 200); do sleep 0.05; done
exit 1
""",
    )


def test_slurm_script_checkpoints_then_requeues_on_usr1(tmp_path: Path) -> None:
    log = tmp_path / "slurm.log"
    _fake_slurm(tmp_path / "bin", log)
    env = {
        **os.environ,
        "PATH": _path(tmp_path / "bin"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_RESTART_COUNT": "1",
        "MASTER_ADDR": "stale-host",  # from the submitting shell: must not leak into the job
    }
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "slurm.sbatch"), "configs/h3_a100_16gpu.yaml", "train.steps=5"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    # The script checks the config first (`h3train check`: seconds of imports on a busy machine).
    deadline = time.monotonic() + 60
    while not (log.exists() and "RDZV_ID" in log.read_text()):
        assert time.monotonic() < deadline, "srun never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=20)
    lines = log.read_text().splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun
    assert srun.endswith("scripts/launch.sh configs/h3_a100_16gpu.yaml checkpoint.resume=auto train.steps=5")
    assert "MASTER_ADDR=gpu-a01 NNODES=2 GPUS=8 RDZV_ID=h3train-4242-1" in lines
    # The ranks are told first, and the job is requeued only once they have exited.
    assert lines[-3:] == ["scancel --signal=USR1 4242", "ranks saved", "scontrol requeue 4242"], stderr
    assert proc.returncode == 0, stderr


def test_slurm_script_does_not_requeue_a_finished_run(tmp_path: Path) -> None:
    log = tmp_path / "slurm.log"
    _fake_slurm(tmp_path / "bin", log)
    # srun finishing on its own: the stand-in exits 1 after its loop, unsignalled.
    (tmp_path / "bin" / "srun").write_text("#!/usr/bin/env bash\nexit 0\n")
    env = {
        **os.environ,
        "PATH": _path(tmp_path / "bin"),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu-a01",
        "SLURM_JOB_NUM_NODES": "1",
    }
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm.sbatch"), "configs/h3_fl2va_a100.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert not log.exists() or "requeue" not in log.read_text()
