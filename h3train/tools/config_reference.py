"""docs/config.md: every config key with its type, default and meaning, generated from the schema.

The meaning of a key is the comment above its field in `h3train/config/schema.py` (the schema stays
plain dataclasses; comments there are read from the source with `ast`), a section's text is its class
docstring, and the choices of an enumerated key are the schema's own `_CHOICES` table as written there
(the built-in values: a kind registered at run time by an extension table is not a documented one).
Defaults are the values of `Config()`, written as `h3train config` writes them.

    python -m h3train.tools.config_reference --out docs/config.md    # regenerate
    python -m h3train.tools.config_reference                         # print it

`tests/cli/test_config_reference.py` fails when docs/config.md and the schema disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

from ..config import Config, leaf_types
from ..config import schema as schema_module
from ..config.schema import SAMPLES_KEY, SampleRequestConfig
from .config_report import leaf_values, table_cell

REGENERATE = "python -m h3train.tools.config_reference --out docs/config.md"
_CHOICES_NAME = "_CHOICES"

_INTRO = f"""# Config reference

<!-- Generated from h3train/config/schema.py by `{REGENERATE}`; edit the schema's comments, not this file. -->

A run's config is YAML over the typed schema of `h3train/config/schema.py`, overridden by `key=value`
arguments (`h3train train CONFIG optim.lr=1e-4`). Every key below has the default shown; a YAML file
sets only what differs. `h3train config CONFIG [key=value ...]` prints the config a run would use,
every key with the source of its value. How the sections fit together is in
[training.md](training.md); each section links the page that explains it.
"""

# The page that explains each section (relative to docs/).
_SECTION_PAGES = {
    "model": "memory.md",
    "task": "training.md#mixed-tasks-and-h3s-two-partitions",
    "data": "encoding.md",
    "parallel": "memory.md",
    "train": "training.md",
    "optim": "memory.md#optimizer-states",
    "cfg": "validation.md#cfg-calibrated-target",
    "checkpoint": "checkpoints.md",
    "logging": "metrics.md",
    "debug": "metrics.md#profiling",
    "lora": "lora.md",
    "validation": "validation.md",
}


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One row of the reference: a dotted key, its type and default as written, and its meaning."""

    key: str
    type: str
    default: str
    meaning: str


def _schema_tree() -> ast.Module:
    return ast.parse(inspect.getsource(schema_module))


def _comment_above(lines: list[str], lineno: int) -> str:
    """The `#` comment lines directly above line `lineno` (1-based), joined into one paragraph."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.insert(0, lines[i].strip().removeprefix("#").strip())
        i -= 1
    return " ".join(part for part in out if part)


def field_comments() -> dict[tuple[str, str], str]:
    """(schema class name, field name) -> the comment above that field in schema.py ('' when none)."""
    source = inspect.getsource(schema_module)
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out[(node.name, item.target.id)] = _comment_above(lines, item.lineno)
    return out


def class_docs() -> dict[str, str]:
    """Schema class name -> its docstring as one paragraph per blank-line-separated block."""
    out = {}
    for node in _schema_tree().body:
        if isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node) or ""
            out[node.name] = "\n\n".join(" ".join(block.split()) for block in doc.split("\n\n") if block.strip())
    return out


def builtin_choices() -> dict[str, tuple[str, ...]]:
    """The schema's `_CHOICES` table as schema.py writes it (not as extension tables have grown it)."""
    for node in _schema_tree().body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == _CHOICES_NAME:
            return ast.literal_eval(node.value)
    raise LookupError(f"h3train/config/schema.py has no {_CHOICES_NAME} table")


def _type_name(hint: Any) -> str:
    """`int`, `list[float]`, `dict[str, Any]`, `list[SampleRequestConfig]`: no module prefixes."""
    name = hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint)
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", name)


