"""Which samples each DP rank trains in each micro-batch of a step, packed and balanced by their cost.

**Cost model.** A sample of `S` packed rows costs `S + S^2 / S0` row-units of compute: the linears are
linear in the rows, attention quadratic, and `S0` (`attention_rows`) is where the two are equal,
`2 h + 1.5 h f / a` for hidden size `h`, FFN width `f` and attention width `a` (26,880 rows for the
released model: at its 37 k-row clips attention is already 1.4 times the linears). A pack's samples
attend block-diagonally, so a pack costs the sum of its samples' costs, not the cost of its length.

**A step.** The global sample order is the sampler's (`DistributedSampler.global_index`). Step `k`
consumes the samples at positions `[start, start + count)`, its *window*; slot `i` of the window (the
sample at `start + i`) draws its noise as slot `i` (`objective.step_generator`), whichever rank and
micro-batch it lands in. Every rank trains `grad_accum` micro-batches, so every rank issues the same
collectives, and every rank computes the whole step's composition from the same inputs, so all agree on it
without a collective:

- unpacked, unbalanced: the window is `dp * grad_accum` samples, slot `micro * dp + rank` on rank
  `rank` (the sampler's own order, unchanged);
- `balance` alone: the same window, each rank `grad_accum` samples chosen by longest-processing-time
  on the cost model (the costliest sample first, to the rank with the least cost so far);
- `pack` (a row budget per micro-batch): the window takes samples while their rows fit
  `FILL * dp * grad_accum * budget` (and at least one sample per micro-batch); they are packed into
  `dp * grad_accum` micro-batches of at most `budget` rows, by cost (longest-processing-time over
  micro-batches; with `balance`) or first-fit in order (without), and the micro-batches go to the
  ranks, the costliest first to the rank with the least cost. A window that cannot be packed is cut
  to its longest prefix that can.

A sample longer than the budget (`data.pack_oversize=alone`) trains as a micro-batch of its own;
`refuse` is checked before training, on the source's longest sample (`run/checks.py`). The composition
depends on the order, the lengths, the position and the mesh's `dp` alone: the checkpointed state
stays the sampler's global position, so a run resumed under another DP size continues the same
global order from the same sample.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config

# The share of the micro-batches' row budget a window fills before it is packed: a little room
# lets first-fit place every sample without handing many back.
FILL = 0.95


def attention_rows(dims: dict[str, Any]) -> float:
    """`S0`: the packed length at which a sample's attention FLOPs equal its linears' (module docstring)."""
    hidden = int(dims["hidden_size"])
    attention = int(dims["num_attention_heads"]) * int(dims["attention_head_dim"])
    return 2.0 * hidden + 1.5 * hidden * int(dims["ffn_dim"]) / attention


def sample_cost(rows: int, s0: float) -> float:
    """A sample's compute in row-units of the linears: `rows + rows^2 / s0`."""
    return rows + rows * rows / s0


@dataclass(frozen=True)
class StepComposition:
    """One optimizer step's samples: the window `[start, start + count)` of the global order and,
    per DP rank and micro-batch, the window slots trained there (in pack order)."""

    start: int
    count: int
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    #: Positions before `start` the step passed over: an epoch's tail too short for every micro-batch.
    skipped: int = 0

    def slots(self, rank: int, micro: int) -> tuple[int, ...]:
        return self.micro_batches[rank][micro]

    @property
    def largest_micro_batch(self) -> int:
        """The most samples one micro-batch of the step holds, on any rank: what every rank sizes the AdaLN
        tables' exchange by (`model.adaln_tables.table_rows`) without asking the others."""
        return max(len(slots) for rank in self.micro_batches for slots in rank)

    @property
    def origin(self) -> int:
        """The position the step was planned from (the sampler's position before it)."""
        return self.start - self.skipped

    @property
    def end(self) -> int:
        """The position after the step's window: where the next step is planned from."""
        return self.start + self.count


