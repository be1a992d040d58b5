"""The models, data and measures of `scripts/distill_study.py`, whose docstring describes the study: a tiny
teacher trained with prompt dropout, its CFG-distilled student, and the held-out measures of a fine-tune."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from diffusers import MiniMaxH3Transformer3DModel

from h3train.config import CfgConfig, LossWeights, TimestepConfig
from h3train.data.dataset import CachedDataset
from h3train.data.dataset_index import write_index
from h3train.data.sample_file import CachedSample, write_sample
from h3train.data.synthetic_dataset import _presentation_tags
from h3train.objective import compute_loss, make_training_inputs, masked_mse
from h3train.tasks.layout import AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS
from h3train.tasks.sample import TrainingSample
from h3train.train.validation import heldout_generator

# The checkout whose configs/tiny_fl2va.yaml the study's model and runs take (`scripts/distill_study.py`).
ROOT = Path(__file__).resolve().parents[2]

TINY = yaml.safe_load((ROOT / "configs" / "tiny_fl2va.yaml").read_text())["model"]["config"]
# The geometry of every clip: 5 pixel frames -> 2 latent frames of 4 x 6, 8 audio latents per channel.
NUM_FRAMES, LATENT_FRAMES, HEIGHT, WIDTH, AUDIO_LATENTS = 5, 2, 4, 6, 8
PROMPT_TOKENS, NEGATIVE_TOKENS = 10, 3
CONCEPTS = 4
SIGMAS = [0.2, 0.4, 0.6, 0.8]
TIMESTEPS = TimestepConfig()
WEIGHTS = LossWeights()


# -- data -------------------------------------------------------------------------------------------


class World:
    """The concepts (video and audio patterns, prompt embeddings), the negative prompt and a style."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        text_dim = TINY["text_dim"]
        self.video = torch.randn(CONCEPTS, VIDEO_LATENT_CHANNELS, LATENT_FRAMES, HEIGHT, WIDTH, generator=g)
        self.audio = torch.randn(CONCEPTS, 2, AUDIO_LATENT_CHANNELS, AUDIO_LATENTS, generator=g)
        self.prompts = torch.randn(CONCEPTS, PROMPT_TOKENS, text_dim, generator=g)
        self.negative = torch.randn(NEGATIVE_TOKENS, text_dim, generator=g)
        # The new data's style: the same concepts, shifted.
        self.style_video = 0.8 * torch.randn(VIDEO_LATENT_CHANNELS, LATENT_FRAMES, HEIGHT, WIDTH, generator=g)
        self.style_audio = 0.8 * torch.randn(2, AUDIO_LATENT_CHANNELS, AUDIO_LATENTS, generator=g)

    def sample(self, name: str, concept: int, g: torch.Generator, styled: bool) -> CachedSample:
        video = self.video[concept] + 0.5 * torch.randn(self.video[concept].shape, generator=g)
        audio = self.audio[concept] + 0.5 * torch.randn(self.audio[concept].shape, generator=g)
        if styled:
            video, audio = video + self.style_video, audio + self.style_audio
        prompt = self.prompts[concept] + 0.05 * torch.randn(self.prompts[concept].shape, generator=g)
        negative_tags = _presentation_tags([], NEGATIVE_TOKENS)
        return CachedSample(
            sample_id=name,
            task="t2va",
            num_frames=NUM_FRAMES,
            video_latents=video,
            audio_latents=audio,
            prompt_embeds=prompt,
            text_token_tags=_presentation_tags([], PROMPT_TOKENS),
            negative_prompt_embeds=self.negative.clone(),
            negative_text_token_tags=negative_tags,
            negative_visual_prompt_embeds=self.negative.clone(),
            negative_visual_text_token_tags=negative_tags.clone(),
            source=f"distill_study(concept={concept}, styled={styled})",
        )

    def dataset(self, folder: Path, count: int, seed: int, styled: bool) -> list[TrainingSample]:
        """`count` clips, concepts in turn, written as a cached dataset; returns them packed."""
        g = torch.Generator().manual_seed(seed)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            write_sample(folder / f"clip-{i:04d}.safetensors", self.sample(f"clip-{i:04d}", i % CONCEPTS, g, styled))
        write_index(folder)
        return list(CachedDataset(folder, "t2va"))


# -- teacher and student ----------------------------------------------------------------------------


def _forward(model: MiniMaxH3Transformer3DModel):
    return lambda **inputs: model(**inputs, return_dict=False)


