"""Which modules `lora.target_modules` and `lora.train_modules` select, checked before heavy work.

An entry selects a module by its diffusers path when it is the full path
(`transformer_blocks.0.attn.to_q`), a dotted suffix of it (`to_q`, `attn.to_out.0`), or a regular
expression that matches the full path (`transformer_blocks\\.\\d+\\.attn\\.to_q`). Every entry must
select at least one module, LoRA targets must be `nn.Linear`, and no module is both adapted and
trained in full. The check runs on the model built on the meta device, so its names are exactly the
trained model's and it costs no memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from ..config import Config
from ..errors import ConfigError, did_you_mean_each
from ..model.architecture import planned_model_dims


def selects(entry: str, name: str) -> bool:
    """Whether one `target_modules` / `train_modules` entry selects the module at path `name`."""
    if name == entry or name.endswith("." + entry):
        return True
    try:
        return re.fullmatch(entry, name) is not None
    except re.error:
        return False


def select_modules(model: nn.Module, entries: Iterable[str]) -> tuple[list[str], list[str]]:
    """(paths of the modules any entry selects, in model order; the entries that select nothing)."""
    entries = list(entries)
    hit: set[str] = set()
    names = [name for name, _ in model.named_modules() if name]
    chosen = []
    for name in names:
        matched = [e for e in entries if selects(e, name)]
        if matched:
            chosen.append(name)
            hit.update(matched)
    return chosen, [e for e in entries if e not in hit]


def _quoted(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in items)


# Named sets of targets by the modality whose prediction they move. H3's blocks are shared: every
# attention and feed-forward layer reads video, audio and text rows alike, and the blocks' AdaLN
# projection makes every modality's modulation in one Linear. An input projection (`proj_in`,
# `audio_proj_in`, the text path) sees one kind of row, but the joint attention carries what it
# changes to every output. Only the output projections move one modality's prediction alone:
# `proj_out` the video's, `audio_proj_out` the audio's.
PRESETS: dict[str, tuple[str, ...]] = {
    "video_only": ("proj_out",),
    "audio_only": ("audio_proj_out",),
    "video_and_audio": (
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)",
    ),
}


def _spellings(names: Iterable[str]) -> list[str]:
    """What an entry might have meant to name: each module's last part (`to_q`, `proj_out`), its last
    two for an indexed one (`to_out.0`); the full paths are too long to be near a short entry."""
    out: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        out[".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]] = None
    return list(out)


# A regular expression is not a spelling of a name: no suggestion for an entry that holds one of these.
_PATTERN_CHARS = frozenset("\\()[]{}*+?|^$")


def _hint(missing: list[str], names: Iterable[str], presets: bool) -> str:
    """` (did you mean ...?)` for the entries of `missing`, against the presets and the model's module names."""
    candidates = [*(PRESETS if presets else ()), *_spellings(names)]
    return did_you_mean_each(missing, candidates, ignore=lambda entry: bool(_PATTERN_CHARS & set(entry)))


def _with_parameters(modules: dict[str, nn.Module]) -> list[str]:
    return [name for name, module in modules.items() if name and next(module.parameters(), None) is not None]


def expand_presets(entries: Iterable[str]) -> list[str]:
    """`entries` with each preset name (`PRESETS`) replaced by the entries it stands for."""
    out: list[str] = []
    for entry in entries:
        out += PRESETS.get(entry, (entry,))
    return out


def resolve_targets(model: nn.Module, target_modules: Iterable[str]) -> list[str]:
    """Full paths of the Linear layers `target_modules` selects (presets expanded); a `ConfigError`
    naming any bad entry."""
    entries = expand_presets(target_modules)
    if not entries:
        raise ConfigError("config key 'lora.target_modules' is empty; name at least one Linear layer, e.g. [to_q]")
    chosen, missing = select_modules(model, entries)
    if missing:
        linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        raise ConfigError(
            f"config key 'lora.target_modules': {_quoted(missing)} match no module of the model"
            f"{_hint(missing, linear, presets=True)}; give a preset ({', '.join(PRESETS)}), module paths "
            "(transformer_blocks.0.attn.to_q), their suffixes (to_q) or regular expressions over them"
        )
    modules = dict(model.named_modules())
    not_linear = [n for n in chosen if not isinstance(modules[n], nn.Linear)]
    if not_linear:
        bad = [e for e in entries if any(selects(e, n) for n in not_linear)]
        first = not_linear[0]
        raise ConfigError(
            f"config key 'lora.target_modules': {_quoted(bad)} select {first} ({type(modules[first]).__name__}) "
            f"and {len(not_linear) - 1} more that are not Linear layers; LoRA adapts Linear layers only"
        )
    return chosen


def resolve_train_modules(model: nn.Module, train_modules: Iterable[str], targets: Iterable[str]) -> list[str]:
    """Full paths of the modules trained in full beside the adapters; none may hold or be a LoRA target."""
    entries = list(train_modules)
    if not entries:
        return []
    chosen, missing = select_modules(model, entries)
    modules = dict(model.named_modules())
    with_params = [n for n in chosen if next(modules[n].parameters(), None) is not None]
    empty = [e for e in entries if e not in missing and not any(selects(e, n) for n in with_params)]
    if missing or empty:
        raise ConfigError(
            f"config key 'lora.train_modules': {_quoted(missing + empty)} select no module with parameters"
            f"{_hint(missing + empty, _with_parameters(modules), presets=False)}; give module paths "
            "(norm_out.norm), their suffixes (norm1) or regular expressions over them"
        )
    targets = list(targets)
    for name in chosen:
        overlap = [t for t in targets if t == name or t.startswith(name + ".") or name.startswith(t + ".")]
        if overlap:
            raise ConfigError(
                f"config key 'lora.train_modules': module {name} overlaps the LoRA target {overlap[0]}; "
                "a module is either adapted or trained in full, remove it from one of the two lists"
            )
    return chosen


def meta_model(cfg: Config) -> nn.Module:
    """The configured architecture on the meta device (no memory, no weights read).

    Away from the model folder (planning on a laptop) the released architecture stands in, as in
    `planned_model_dims`; training checks the folder itself in preflight.
    """
    from ..model.build import meta_transformer

    return meta_transformer(planned_model_dims(cfg)[0])
