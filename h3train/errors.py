"""Every error h3train reports to a user, by what it is about.

Each message is one line naming the key, file or sample and what to do. The CLI prints it as
`h3train: error: <message>` and exits with the class's `exit_code`: 2 for anything the user can fix
before a run (bad config, usage, data), 1 for a run that could not go on. This module imports
nothing from h3train, so any module may raise these without an import cycle.
"""

from __future__ import annotations


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