def train_teacher(samples: list[TrainingSample], steps: int, seed: int) -> MiniMaxH3Transformer3DModel:
    """Flow matching, the prompt dropped to the negative one on a quarter of the steps."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**TINY).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        sample = samples[int(torch.randint(len(samples), (), generator=g))]
        drop = bool(torch.rand((), generator=g) < 0.25)
        ti = make_training_inputs(sample, g, TIMESTEPS, WEIGHTS, CfgConfig(), drop_text=drop)
        opt.zero_grad(set_to_none=True)
        compute_loss(_forward(model), ti).loss.backward()
        opt.step()
    return model.eval()


def _guided_pair(sample: TrainingSample, g: torch.Generator, scale: float, sigma: float | None = None):
    """Inputs of one pair with the negative branch (`uncond_inputs`) built, at `sigma` or a drawn one."""
    return make_training_inputs(sample, g, TIMESTEPS, WEIGHTS, CfgConfig(scale=scale), sigma=sigma)


def distill_student(
    teacher: MiniMaxH3Transformer3DModel, samples: list[TrainingSample], steps: int, scale: float, seed: int
) -> MiniMaxH3Transformer3DModel:
    """The student's conditional prediction toward the teacher's `u + s (c - u)`, its negative toward `u`."""
    student = MiniMaxH3Transformer3DModel(**TINY).float()
    student.load_state_dict(teacher.state_dict())
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        ti = _guided_pair(samples[int(torch.randint(len(samples), (), generator=g))], g, scale)
        with torch.no_grad():
            c = teacher(**ti.model_inputs, return_dict=False)
            u = teacher(**ti.uncond_inputs, return_dict=False)
        p = student(**ti.model_inputs, return_dict=False)
        q = student(**ti.uncond_inputs, return_dict=False)
        masks = (ti.loss_mask_video, ti.loss_mask_audio)
        loss = sum(
            masked_mse(p[m], (u[m] + scale * (c[m] - u[m]))[0], masks[m]) + masked_mse(q[m], u[m][0], masks[m])
            for m in range(2)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return student.eval()


def held_out_measures(
    model: MiniMaxH3Transformer3DModel,
    teacher: MiniMaxH3Transformer3DModel,
    heldout: list[TrainingSample],
    scale: float,
    seed: int,
) -> dict[str, float]:
    """Means over the held-out pairs (the validation's own noise), over the loss rows, per modality:

    - `to_guided_*`: `MSE(p(c), u_T + s (c_T - u_T))`, the distance from the teacher's guided prediction;
    - `calibrated_*`: `MSE((p(c) + (s - 1) p(neg)) / s, v)`, how well the model fits the new data read
      as a distilled model (its prediction undone by its own guidance), whatever objective trained it.
    """
    sums: dict[str, float] = {}
    pairs = 0
    for sample in heldout:
        for sigma in SIGMAS:
            ti = _guided_pair(sample, heldout_generator(seed, sample.sample_id, sigma), scale, sigma=sigma)
            with torch.no_grad():
                c = teacher(**ti.model_inputs, return_dict=False)
                u = teacher(**ti.uncond_inputs, return_dict=False)
                p = model(**ti.model_inputs, return_dict=False)
                q = model(**ti.uncond_inputs, return_dict=False)
            for m, name in enumerate(("video", "audio")):
                mask = (ti.loss_mask_video, ti.loss_mask_audio)[m]
                target = (ti.target_video, ti.target_audio)[m]
                guided = float(masked_mse(p[m], (u[m] + scale * (c[m] - u[m]))[0], mask))
                calibrated = float(masked_mse((p[m] + (scale - 1.0) * q[m]) / scale, target, mask))
                sums[f"to_guided_{name}"] = sums.get(f"to_guided_{name}", 0.0) + guided
                sums[f"calibrated_{name}"] = sums.get(f"calibrated_{name}", 0.0) + calibrated
            pairs += 1
    return {key: value / pairs for key, value in sums.items()}


# -- the fine-tunes ---------------------------------------------------------------------------------

ARMS = {
    # name: (overrides, what it is)
    "plain_full": ([], "full fine-tune, plain flow matching"),
    "cfg_full": (["cfg.scale={scale}"], "full fine-tune, CFG-calibrated objective"),
    "plain_lora": (["lora.rank=8", "optim.lr={lora_lr}"], "LoRA rank 8, plain flow matching"),
    "cfg_lora": (["lora.rank=8", "optim.lr={lora_lr}", "cfg.scale={scale}"], "LoRA rank 8, CFG-calibrated objective"),
}


# -- the table --------------------------------------------------------------------------------------

COLUMNS = (
    ("val_loss", "held-out loss"),
    ("calibrated", "calibrated"),
    ("guidance_ratio_video", "g ratio v"),
    ("guidance_cos_video", "g cos v"),
    ("guidance_ratio_audio", "g ratio a"),
    ("guidance_cos_audio", "g cos a"),
    ("to_guided_video", "to guided v"),
    ("to_guided_audio", "to guided a"),
)


def table_row(validation: dict, measured: dict[str, float]) -> dict[str, float]:
    out = {
        "val_loss": validation["val/loss"],
        "calibrated": measured["calibrated_video"] + measured["calibrated_audio"],
    }
    for name in ("video", "audio"):
        out[f"guidance_ratio_{name}"] = validation[f"val/guidance_ratio_{name}"]
        out[f"guidance_cos_{name}"] = validation[f"val/guidance_cos_{name}"]
        out[f"to_guided_{name}"] = measured[f"to_guided_{name}"]
    return out


def format_table(rows: dict[str, dict[str, float]]) -> str:
    width = max(len(name) for name in rows) + 2
    lines = ["arm".ljust(width) + "".join(f"{title:>15}" for _, title in COLUMNS)]
    for name, row in rows.items():
        lines.append(name.ljust(width) + "".join(f"{row[key]:>15.4f}" for key, _ in COLUMNS))
    return "\n".join(lines)
