"""`checkpoint.export`: a LoRA run's adapter files beside each checkpoint it saves.

The checkpointer calls `AdapterFiles` on rank 0 with each checkpoint once it is committed (for a
background save, on its writer thread), and `export/adapter.write_save_files` writes the
files into the step folder's `lora/`. A checkpoint whose files cannot be written stays as it is: the
run goes on and says so in one line, since `h3train export` can write them from it at any time.
"""

from __future__ import annotations

import shlex
import sys
import threading
from pathlib import Path

from ..export.adapter_formats import write_save_files


class AdapterFiles:
    """Writes the files of `checkpoint.export=setting` (not `none`) into each committed checkpoint."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self._lock = threading.Lock()
        self._newest: list[Path] = []

    @property
    def newest(self) -> list[Path]:
        """The files written for the newest checkpoint so far (empty before the first)."""
        with self._lock:
            return list(self._newest)

    def __call__(self, checkpoint: Path) -> None:
        try:
            files = write_save_files(checkpoint, self.setting)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; a side file never fails the run
            print(
                f"h3train: checkpoint {checkpoint} is saved without its adapter files ({exc}); "
                f"write them with: h3train export {shlex.quote(str(checkpoint))} --out DIR",
                file=sys.stderr,
                flush=True,
            )
            return
        with self._lock:
            self._newest = files
