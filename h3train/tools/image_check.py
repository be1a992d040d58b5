"""Can this environment train? The Docker build's self-check, runnable anywhere: seconds, CPU only.

    python -m h3train.tools.image_check [--no-flash-attn]

In order, each a condition of a run that otherwise fails minutes into a job on every node:

1. the libraries h3train calls import at this torch: diffusers (with `MiniMaxH3Transformer3DModel`),
   peft, torchao's 8-/4-bit AdamW, flash-attn (`--no-flash-attn` skips it, for an environment that
   cannot install it: it has no CPU wheel);
2. a C compiler where Triton looks for one (`CC`, else `gcc`, else `clang` on `PATH`): Triton
   builds a small C launcher per kernel, so without one `model.compile` and the compiled low-bit
   AdamW steps stop with "Failed to find C compiler";
3. one `torch.compile`d function on the CPU, in an empty inductor cache, so that it is built here by
   inductor's C++ compiler (`CXX`, else `g++`) and its result compared with eager;
4. one `adamw8bit` step on the CPU through the trainer's own optimizer (`optim/lowbit.py`), eager as
   in the CPU GPU-checks (inductor's C++ build of torchao's step takes minutes on a CPU): finite
   weights that moved, moments held as torchao's 8-bit states.

Prints one line and exits 0 when all hold; otherwise one line naming the first that failed and how
to fix it, exit 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from importlib import metadata


class ImageCheckError(Exception):
    """One failed condition, its message the line printed."""


def _version(dist: str) -> str:
    return metadata.version(dist).split("+")[0]


def check_imports(flash_attn: bool) -> list[str]:
    """Import what a run imports; `name version` of each (flash-attn's or `flash-attn skipped`)."""
    found = []
    with warnings.catch_warnings():
        # torchao says at import that its C++ kernels are built for another torch; h3train uses none.
        warnings.simplefilter("ignore")
        for module, dist in (("diffusers", "diffusers"), ("peft", "peft"), ("torchao.optim", "torchao")):
            try:
                imported = __import__(module, fromlist=["_"])
            except Exception as exc:  # noqa: BLE001 - any import failure is this check's answer
                raise ImageCheckError(
                    f"import {module} failed: {type(exc).__name__}: {exc}; install docker/versions.txt's pins"
                ) from exc
            if module == "diffusers" and not hasattr(imported, "MiniMaxH3Transformer3DModel"):
                raise ImageCheckError(
                    f"diffusers {_version(dist)} has no MiniMaxH3Transformer3DModel; install docker/versions.txt's"
                )
            found.append(f"{dist} {_version(dist)}")
        if flash_attn:
            try:
                import flash_attn as _  # noqa: F401
            except Exception as exc:  # noqa: BLE001
                raise ImageCheckError(
                    f"import flash_attn failed: {type(exc).__name__}: {exc}; install the flash-attn wheel built for "
                    "this torch, CUDA and C++ ABI (docker/Dockerfile), or pass --no-flash-attn where it cannot run"
                ) from exc
            found.append(f"flash-attn {_version('flash-attn')}")
        else:
            found.append("flash-attn skipped")
    return found


def c_compiler() -> str:
    """The C compiler Triton would use: `CC`, else `gcc`, else `clang` on PATH; checked to run."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise ImageCheckError(
            "no C compiler: CC is unset and neither gcc nor clang is on PATH; Triton needs one to build its "
            "kernels' launchers (model.compile, the 8-/4-bit AdamW steps): install gcc, or set CC"
        )
    try:
        subprocess.run([cc, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ImageCheckError(
            f"the C compiler {cc!r} (from {'CC' if os.environ.get('CC') else 'PATH'}) does not run: {exc}; "
            "install gcc, or set CC to a working compiler"
        ) from exc
    return cc


def check_compile() -> None:
    """One function through `torch.compile` (inductor, CPU), built afresh, against eager."""
    import torch

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + x.square()

    x = torch.linspace(-2, 2, 64)
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend="inductor")(x)
    except Exception as exc:  # noqa: BLE001 - the compiler's error, whatever its type, is the answer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ImageCheckError(
            f"torch.compile failed on the CPU: {type(exc).__name__}: {first}; inductor builds with CXX or g++: "
            "install g++ (the image's runtime stage does)"
        ) from exc
    if not torch.allclose(got, fn(x), rtol=1e-5, atol=1e-5):
        raise ImageCheckError("torch.compile's result differs from eager on the CPU")


def check_lowbit_step() -> None:
    """One `adamw8bit` step (`train/lowbit.quantized_adamw`) on a 64 x 256 weight, eager."""
    import torch

    from ..optim.lowbit import QUANT_BLOCK, quantized_adamw
    from .gpu_checks import QUANTIZED_STATE, eager_torch_compile

    weight = torch.nn.Parameter(torch.randn(64, QUANT_BLOCK["adamw8bit"], generator=torch.Generator().manual_seed(0)))
    before = weight.detach().clone()
    try:
        with eager_torch_compile(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = quantized_adamw("adamw8bit", [{"params": [weight]}], lr=1e-2, weight_decay=0.0)
            weight.grad = torch.ones_like(weight)
            optimizer.step()
    except Exception as exc:  # noqa: BLE001
        raise ImageCheckError(
            f"an adamw8bit step failed: {type(exc).__name__}: {exc}; torchao must match torch (docker/versions.txt)"
        ) from exc
    states = {type(optimizer.state[weight][k]).__name__ for k in ("exp_avg", "exp_avg_sq")}
    if not all(name.startswith(QUANTIZED_STATE) for name in states):
        raise ImageCheckError(f"an adamw8bit step kept its moments as {sorted(states)}, not 8-bit states")
    if not torch.isfinite(weight).all() or torch.equal(weight.detach(), before):
        raise ImageCheckError("an adamw8bit step left the weight unchanged or not finite")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3train.tools.image_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-flash-attn", action="store_true", help="skip flash-attn's import (an environment that cannot have it)"
    )
    args = parser.parse_args(argv)
    # An empty inductor cache: a kernel built earlier would load without the compiler this checks.
    with tempfile.TemporaryDirectory(prefix="h3train-image-check-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            found = check_imports(flash_attn=not args.no_flash_attn)
            cc = c_compiler()
            check_compile()
            check_lowbit_step()
        except ImageCheckError as exc:
            print(f"image check: failed: {exc}", file=sys.stderr, flush=True)
            return 1
    import torch

    print(
        f"image check: ok: torch {torch.__version__.split('+')[0]}, {', '.join(found)}; C compiler {cc}; "
        "torch.compile and an adamw8bit step ran on the CPU",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
