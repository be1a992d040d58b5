"""Packs: several training samples trained as one sequence, each exactly as it is alone.

A **pack** is the samples of one packed micro-batch (`Pack`), in row order. `pack_inputs` lays their
noised inputs (each as `objective.make_training_inputs` built it alone) one after the other into one
sequence of the ten `model.forward` arguments per branch (`pack_forward_rows`) and keeps each
sample's own targets, masks, weights and guidance (`PackedInputs.samples`): the micro-batch's loss
is the sum of its samples' losses (`objective.compute_loss`), so its gradient is theirs as separate
micro-batches. How the rows split into samples (`PackRows`) is what the model needs to keep them
apart: attention and the prompt refiner run block-diagonally over the samples' own rows
(`SequenceParallelH3.forward`'s `segments` / `text_segments`), and each sample's timestep indices
point at its own rows of the AdaLN table.

Which samples share a pack, and which rank trains it, is the step composer's (`data/step_composition.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .objective import TrainingInputs, move_rows
from .tasks.sample import TrainingSample


@dataclass(frozen=True)
class Pack:
    """The samples of one packed micro-batch, in row order.

    It answers what the loop's hooks ask of a micro-batch's sample: its id (the samples' joined by
    `+`), whether it has sound (any sample), its packed length (the samples' together) and its meta.
    """

    samples: tuple[TrainingSample, ...]

    @property
    def sample_id(self) -> str:
        return "+".join(s.sample_id for s in self.samples)

    @property
    def has_audio(self) -> bool:
        return any(s.has_audio for s in self.samples)

    @property
    def seq_len(self) -> int:
        return sum(s.layout.seq_len for s in self.samples)

    def meta(self) -> dict:
        return {"pack": [s.meta() for s in self.samples]}


def members(sample: TrainingSample | Pack) -> tuple[TrainingSample, ...]:
    """The samples a micro-batch trains: a pack's, or the one sample."""
    return sample.samples if isinstance(sample, Pack) else (sample,)


@dataclass(frozen=True)
class PackRows:
    """How a packed micro-batch's rows split into its samples, in row order.

    `rows` / `text_rows`: each sample's packed length and text length under its prompt; `uncond_*` the
    same under the negative prefix (the CFG branch; empty without it). `video_rows` / `audio_rows`:
    each sample's rows of `hidden_states` / `audio_hidden_states` (the same in both branches).
    """

    rows: tuple[int, ...]
    text_rows: tuple[int, ...]
    uncond_rows: tuple[int, ...]
    uncond_text_rows: tuple[int, ...]
    video_rows: tuple[int, ...]
    audio_rows: tuple[int, ...]

    def segments(self, uncond: bool = False) -> dict[str, tuple[int, ...]]:
        """`SequenceParallelH3.forward`'s `segments` and `text_segments` for one branch."""
        if uncond:
            return {"segments": self.uncond_rows, "text_segments": self.uncond_text_rows}
        return {"segments": self.rows, "text_segments": self.text_rows}

    @property
    def longest(self) -> int:
        """The longer branch's packed length: what the pack holds in memory at once."""
        return max(sum(self.rows), sum(self.uncond_rows))


@dataclass
class PackedInputs:
    """A packed micro-batch (an `objective.MicroBatch`): one sequence of forward rows per branch, and
    each sample's own loss inputs.

    `model_inputs` / `uncond_inputs`: the ten `model.forward` arguments of all samples as one sequence
    (`pack_forward_rows`), the second under the negative prefix when the run has CFG on. `samples`:
    each sample's `TrainingInputs` without forward rows (targets, masks, weights, sigma, guidance,
    id). `rows`: how the rows split. There is no pack-wide sigma, weight or guidance: each is a sample's.
    `step_samples`: the most samples a micro-batch of the step holds on any rank (the step composer's
    `StepComposition.largest_micro_batch`; the pack's own count where no plan is shared).
    """

    model_inputs: dict[str, torch.Tensor]
    uncond_inputs: dict[str, torch.Tensor] | None
    samples: tuple[TrainingInputs, ...]
    rows: PackRows
    step_samples: int

    def forward_kwargs(self, uncond: bool = False) -> dict[str, object]:
        """The forward's arguments of one branch: its rows, the samples' segments and the step's largest
        count of samples in a micro-batch (`SequenceParallelH3.forward`'s `pack_samples`)."""
        inputs = self.uncond_inputs if uncond else self.model_inputs
        return {**inputs, **self.rows.segments(uncond), "pack_samples": self.step_samples}

    def split_predictions(
        self, video: torch.Tensor, audio: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """A forward's predictions `video [1, N_v, C]` / `audio [1, N_a, C]` as each sample's, in row order."""
        videos = video.split(self.rows.video_rows, dim=1)
        audios = audio.split(self.rows.audio_rows, dim=1)
        return tuple(zip(videos, audios, strict=True))

    def to(self, device: torch.device) -> PackedInputs:
        """Copy to `device` (each tensor as `TrainingInputs.to` copies it)."""
        if device.type == "cpu":
            return self
        return replace(
            self,
            model_inputs=move_rows(self.model_inputs, device),
            uncond_inputs=move_rows(self.uncond_inputs, device),
            samples=tuple(s.to(device) for s in self.samples),
        )


_ROW_INDEX_ARGS = ("video_indices", "audio_indices", "text_indices")


def pack_forward_rows(branches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ten forward arguments of several samples as one sequence, each sample keeping its own.

    Sample `i`'s rows follow sample `i - 1`'s: its row indices move by the rows before it, its timestep
    indices by the timesteps before it (each sample keeps its own table entries, so its AdaLN rows are
    its own), and its positions stay those diffusers built for it alone (its RoPE is unchanged).
    """
    row_offset, time_offset = 0, 0
    shifted: dict[str, list[torch.Tensor]] = {k: [] for k in ("timestep_indices", *_ROW_INDEX_ARGS)}
    for rows in branches:
        shifted["timestep_indices"].append(rows["timestep_indices"] + time_offset)
        for key in _ROW_INDEX_ARGS:
            shifted[key].append(rows[key] + row_offset)
        row_offset += rows["position_ids"].shape[0]
        time_offset += rows["timestep"].shape[0]
    out = {key: torch.cat(parts) for key, parts in shifted.items()}
    for key in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        out[key] = torch.cat([rows[key] for rows in branches], dim=1)
    for key in ("timestep", "token_tags", "position_ids"):
        out[key] = torch.cat([rows[key] for rows in branches])
    return {key: out[key] for key in branches[0]}


def pack_inputs(items: list[TrainingInputs], step_samples: int | None = None) -> PackedInputs:
    """Several samples' inputs (each as `make_training_inputs` built it alone) as one packed micro-batch;
    `step_samples` the step's largest micro-batch (`PackedInputs`; None: this one).

    Under CFG every sample has its negative branch (the run's), and the negative rows pack the same way.
    """
    if not items:
        raise ValueError("a pack holds at least one sample")
    if len({item.uncond_inputs is None for item in items}) > 1:
        raise ValueError("the samples of a pack must agree on the CFG branch")
    with_uncond = items[0].uncond_inputs is not None

    def lengths(branch: str, key: str, dim: int) -> tuple[int, ...]:
        return tuple(int(getattr(i, branch)[key].shape[dim]) for i in items)

    rows = PackRows(
        rows=lengths("model_inputs", "position_ids", 0),
        text_rows=lengths("model_inputs", "encoder_hidden_states", 1),
        uncond_rows=lengths("uncond_inputs", "position_ids", 0) if with_uncond else (),
        uncond_text_rows=lengths("uncond_inputs", "encoder_hidden_states", 1) if with_uncond else (),
        video_rows=tuple(int(i.target_video.shape[0]) for i in items),
        audio_rows=tuple(int(i.target_audio.shape[0]) for i in items),
    )
    return PackedInputs(
        model_inputs=pack_forward_rows([i.model_inputs for i in items]),
        uncond_inputs=pack_forward_rows([i.uncond_inputs for i in items]) if with_uncond else None,
        samples=tuple(replace(item, model_inputs={}, uncond_inputs=None) for item in items),
        rows=rows,
        step_samples=len(items) if step_samples is None else step_samples,
    )
