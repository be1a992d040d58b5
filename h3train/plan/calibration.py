"""Measured CUDA peaks the memory plan and the rehearsal are held to (`calibration.jsonl`, one point a line).

A point is one training step measured on a GPU: the device and torch it ran on, the model (the bench's
full-width dims but for `layers`), the clip it trained (the bench's synthetic FL2VA layout), what each
block recomputed, and `torch.cuda.max_memory_allocated` over the steps after the first (optimizer state
resident). `scripts/gpu_check.sh` measures new points in this format (`h3train bench --sweep`), and
`tests/unit/test_calibration.py` holds the plan and the rehearsal within `TOLERANCE` of every point.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.torch_version import TorchVersion

TABLE = Path(__file__).with_name("calibration.jsonl")
# How far the plan's and the rehearsal's peaks may be from a measured one, as a fraction of it.
TOLERANCE = 0.05


@dataclass(frozen=True)
class CudaPoint:
    """One measured training step (module docstring). `checkpointing` is the bench's
    `--gradient-checkpointing` (on, selective, off); `frames`, `height`, `width`, `text_len` its clip."""

    device: str
    torch: str
    layers: int
    rows: int
    checkpointing: str
    backend: str
    compile: bool
    measured_peak_bytes: int
    frames: int = 124
    height: int = 768
    width: int = 1344
    text_len: int = 2048
    # Where the figure comes from (a file of the measured run, or the command that measured it).
    source: str = ""

    @property
    def fused_norm(self) -> bool:
        """Whether that torch ran `nn.RMSNorm` as CUDA's fused kernel (2.9 and later)."""
        return TorchVersion(self.torch.split("+")[0]) >= (2, 9)

    def line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def load_points(path: Path = TABLE) -> list[CudaPoint]:
    """Every point of the table at `path`, in file order."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [CudaPoint(**json.loads(line)) for line in lines]
