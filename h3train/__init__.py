"""h3train: the training application for MiniMax H3."""

from .quiet import drop_import_notices

drop_import_notices()
