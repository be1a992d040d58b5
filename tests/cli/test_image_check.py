"""The image's self-check (`h3train/tools/image_check.py`, which the Dockerfile runs): it passes in this
environment (each test lane's torch) and fails in one line where no compiler can be found."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT


def _image_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    # flash-attn has no CPU wheel: the test lanes cannot install it, the image does and checks it.
    cmd = [sys.executable, "-m", "h3train.tools.image_check", "--no-flash-attn"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in changes}
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


@pytest.mark.slow
def test_image_check_passes_here() -> None:
    if shutil.which("gcc") is None or shutil.which("g++") is None:
        pytest.skip("needs gcc and g++ on PATH, as the image has them")
    out = _image_check(_env(CC=None, CXX=None))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("image check: ok: torch "), out.stdout
    assert "torchao" in lines[0] and "C compiler" in lines[0]


def test_image_check_fails_in_one_line_without_a_c_compiler(tmp_path: Path) -> None:
    """Triton's search: CC first, then gcc or clang on PATH; here neither is there."""
    for cc in ("/nonexistent", None):
        out = _image_check(_env(CC=cc, CXX=None, PATH=str(tmp_path)))
        assert out.returncode == 1, out.stderr[-3000:]
        assert out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("image check: failed: "), out.stderr[-3000:]
        assert ("'/nonexistent' (from CC) does not run" if cc else "no C compiler: CC is unset") in lines[0]


@pytest.mark.slow
def test_image_check_builds_the_compiled_function_here(tmp_path: Path) -> None:
    """The compile step really builds (no cached kernel): with inductor's C++ compiler gone it fails."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc on PATH")
    out = _image_check(_env(CC=gcc, CXX=str(tmp_path / "no-g++")))
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("image check: failed: torch.compile failed on the CPU"), lines
    assert "InvalidCxxCompiler" in lines[0]
