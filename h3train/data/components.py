"""The encoders of MiniMax H3 in its diffusers layout, and tiny random stand-ins for tests and demos.

A components folder holds five subfolders, as the released repository does:

    vae/           AutoencoderKLMiniMaxH3        video VAE, 24 latent channels, 16x spatial
    audio_vae/     AutoencoderKLMiniMaxH3Audio   32 kHz mono VAE, 40 latents/s, 32 channels
    text_encoder/  Qwen3VLForConditionalGeneration
    tokenizer/     Qwen2Tokenizer
    processor/     Qwen3VLProcessor

Everything is loaded with `from_pretrained(..., local_files_only=True)`: nothing is downloaded.
`write_tiny_components` writes randomly initialised versions of all five with the same classes and
the special tokens the prompt presentations use, and around them the rest of a stand-in MiniMax-H3
pipeline folder (`data/stand_in.py`: transformers, schedulers, pipeline index, encode preset).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.utils import is_torchvision_available

from ..errors import ConfigError, did_you_mean
from ..infra.quiet import known_notices
from .stand_in import ENCODE_PRESET_FILE, TINY_ENCODE_PRESET, write_stand_in_pipeline

COMPONENT_NAMES = ("vae", "audio_vae", "text_encoder", "tokenizer", "processor")
# The tokens MiniMax H3's presentations and Qwen3-VL's processor look up by name.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# diffusers' pipeline conditions on `hidden_states[50]` of the text encoder (`text_encoder_layer`), so
# even the tiny encoder has 51 decoder layers: the tiny path reads exactly the layer the real one does.
TINY_TEXT_LAYERS = 51
TINY_TEXT_HIDDEN = 64


class ComponentsError(ConfigError):
    """A components folder that cannot be loaded, in one line naming the folder."""


@dataclass
class Components:
    """The five encoders, loaded and in eval mode."""

    vae: AutoencoderKLMiniMaxH3
    audio_vae: AutoencoderKLMiniMaxH3Audio
    text_encoder: Qwen3VLForConditionalGeneration
    tokenizer: Any
    processor: Qwen3VLProcessor


def reads_videos(processor: Qwen3VLProcessor) -> bool:
    """Whether the processor can present reference videos (transformers builds that part on torchvision)."""
    return getattr(processor, "video_processor", None) is not None


class _Qwen3VLProcessorWithoutVideo(Qwen3VLProcessor):
    """Qwen3-VL's processor assembled from its parts, with or without a video processor.

    transformers builds Qwen3-VL's video processor on torchvision; without torchvision it cannot even
    construct the processor (its argument check looks the video class up in a registry that is then a
    stub). Images, token ids and `create_mm_token_type_ids` need none of that, so this keeps them working
    and leaves reference videos unsupported (`reads_videos`).
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def check_components_folder(root: str | os.PathLike) -> Path:
    """The folder, if it has the five subfolders. Raises `ComponentsError` otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise ComponentsError(f"components folder '{root}' does not exist")
    missing = [name for name in COMPONENT_NAMES if not (root / name).is_dir()]
    if missing:
        raise ComponentsError(
            f"components folder '{root}' has no {', '.join(missing)} subfolder; expected {', '.join(COMPONENT_NAMES)} "
            "(the MiniMax-H3 diffusers layout, or `h3train tiny-components DIR`)"
        )
    return root


def load_components(
    root: str | os.PathLike, device: str | torch.device = "cpu", text_encoder_dtype: torch.dtype = torch.float32
) -> Components:
    """Load the five components from a local folder. The VAEs stay float32 (their released precision)."""
    root = check_components_folder(root)
    kwargs = {"local_files_only": True}
    try:
        vae = AutoencoderKLMiniMaxH3.from_pretrained(root, subfolder="vae", **kwargs)
        with known_notices():
            audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(root, subfolder="audio_vae", **kwargs)
        text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
            root, subfolder="text_encoder", dtype=text_encoder_dtype, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(root, subfolder="tokenizer", **kwargs)
        processor = load_processor(root / "processor")
    except (OSError, ValueError, KeyError) as exc:
        raise ComponentsError(f"components folder '{root}': {type(exc).__name__}: {_first_line(exc)}") from None
    for model in (vae, audio_vae, text_encoder):
        model.to(device).eval().requires_grad_(False)
    return Components(vae, audio_vae, text_encoder, tokenizer, processor)


def load_processor(folder: str | os.PathLike) -> Qwen3VLProcessor:
    """Qwen3-VL's processor from its folder; without torchvision, built from its parts without the video half.

    transformers' own `Qwen3VLProcessor.from_pretrained` always loads a video processor, which needs
    torchvision; this is the processor to hand a diffusers pipeline there:
    `pipe.update_components(processor=load_processor(DIR / "processor"))`.
    """
    folder = Path(folder)
    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
    return _Qwen3VLProcessorWithoutVideo(
        image_processor=AutoImageProcessor.from_pretrained(folder, local_files_only=True),
        tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True),
        video_processor=None,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def components_fingerprint(root: str | os.PathLike) -> str:
    """A cheap identity of a components folder: every file's path and size, and the content of its JSON files.

    Weights are not hashed (tens of GB for the real text encoder); a retrained component that keeps
    its file sizes needs a new folder or a new output folder to be re-encoded.
    """
    root = Path(root)
    digest = hashlib.sha256()
    for name in COMPONENT_NAMES:
        for path in sorted(p for p in (root / name).rglob("*") if p.is_file()):
            digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
            if path.suffix == ".json":
                digest.update(path.read_bytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Tiny random components.


def write_tiny_components(root: str | os.PathLike, seed: int = 0) -> Path:
    """Write a stand-in MiniMax-H3 pipeline folder of tiny random weights into `root`; return it.

    The five encoders have the released classes and geometry rules (24 video / 32 audio latent
    channels, 16x spatial and 17 -> 5 temporal video compression, 800-sample audio hop, 51 text
    layers) with tiny widths: the text encoder's hidden size, the `text_dim` a model trained on its
    embeddings needs, is `TINY_TEXT_HIDDEN`. Beside them `data/stand_in.py` writes the two
    transformer partitions (that `text_dim`), the schedulers, `modular_model_index.json` and the
    encode preset (`encode_preset`). The same seed writes the same weights.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    _save_processor(_tiny_processor(tokenizer), root / "processor")
    torch.manual_seed(seed)
    _tiny_text_encoder(tokenizer).save_pretrained(root / "text_encoder")
    torch.manual_seed(seed + 1)
    _tiny_video_vae().save_pretrained(root / "vae")
    torch.manual_seed(seed + 2)
    _tiny_audio_vae().save_pretrained(root / "audio_vae")
    return write_stand_in_pipeline(root, TINY_TEXT_HIDDEN, seed + 3)


