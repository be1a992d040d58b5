"""docs/config.md is the schema's reference: generated from h3train/config/schema.py, every key with its
current default and a meaning, the choices of each enumerated key."""

from __future__ import annotations

import re

import pytest
import yaml

from h3train.config import Config, choices, get_key, leaf_types
from h3train.tools.config_reference import REGENERATE, builtin_choices, field_comments, missing_meanings, reference

from helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

DOC = ROOT / "docs" / "config.md"


def _rows(text: str) -> dict[str, list[str]]:
    """`| key | type | default | meaning |` rows: key (without backticks) -> the other cells as written."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _value(cell: str):
    return yaml.safe_load(cell.removeprefix("`").removesuffix("`").replace("\\|", "|"))


def test_docs_config_is_the_generated_reference() -> None:
    assert DOC.is_file(), f"docs/config.md is missing; generate it with {REGENERATE}"
    assert DOC.read_text(encoding="utf-8") == reference(), (
        f"docs/config.md disagrees with h3train/config/schema.py; regenerate it with {REGENERATE}"
    )


def test_every_key_appears_with_its_current_default() -> None:
    rows = _rows(DOC.read_text(encoding="utf-8"))
    missing = [key for key in leaf_types() if key not in rows]
    assert not missing, f"docs/config.md lacks {missing}; regenerate it with {REGENERATE}"
    wrong = [
        f"{key}: docs {rows[key][1]}, schema {get_key(Config(), key)!r}"
        for key in leaf_types()
        if _value(rows[key][1]) != get_key(Config(), key)
    ]
    assert not wrong, f"docs/config.md's defaults differ from the schema ({wrong}); regenerate it with {REGENERATE}"
    assert rows["optim.lr"][1] == "`1.0e-05`" and rows["lora.rank"][1] == "`0`"


def test_every_key_has_a_meaning_from_the_comment_above_its_field() -> None:
    assert missing_meanings() == [], "give each of these fields a comment above it in h3train/config/schema.py"
    rows = _rows(DOC.read_text(encoding="utf-8"))
    comments = field_comments()
    assert rows["optim.warmup_steps"][2] == comments[("OptimConfig", "warmup_steps")]
    # A comment over several lines is one cell; a `|` in it does not split the row.
    assert "\\|" in rows["model.activation_checkpointing"][2]
    assert rows["validation.samples[].frames"][2].startswith("Pixel frames at 24 fps")


def test_each_enumerated_key_lists_its_choices() -> None:
    rows = _rows(DOC.read_text(encoding="utf-8"))
    for key, values in builtin_choices().items():
        assert set(values) <= set(choices(key)), key
        assert rows[key][2].endswith("One of " + ", ".join(f"`{v}`" for v in values) + "."), key
