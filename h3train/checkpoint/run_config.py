"""The run's resolved configuration beside its metrics: `<logging.dir>/config.yaml`."""

from __future__ import annotations

import os
from pathlib import Path

from ..infra.atomic import atomic_write_text

CONFIG_FILE = "config.yaml"


def write_resolved_config(log_dir: str | os.PathLike[str], yaml_text: str) -> Path:
    """Write the fully resolved run configuration to `<log_dir>/config.yaml` atomically; return its path.

    An earlier attempt's `config.yaml` that differs (a resume with changed overrides) is kept as
    `config.yaml.previous-<n>` (n = 1, 2, ... in order), so every attempt's configuration survives.
    """
    path = Path(log_dir) / CONFIG_FILE
    if path.is_file() and path.read_text(encoding="utf-8") != yaml_text:
        n = 1
        while os.path.lexists(path.with_name(f"{CONFIG_FILE}.previous-{n}")):
            n += 1
        os.replace(path, path.with_name(f"{CONFIG_FILE}.previous-{n}"))
    atomic_write_text(path, yaml_text)
    return path