@dataclass(frozen=True)
class StepComposer:
    """How steps are planned: `budget` rows per micro-batch (0: one sample each), `balance` by cost,
    and with a budget at most `global_batch` samples a step (0: as many as the packs' rows hold)."""

    dp: int
    grad_accum: int
    budget: int = 0
    balance: bool = False
    s0: float = float("inf")
    global_batch: int = 0

    @classmethod
    def of(cls, cfg: Config, dp: int, dims: Mapping[str, Any]) -> StepComposer:
        """The composer of a run of `cfg` at `dp` DP ranks: `data.pack` rows per micro-batch, `data.balance` by
        the cost model of the architecture `dims`, `train.global_batch` samples a packed step."""
        train = cfg.train
        return cls(dp, train.grad_accum, cfg.data.pack, cfg.data.balance, attention_rows(dims), train.global_batch)

    @property
    def micro_batches(self) -> int:
        """Micro-batches of a step over all DP ranks."""
        return self.dp * self.grad_accum

    def cost(self, rows: int) -> float:
        return sample_cost(rows, self.s0)

    def compose(
        self,
        start: int,
        rows_at: Callable[[int], int],
        sample_at: Callable[[int], int] | None = None,
        epoch_length: int = 0,
    ) -> StepComposition:
        """The step planned from global position `start`; `rows_at(p)` is the packed length of the sample
        at position `p`, `sample_at(p)` its index in the source, `epoch_length` the order's positions per
        epoch (0: not known; then neither bound below applies).

        No step reaches into the next epoch, where the order is another permutation and could hand it
        a sample it already holds: an epoch's tail too short to give every micro-batch a sample is
        passed over (`StepComposition.skipped`), so those samples train in other epochs. A packed step also
        never holds a sample twice: its window ends before a sample it already holds and at the
        epoch's end.
        """
        skipped = 0
        if epoch_length >= self.micro_batches and epoch_length - start % epoch_length < self.micro_batches:
            skipped = epoch_length - start % epoch_length
            start += skipped
        if not self.budget:
            return self._unpacked(start, rows_at, skipped)
        rows = [rows_at(start + i) for i in range(self._window(start, rows_at, sample_at, epoch_length))]
        bins = self._pack(rows)
        if bins is None:
            # The longest prefix of the window that packs, by bisection: one sample per micro-batch
            # always does, and a few packings stay cheap at thousands of micro-batches.
            low, high = self.micro_batches, len(rows) - 1
            bins = self._pack(rows[:low])
            while low < high:
                mid = (low + high + 1) // 2
                found = self._pack(rows[:mid])
                if found is None:
                    high = mid - 1
                else:
                    low, bins = mid, found
            rows = rows[:low]
        assert bins is not None
        return StepComposition(start, len(rows), self._to_ranks(bins, rows), skipped)

    def _unpacked(self, start: int, rows_at: Callable[[int], int], skipped: int) -> StepComposition:
        """One sample per micro-batch: the window's samples are the micro-batches, dealt as packs are."""
        count = self.micro_batches
        rows = [rows_at(start + i) for i in range(count)] if self.balance else [0] * count
        return StepComposition(start, count, self._to_ranks([[slot] for slot in range(count)], rows), skipped)

    def _window(
        self, start: int, rows_at: Callable[[int], int], sample_at: Callable[[int], int] | None, epoch_length: int
    ) -> int:
        """How many samples from `start` the step takes before packing.

        At least one per micro-batch; then, while the next one fits the rows (a `FILL` share of the
        micro-batches' budget, or all of it with `global_batch`), the step has fewer than `global_batch`,
        the epoch has not ended and the sample is not already in the window.
        """
        need = self.micro_batches
        room = self.micro_batches * self.budget * (1.0 if self.global_batch else FILL)
        cap = self.global_batch or float("inf")
        end = (start // epoch_length + 1) * epoch_length if epoch_length >= need else float("inf")
        seen: set[int] = set()
        count, rows = 0, 0
        while True:
            position = start + count
            nxt = min(rows_at(position), self.budget)
            index = sample_at(position) if sample_at is not None else None
            if count >= need and (count >= cap or position >= end or index in seen or rows + nxt > room):
                return count
            if index is not None:
                seen.add(index)
            count, rows = count + 1, rows + nxt

    def _pack(self, rows: Sequence[int]) -> list[list[int]] | None:
        """The window's slots in `micro_batches` bins of at most `budget` rows, or None when they do not fit.

        A sample over the budget fills an empty bin alone. With `balance` the costliest sample goes
        first, to the cheapest bin it fits; without, each in order to the first bin it fits.
        """
        bins: list[list[int]] = [[] for _ in range(self.micro_batches)]
        used = [0] * len(bins)
        # With `balance`, the bins by (cost so far, index): the cheapest that fits is popped off the heap,
        # the cheaper ones it passed over pushed back.
        heap = [(0.0, b) for b in range(len(bins))]
        order = sorted(range(len(rows)), key=lambda i: (-self.cost(rows[i]), i)) if self.balance else range(len(rows))
        for slot in order:
            r = rows[slot]

            def fits(b: int, r: int = r) -> bool:
                return used[b] + r <= self.budget or (r > self.budget and not used[b])

            if self.balance:
                passed, chosen = [], None
                while heap:
                    load, b = heapq.heappop(heap)
                    if fits(b):
                        chosen = (load, b)
                        break
                    passed.append((load, b))
                for item in passed:
                    heapq.heappush(heap, item)
                if chosen is None:
                    return None
                b = chosen[1]
                heapq.heappush(heap, (chosen[0] + self.cost(r), b))
            else:
                b = next((b for b in range(len(bins)) if fits(b)), -1)
                if b < 0:
                    return None
            bins[b].append(slot)
            used[b] += self.budget if r > self.budget else r
        # Every micro-batch trains something: an empty bin takes the last sample of the fullest one.
        for empty in [b for b in bins if not b]:
            fullest = max(bins, key=len)
            empty.append(fullest.pop(fullest.index(max(fullest))))
        return [sorted(b) for b in bins]

    def _to_ranks(self, bins: list[list[int]], rows: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """`grad_accum` bins per rank: the costliest bin first, to the rank with the least cost so far
        (without `balance`, bin `b` is micro-batch `b // dp` of rank `b % dp`)."""
        dp, accum = self.dp, self.grad_accum
        if not self.balance:
            return tuple(tuple(tuple(bins[m * dp + r]) for m in range(accum)) for r in range(dp))
        bin_cost = [sum(self.cost(rows[s]) for s in b) for b in bins]
        ranks: list[list[int]] = [[] for _ in range(dp)]
        load = [0.0] * dp
        for b in sorted(range(len(bins)), key=lambda b: (-bin_cost[b], b)):
            rank = min((r for r in range(dp) if len(ranks[r]) < accum), key=lambda r: (load[r], r))
            ranks[rank].append(b)
            load[rank] += bin_cost[b]
        return tuple(tuple(tuple(bins[b]) for b in sorted(r, key=lambda b: bins[b][0])) for r in ranks)

    def rank_costs(self, composition: StepComposition, rows_at: Callable[[int], int]) -> list[float]:
        """Each rank's cost in `plan` (the sum over its micro-batches of their samples' costs)."""
        return [
            sum(self.cost(rows_at(composition.start + slot)) for micro in rank for slot in micro)
            for rank in composition.micro_batches
        ]


def batch_layout(dp: int, grad_accum: int, pack: int, global_batch: int) -> dict[str, int]:
    """What sets a step's samples, as a checkpoint records it (`global_batch_change` compares two)."""
    return {"dp": dp, "grad_accum": grad_accum, "pack": pack, "global_batch": global_batch}


def _batch_text(layout: dict[str, int]) -> str:
    dp, accum, pack, want = (layout[k] for k in ("dp", "grad_accum", "pack", "global_batch"))
    grid = f"dp {dp} x train.grad_accum {accum}"
    if not pack:
        return f"{dp * accum} samples per step ({grid})"
    if want:
        return f"{want} samples per step (train.global_batch, in {grid} packs of up to {pack:,} rows)"
    return f"{grid} packs of up to {pack:,} rows per step"


def global_batch_change(saved: dict[str, int], now: dict[str, int]) -> str | None:
    """One line when a resume trains another global batch than the checkpoint's run did, naming the setting
    that keeps the old one; None when the step's samples stay what they were. Layouts: `batch_layout`."""
    saved = {**batch_layout(1, 1, 0, 0), **saved}
    before, after = _batch_text(saved), _batch_text(now)
    if before == after or (saved["pack"] and saved["global_batch"] and saved["global_batch"] == now["global_batch"]):
        return None
    dp = now["dp"]
    if saved["pack"] and saved["global_batch"]:
        keep = f"train.global_batch={saved['global_batch']} keeps it"
    else:
        micro_batches = saved["dp"] * saved["grad_accum"]
        keep = (
            f"train.grad_accum={micro_batches // dp} keeps it"
            if micro_batches % dp == 0
            else f"no train.grad_accum keeps it at dp {dp}"
        )
        if saved["pack"] and saved["pack"] != now["pack"]:
            keep += f" with data.pack={saved['pack']}"
        elif now["pack"] and not saved["pack"]:
            keep = f"data.pack=0 and {keep}"
    return f"the global batch changes: {before} -> {after}; {keep}"


def imbalance(costs: Sequence[float]) -> float:
    """`max / mean - 1` of the ranks' costs: 0 when every rank finishes together."""
    mean = sum(costs) / len(costs)
    return max(costs) / mean - 1.0 if mean > 0 else 0.0


def mean_imbalance(
    composer: StepComposer, rows_at: Callable[[int], int], steps: int, start: int = 0
) -> tuple[float, float]:
    """(mean, worst) per-step `imbalance` of `composer`'s compositions over `steps` steps from position `start`."""
    seen = []
    for _ in range(steps):
        composition = composer.compose(start, rows_at)
        seen.append(imbalance(composer.rank_costs(composition, rows_at)))
        start = composition.end
    return sum(seen) / len(seen), max(seen)


@dataclass(frozen=True)
class StepStats:
    """What one step's composition trains: `samples` over every DP rank, `fill` the share of the packs' rows
    the samples take (`rows / (dp * grad_accum * budget)`; None unpacked), `imbalance` of the ranks'
    costs (`max / mean - 1`), `epoch` the epochs of the order done after it (None: not known)."""

    samples: int
    fill: float | None
    imbalance: float
    epoch: float | None = None


def step_stats(
    composer: StepComposer, composition: StepComposition, rows_at: Callable[[int], int], epoch_length: int = 0
) -> StepStats:
    """`StepStats` of `composition` (the same on every rank: it reads the composition and the lengths only)."""
    fill = None
    if composer.budget:
        rows = sum(
            min(rows_at(composition.start + s), composer.budget)
            for rank in composition.micro_batches
            for m in rank
            for s in m
        )
        fill = rows / (composer.micro_batches * composer.budget)
    epoch = composition.end / epoch_length if epoch_length else None
    return StepStats(composition.count, fill, imbalance(composer.rank_costs(composition, rows_at)), epoch)


@dataclass(frozen=True)
class Outlook:
    """The first steps of a run's order as planned: samples per step, steps per epoch, fill, imbalance.

    `steps` steps were planned from position 0. `steps_per_epoch` is the count of steps that start in
    the first epoch when those steps covered it (`exact`), else the epoch's length over the mean
    samples per step. Means are over the planned steps.
    """

    steps: int
    samples_mean: float
    samples_min: int
    samples_max: int
    steps_per_epoch: float
    exact: bool
    fill: float | None
    imbalance: float
    epoch_length: int


def outlook(
    composer: StepComposer,
    rows_at: Callable[[int], int],
    sample_at: Callable[[int], int],
    epoch_length: int,
    steps: int = 100,
) -> Outlook:
    """Plan up to `steps` steps from position 0 (stopping after the first epoch when it ends sooner)."""
    stats, start = [], 0
    while len(stats) < steps and start < epoch_length:
        composition = composer.compose(start, rows_at, sample_at, epoch_length)
        if composition.start >= epoch_length:
            # The epoch's tail was passed over: its steps are all counted.
            start = composition.start
            break
        stats.append(step_stats(composer, composition, rows_at))
        start = composition.end
    exact = start >= epoch_length
    counts = [s.samples for s in stats]
    mean = sum(counts) / len(counts)
    fills = [s.fill for s in stats if s.fill is not None]
    return Outlook(
        steps=len(stats),
        samples_mean=mean,
        samples_min=min(counts),
        samples_max=max(counts),
        steps_per_epoch=float(len(stats)) if exact else epoch_length / mean,
        exact=exact,
        fill=sum(fills) / len(fills) if fills else None,
        imbalance=sum(s.imbalance for s in stats) / len(stats),
        epoch_length=epoch_length,
    )
