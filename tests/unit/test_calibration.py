"""The memory plan and the fake-tensor rehearsal against every peak measured on a GPU (`plan/calibration.jsonl`).

Each point is planned as the bench plans the case it ran (`bench_plan`: the trainer's config on one rank,
the norm kernel of the point's torch) and rehearsed on the CPU under fake tensors; both must land within
`TOLERANCE` of `torch.cuda.max_memory_allocated` as measured.
"""

from __future__ import annotations

import pytest

from h3train.model.architecture import model_kwargs
from h3train.plan.calibration import TOLERANCE, CudaPoint, load_points
from h3train.tasks.synthetic import Clip
from h3train.tools.bench.cases import CHECKPOINTING, bench_plan, trainer_config

POINTS = load_points()


def _clip(point: CudaPoint) -> Clip:
    return Clip(
        frames=point.frames,
        height=point.height,
        width=point.width,
        text_len=point.text_len,
        vision_tokens=point.text_len // 2,
    )


def _id(point: CudaPoint) -> str:
    return f"{point.layers}blocks-{point.checkpointing}-{point.backend}-{point.torch}"


def test_the_table_holds_the_measured_points() -> None:
    """Every figure of the first GPU run is in the table, each with where it came from."""
    assert len(POINTS) >= 4
    assert all(p.source and p.measured_peak_bytes > 0 for p in POINTS)
    assert {71_147_750_912, 86_169_438_720, 41_104_815_616} <= {p.measured_peak_bytes for p in POINTS}


@pytest.mark.parametrize("point", POINTS, ids=_id)
def test_plan_is_within_tolerance_of_the_gpu(point: CudaPoint) -> None:
    dims = model_kwargs({"num_layers": point.layers})
    plan = bench_plan(
        dims, _clip(point), "bfloat16", CHECKPOINTING[point.checkpointing], 0, 139.8, "cuda", point.fused_norm
    )
    assert plan.rows == point.rows
    planned = plan.peak_bytes - plan.reserve_bytes
    assert abs(planned / point.measured_peak_bytes - 1) <= TOLERANCE, (planned, point)


# One rehearsal per model and policy: the backends' points share it.
REHEARSED = {(p.layers, p.checkpointing, p.torch): p for p in POINTS}.values()


@pytest.mark.parametrize("point", REHEARSED, ids=_id)
def test_rehearsal_is_within_tolerance_of_the_gpu(point: CudaPoint, tmp_path) -> None:
    from h3train.run.rehearse import rehearse

    dims = model_kwargs({"num_layers": point.layers})
    cfg = trainer_config(dims, _clip(point), "bfloat16", CHECKPOINTING[point.checkpointing], "native", 0, tmp_path)
    rehearsal = rehearse(cfg, world_size=1, num_layers=point.layers, save_plan=False, fused_norm=point.fused_norm)
    assert rehearsal.rows == point.rows
    peak = rehearsal.device_peak_bytes
    assert abs(peak / point.measured_peak_bytes - 1) <= TOLERANCE, (peak, rehearsal.at_peak, point)