def _fields(cls: type, prefix: str) -> Iterator[tuple[str, type, dataclasses.Field]]:
    """(dotted key, owning class, field) of every value key under `cls`, in schema order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nested = [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
        if nested and f"{prefix}{f.name}" not in leaf_types():
            yield from _fields(nested[0], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f


def _cell(text: str) -> str:
    """Text as one markdown table cell: a `|` escaped, so the row keeps its columns."""
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def _meaning(comment: str, choices: tuple[str, ...] | None) -> str:
    if choices:
        listed = ", ".join(f"`{c}`" for c in choices)
        comment = f"{comment} One of {listed}." if comment else f"One of {listed}."
    return comment


def key_docs() -> list[KeyDoc]:
    """Every value key of the schema, in schema order (`config.leaf_types`), with its documentation."""
    comments, choices = field_comments(), builtin_choices()
    defaults, types_ = leaf_values(Config()), leaf_types()
    rows = []
    for key, cls, f in _fields(Config, ""):
        meaning = _meaning(comments.get((cls.__name__, f.name), ""), choices.get(key))
        rows.append(KeyDoc(key, _type_name(types_[key]), table_cell(defaults[key]), meaning))
    return rows


def sample_docs() -> list[KeyDoc]:
    """The fields of one `validation.samples` request, as `validation.samples[].<field>` rows."""
    comments, default = field_comments(), SampleRequestConfig()
    hints = typing.get_type_hints(SampleRequestConfig)
    return [
        KeyDoc(
            f"{SAMPLES_KEY}[].{f.name}",
            _type_name(hints[f.name]),
            table_cell(getattr(default, f.name)),
            comments.get((SampleRequestConfig.__name__, f.name), ""),
        )
        for f in dataclasses.fields(SampleRequestConfig)
    ]


def missing_meanings() -> list[str]:
    """Keys (and request fields) whose schema field has no comment above it."""
    comments = field_comments()
    keys = [(key, cls, f) for key, cls, f in _fields(Config, "")]
    keys += [(f"{SAMPLES_KEY}[].{f.name}", SampleRequestConfig, f) for f in dataclasses.fields(SampleRequestConfig)]
    return [key for key, cls, f in keys if not comments.get((cls.__name__, f.name))]


def _table(rows: list[KeyDoc]) -> list[str]:
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    out.extend(f"| `{r.key}` | `{_cell(r.type)}` | {r.default} | {_cell(r.meaning)} |" for r in rows)
    return out


def _section_classes() -> dict[str, type]:
    """Dotted section name (`train`, `train.timestep`) -> its dataclass, in schema order."""
    out: dict[str, type] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                out[f"{prefix}{f.name}"] = hints[f.name]
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(Config, "")
    return out


def reference() -> str:
    """The text of docs/config.md."""
    missing = missing_meanings()
    if missing:
        raise ValueError(f"config keys without a comment in h3train/config/schema.py: {', '.join(missing)}")
    docs, sections, rows = class_docs(), _section_classes(), key_docs()
    lines = [_INTRO]
    for top in (name for name in sections if "." not in name):
        lines.append(f"## {top}\n")
        for name, cls in sections.items():
            if (name == top or name.startswith(f"{top}.")) and docs[cls.__name__]:
                lead = "" if name == top else f"`{name}`: "
                lines.append(f"{lead}{docs[cls.__name__]}\n")
        page = _SECTION_PAGES.get(top)
        if page:
            lines.append(f"Explained in [{page.split('#')[0]}]({page}).\n")
        lines.extend(_table([r for r in rows if r.key.split(".")[0] == top]))
        if top == SAMPLES_KEY.split(".")[0]:
            lines.append(f"\nEach item of `{SAMPLES_KEY}`: {docs[SampleRequestConfig.__name__]}\n")
            lines.extend(_table(sample_docs()))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    from ..infra.atomic import atomic_write_text

    parser = argparse.ArgumentParser(
        prog="python -m h3train.tools.config_reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", help="write the reference to this file (e.g. docs/config.md) instead of stdout")
    args = parser.parse_args(argv)
    text = reference()
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
