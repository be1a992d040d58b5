"""Where the checkout's files are, for tests in any folder under `tests/`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_FL2VA = ROOT / "configs" / "tiny_fl2va.yaml"