def encode_preset(root: str | os.PathLike) -> dict[str, int | float] | None:
    """The `h3train encode` settings a components folder states for itself, or None if it states none.

    A stand-in folder holds `h3train_encode_preset.json`: `EncodeSettings` field -> value for the
    canvas and clip lengths its tiny models are meant for; the released folder has no such file.
    Raises `ComponentsError` for a file that is not such an object.
    """
    path = Path(root) / ENCODE_PRESET_FILE
    if not path.is_file():
        return None
    try:
        preset = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ComponentsError(f"encode preset '{path}' cannot be read: {_first_line(exc)}") from None
    if not isinstance(preset, dict):
        raise ComponentsError(f"encode preset '{path}' must hold a JSON object of encode settings")
    for key, value in preset.items():
        if key not in TINY_ENCODE_PRESET:
            raise ComponentsError(
                f"encode preset '{path}' has unknown key '{key}'; expected some of {', '.join(TINY_ENCODE_PRESET)}"
                f"{did_you_mean(key, TINY_ENCODE_PRESET)}"
            )
        # The pixel settings are whole numbers; the durations may be fractional.
        fractional = isinstance(TINY_ENCODE_PRESET[key], float)
        if isinstance(value, bool) or not isinstance(value, (int, float) if fractional else int):
            what = "a number" if fractional else "a whole number"
            raise ComponentsError(f"encode preset '{path}' key '{key}' is {value!r}; it takes {what}")
    return preset


def _tiny_tokenizer() -> Any:
    """A byte-level BPE over the 256 byte symbols, no merges: every string encodes, one token per byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def _tiny_processor(tokenizer: Any) -> Qwen3VLProcessor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Small pixel budgets keep vision blocks to a handful of tokens: 32x32 pixels per token.
    geometry = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    image = Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, **geometry)
    video = Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128 * 8}, **geometry)
    return _Qwen3VLProcessorWithoutVideo(image_processor=image, tokenizer=tokenizer, video_processor=video)


def _save_processor(processor: Qwen3VLProcessor, folder: Path) -> None:
    processor.save_pretrained(folder)
    # Saved through the permissive subclass; the files name the class that loads them.
    for path in folder.glob("*.json"):
        config = json.loads(path.read_text())
        if config.get("processor_class") == type(processor).__name__:
            config["processor_class"] = Qwen3VLProcessor.__name__
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _tiny_text_encoder(tokenizer: Any) -> Qwen3VLForConditionalGeneration:
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    head_dim = 16
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TINY_TEXT_HIDDEN,
            "intermediate_size": 2 * TINY_TEXT_HIDDEN,
            "num_hidden_layers": TINY_TEXT_LAYERS,
            "num_attention_heads": TINY_TEXT_HIDDEN // head_dim,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            # The (t, h, w) rotary sections must add up to head_dim / 2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": TINY_TEXT_HIDDEN,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config)


def _tiny_statistics(channels: int) -> dict[str, list[float]]:
    """Per-channel latent statistics that are not the identity, so a normalization mistake shows."""
    return {
        "latents_mean": [round(0.05 * (c - channels / 2), 4) for c in range(channels)],
        "latents_std": [round(0.5 + 0.04 * c, 4) for c in range(channels)],
    }


def _tiny_video_vae() -> AutoencoderKLMiniMaxH3:
    # Released spatial (2, 2, 2, 2) and temporal (2, 2) downsampling: the geometry rules stay exact.
    return AutoencoderKLMiniMaxH3(
        **_tiny_statistics(24),
        block_out_channels=(4, 4, 8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
    )


def _tiny_audio_vae() -> AutoencoderKLMiniMaxH3Audio:
    # The released encoder hop (2*4*4*5*5 = 800 samples: 40 latents/s at 32 kHz) with three decoder
    # stages of the same product; the decoder needs `decoder_dim >= 2 ** len(decoder_rates)`.
    with known_notices():
        return AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4,
            latent_dim=32,
            latent_channels=32,
            num_attention_heads=2,
            decoder_dim=8,
            decoder_rates=(8, 10, 10),
            decoder_kernel_sizes=(16, 20, 20),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1, 3, 5),),
            # The pipeline normalizes with these.
            **_tiny_statistics(32),
        )
