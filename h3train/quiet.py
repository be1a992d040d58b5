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
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# (logger name, message prefix) of the logging records dropped inside the block.
_LOG_NOTICES = (("diffusers.models.modeling_utils", "Attention backends are an experimental feature"),)
# (category, message regex) of the warnings dropped inside the block.
_WARNINGS = ((FutureWarning, r"`torch\.nn\.utils\.weight_norm` is deprecated"),)


class _DropNotices(logging.Filter):
    """Drops the records of one logger whose message starts with a known prefix."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


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
