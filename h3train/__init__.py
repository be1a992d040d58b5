"""h3train: the training application for MiniMax H3."""

from .infra.quiet import drop_import_notices

drop_import_notices()
