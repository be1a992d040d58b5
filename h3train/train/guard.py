"""What a validation row asks of the run: keep its checkpoint as the best, warn, or stop.

`checkpoint.keep_best` names a validation metric: a validation (after step 1 or later) that improves
it asks for a checkpoint of that step, which the checkpointer keeps until a better one commits, never
pruned by `keep_last`. `validation.guard` holds thresholds on each modality's retention metrics
(`validation.py`): a row below `min_guidance_ratio` or `min_guidance_cos`, or above `max_drift`,
warns in one line, or (`action: stop`) asks for a checkpoint and stops the run, which then exits
with `GUARD_EXIT` (3).

The values of a validation row are all-reduced, the same on every rank, so every rank reaches the
same verdict without a collective. The best so far is checkpoint state (`state_dict`): a resumed
run compares with it and keeps protecting its checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import GuardConfig

# The exit status of a run stopped by `validation.guard` (`action: stop`).
GUARD_EXIT = 3

_MODALITIES = ("video", "audio")


@dataclass
class Verdict:
    """What one step's validation rows ask for: a checkpoint (`save`), a stop (`stop`: the reason), lines."""

    save: bool = False
    stop: str | None = None
    lines: list[str] = field(default_factory=list)

    def merge(self, other: Verdict) -> None:
        self.save |= other.save
        self.stop = self.stop or other.stop
        self.lines += other.lines


class ValidationWatch:
    """`checkpoint.keep_best` and `validation.guard`, judged on each validation row."""

    def __init__(self, keep_best: str | None, mode: str, guard: GuardConfig) -> None:
        self.metric = keep_best
        self.mode = mode
        self.guard = guard
        # The best value so far and the step whose checkpoint holds it.
        self.best_value: float | None = None
        self.best_step: int | None = None

    def judge(self, step: int, values: Mapping[str, float | None]) -> Verdict:
        """The verdict on the validation row of `step` (step 0, before training, asks nothing)."""
        verdict = Verdict()
        if step == 0:
            return verdict
        if self.metric is not None and self._improves(values.get(self.metric)):
            self.best_value, self.best_step = float(values[self.metric]), step  # type: ignore[arg-type]
            verdict.save = True
        breaches = self.breaches(values)
        if breaches:
            what = "; ".join(breaches)
            if self.guard.action == "stop":
                verdict.save = True
                verdict.stop = f"validation.guard after step {step}: {what}"
            else:
                verdict.lines.append(f"h3train: warning: validation.guard after step {step}: {what}")
        return verdict

    def _improves(self, value: float | None) -> bool:
        if value is None:
            return False
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def breaches(self, values: Mapping[str, float | None]) -> list[str]:
        """Each threshold a modality's metric crosses, as `val/... 0.412 < min_guidance_ratio 0.5`."""
        g = self.guard
        checks = (
            ("guidance_ratio", "min_guidance_ratio", g.min_guidance_ratio, False),
            ("guidance_cos", "min_guidance_cos", g.min_guidance_cos, False),
            ("drift", "max_drift", g.max_drift, True),
        )
        found = []
        for metric, key, limit, upper in checks:
            if limit is None:
                continue
            for name in _MODALITIES:
                value = values.get(f"val/{metric}_{name}")
                if value is not None and (value > limit if upper else value < limit):
                    found.append(f"val/{metric}_{name} {value:.4g} {'>' if upper else '<'} {key} {limit:g}")
        return found

    @property
    def best_checkpoint(self) -> int | None:
        """The step whose checkpoint is the best so far (None: none yet)."""
        return self.best_step

    def describe(self) -> str | None:
        if self.best_step is None:
            return None
        return f"{self.metric} {self.best_value:.6g} after step {self.best_step}"

    # A run that turns keep_best on when it resumes from a checkpoint without this state starts afresh.
    fresh_if_missing = True
    fresh_start = "no checkpoint is the best yet"

    def start_fresh(self) -> None:
        self.best_value = self.best_step = None

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "value": self.best_value, "step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Another metric or direction starts the comparison afresh; the old best is then unprotected.
        if state.get("metric") == self.metric and state.get("mode") == self.mode:
            self.best_value, self.best_step = state.get("value"), state.get("step")
