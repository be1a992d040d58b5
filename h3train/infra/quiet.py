"""Known, harmless notices of third-party libraries, silenced only around the h3train calls that raise them.

Each entry below was read at its source and says nothing a user can act on; it is dropped for the
duration of a `with known_notices():` block and nowhere else, so the same notice from a user's own
code (or a new notice from the same call) still shows.

- diffusers' `ModelMixin.set_attention_backend` logs "Attention backends are an experimental feature
  and the API may be subject to change." on every call (a `logging` record, not a warning): h3train
  pins and tests the backends it sets.
- torch's `torch.nn.utils.weight_norm` is deprecated (a `FutureWarning`), and diffusers'
  `AutoencoderKLMiniMaxH3Audio` still builds its convolutions with it, to keep the checkpoint's
  `weight_g` / `weight_v` names; nothing in h3train calls it directly.

Four notices come from importing torchao, which diffusers, transformers and peft do at their own
import wherever it is installed (h3train uses it for `optim.name: adamw8bit | adamw4bit`). They
are raised once per process, at an import h3train cannot wrap, so `drop_import_notices()` (called
when the package loads) filters them on their loggers for the process:

- torchao "Failed to load <its _C*.so>", only on a torch build without CUDA: those libraries are
  CUDA kernels (the quantized optimizers compile their own step and do not use them). On a CUDA
  build the notice stays, since there it means a torch / torchao mismatch.
- torchao "Skipping import of cpp extensions due to incompatible torch version", where torchao is
  newer than torch (the Docker image's torch 2.8 with torchao 0.16, the oldest release peft accepts):
  the skipped libraries are the same kernels, and the quantized optimizers do not use them.
- torch's `_pytree` "... is an Enum subclass and is now natively supported by torch.compile ...":
  torchao registers its enums with a call newer torch deprecates.
- diffusers' "Unable to import `torchao` Tensor objects": its torchao quantizer lists classes newer
  torchao moved; it concerns loading torchao-quantized checkpoints, which h3train does not do.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# (logger name, message prefix) of the logging records dropped inside the block.
_LOG_NOTICES = (("diffusers.models.modeling_utils", "Attention backends are an experimental feature"),)
# (category, message regex) of the warnings dropped inside the block.
_WARNINGS = ((FutureWarning, r"`torch\.nn\.utils\.weight_norm` is deprecated"),)


# (logger name, message prefix or None, substring) of the notices raised while torchao is imported.
_IMPORT_NOTICES = (
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version", None),
    ("torch.utils._pytree", None, "is an Enum subclass and is now natively supported by torch.compile"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects", None),
)
_CPU_BUILD_IMPORT_NOTICES = (("torchao", "Failed to load ", "_C"),)


class _DropImportNotice(logging.Filter):
    """Drops the records of one logger that start with `prefix` (if given) and contain `part` (if given)."""

    def __init__(self, prefix: str | None, part: str | None) -> None:
        super().__init__()
        self.prefix, self.part = prefix, part

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        hit = (self.prefix is None or text.startswith(self.prefix)) and (self.part is None or self.part in text)
        return not hit


def drop_import_notices() -> None:
    """Filter the torchao import notices of the module docstring on their loggers (idempotent, no imports)."""
    notices = list(_IMPORT_NOTICES) + (list(_CPU_BUILD_IMPORT_NOTICES) if _cpu_build() else [])
    for name, prefix, part in notices:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNotice) and (f.prefix, f.part) == (prefix, part) for f in logger.filters):
            logger.addFilter(_DropImportNotice(prefix, part))


def _cpu_build() -> bool:
    """Whether the installed torch has no CUDA, read from `torch/version.py` without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    return re.search(r"^cuda(: Optional\[str\])? = None", text, re.M) is not None


class _DropNotices(logging.Filter):
    """Drops the records of one logger whose message starts with a known prefix."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextmanager
def diffusers_log_level(level: int) -> Iterator[None]:
    """Inside the block diffusers logs only records of `level` or above (`logging.ERROR`, `logging.CRITICAL`);
    for calls whose every notice below it is meant so (each use says why)."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity(level)
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(verbosity)


@contextmanager
def known_notices() -> Iterator[None]:
    """Inside the block, the notices listed in this module's docstring are not shown; others are.

    The warnings filter is process-wide while the block runs (`warnings.catch_warnings`), so use it
    around the single call that raises the notice, on the thread that makes it.
    """
    added: list[tuple[logging.Logger, logging.Filter]] = []
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in _LOG_NOTICES:
        by_logger[name] = (*by_logger.get(name, ()), prefix)
    for name, prefixes in by_logger.items():
        logger, drop = logging.getLogger(name), _DropNotices(prefixes)
        logger.addFilter(drop)
        added.append((logger, drop))
    try:
        with warnings.catch_warnings():
            for category, message in _WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)
