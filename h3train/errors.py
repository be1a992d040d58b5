"""Every error h3train reports to a user, by what it is about.

Each message is one line naming the key, file or sample and what to do. The CLI prints it as
`h3train: error: <message>` and exits with the class's `exit_code`: 2 for anything the user can fix
before a run (bad config, usage, data), 1 for a run that could not go on. This module imports
nothing from h3train, so any module may raise these without an import cycle.

A message about a name that is not one of a known set (a config key, a choice, a flag, a field)
suggests the nearest valid ones with `did_you_mean`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

# How alike two spellings must be (difflib's ratio, 0..1) for one to be suggested for the other:
# difflib's own default, which takes one or two slips in a short word and nothing unrelated.
NEAR = 0.6


def _ranked(
    word: str, candidates: Iterable[str], cutoff: float, key: Callable[[str], str] | None
) -> list[tuple[float, str]]:
    """(likeness, candidate) of every candidate at least `cutoff` alike, most alike first, ties in given order."""
    part = key or (lambda name: name)
    lowered = part(word).lower()
    scored = [
        (difflib.SequenceMatcher(None, lowered, part(candidate).lower()).ratio(), candidate)
        for candidate in dict.fromkeys(candidates)
    ]
    return sorted((pair for pair in scored if pair[0] >= cutoff), key=lambda pair: -pair[0])


def nearest(
    word: str, candidates: Iterable[str], n: int = 3, cutoff: float = NEAR, key: Callable[[str], str] | None = None
) -> list[str]:
    """The at most `n` candidates spelled most like `word`, nearest first; none far from it.

    Case is ignored, so `LoRA` finds `lora`; candidates equally near keep their given order. `key`
    picks the part of `word` and of each candidate to compare (a dotted key's last part).
    """
    return [candidate for _, candidate in _ranked(word, candidates, cutoff, key)[:n]]


def _quoted_or(names: list[str]) -> str:
    quoted = [f"'{name}'" for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def did_you_mean(
    word: str, candidates: Iterable[str], cutoff: float = NEAR, key: Callable[[str], str] | None = None
) -> str:
    """` (did you mean 'x'?)` naming the candidate nearest to `word`, or `""` when none is near.

    Candidates as near as the nearest are named too (`adamw6bit`: `adamw8bit` or `adamw4bit`), up to
    three; `key` as in `nearest`. The leading space lets a message append the fragment as it is.
    """
    ranked = _ranked(word, candidates, cutoff, key)
    if not ranked:
        return ""
    tied = [candidate for score, candidate in ranked if score == ranked[0][0]]
    return f" (did you mean {_quoted_or(tied[:3])}?)"


def did_you_mean_each(
    words: Iterable[str],
    candidates: Iterable[str],
    cutoff: float = NEAR,
    ignore: Callable[[str], bool] | None = None,
) -> str:
    """`did_you_mean` for several unknown words at once: ` (did you mean 'to_q' for 'to_qq', ...?)`, or `""`.

    One word gets `did_you_mean`'s fragment. A word near no candidate is left out, and so is one
    `ignore` accepts (a regular expression is no misspelt name).
    """
    words, candidates = list(words), list(dict.fromkeys(candidates))
    matched = [word for word in words if ignore is None or not ignore(word)]
    if len(words) == 1:
        return did_you_mean(words[0], candidates, cutoff) if matched else ""
    named = [f"'{best[0]}' for '{word}'" for word in matched if (best := nearest(word, candidates, 1, cutoff))]
    return f" (did you mean {', '.join(named)}?)" if named else ""


def one_of(value: str, choices: Iterable[str]) -> str:
    """`choose one of a, b, c`, then the nearest choice to `value` if one is near: the tail of a bad-choice message."""
    choices = list(choices)
    return f"choose one of {', '.join(choices)}{did_you_mean(str(value), choices)}"


class H3TrainError(Exception):
    """Base of the errors the CLI reports as one line.

    `agreed`: set on an error every rank raised alike after the process group exists (a collective
    decided it); rank 0 alone prints it, so torchrun shows it once, not once per rank.
    """

    exit_code = 2
    agreed = False


class ConfigError(H3TrainError, ValueError):
    """A configuration value that cannot work, naming the config key."""


class UsageError(H3TrainError, ValueError):
    """A command used in a way that cannot work: a launcher, an output path, a file argument."""


class DatasetError(H3TrainError, ValueError):
    """A dataset folder or index problem, naming the path."""


class SampleError(H3TrainError, ValueError):
    """A cached sample that cannot be used, naming the file and the field."""


class CheckpointError(H3TrainError, ValueError):
    """A checkpoint that cannot be loaded, naming the file and what is wrong with it."""


class TrainingError(H3TrainError, RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps)."""

    exit_code = 1


class DiskFullError(H3TrainError, RuntimeError):
    """A write that found no space left, naming the folder, the bytes needed and the bytes free."""

    exit_code = 1
