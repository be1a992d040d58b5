"""What a metrics row holds: its reserved keys and the conversions every sink shares."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Lists the keys of a record whose values were NaN or infinite, written as null.
NONFINITE_KEY = "nonfinite"
# On the first training row a resumed run logs: true (the run went on from the step before it).
RESUMED_KEY = "resumed"
# The peak memory of a step, GiB (`memory.peak_memory_gib`).
MEMORY_KEY = "mem_peak_gib"


def jsonable(value: Any) -> Any:
    """Plain Python scalars for `json.dumps`; 0-d tensors and numpy scalars are unwrapped."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return float(value)


def training_record(step: int, values: Mapping[str, Any]) -> dict[str, Any]:
    """The row of optimizer step `step`: `step` first, then `values` as plain scalars."""
    record: dict[str, Any] = {"step": int(step)}
    for key, value in values.items():
        if key != "step":
            record[key] = jsonable(value)
    return record


def validation_record(step: int, values: Mapping[str, Any]) -> dict[str, Any]:
    """The row of a held-out evaluation after step `step`: `step`, `"kind": "validation"`, the values."""
    record: dict[str, Any] = {"step": int(step), "kind": "validation"}
    record.update({k: jsonable(v) for k, v in values.items()})
    return record


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with non-finite floats as None and their keys listed under `nonfinite` (strict JSON)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    out = {k: (None if k in bad else v) for k, v in record.items()}
    out[NONFINITE_KEY] = bad
    return out


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a row the dashboards chart: every value but `step`, text, flags and null."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
