"""`h3train config`: the resolved config with every default filled in, and where each value came from.

Every value key of the schema (`config.leaf_types`), and each constructor kwarg under `model.config`, is
printed as YAML with a trailing comment naming its source:

- `# default`: the schema's default; neither the file nor an override sets the key;
- `# <the config file, as given>`: the YAML file sets it (also to the default's value);
- `# override`: a `key=value` argument sets it (it wins over the file);
- `# derived`: set by neither, but changed at load by another key (`model.gradient_checkpointing: true`
  is the older spelling of `model.activation_checkpointing: full`, `config.load._normalise`).

The sources are read from the layers as given (the file's keys through `yaml.safe_load`, the overrides'
through `config.parse_overrides`) and the values from the loaded `Config`, so nothing here repeats a
rule of `config/load.py`. The printed text is itself a config: loaded again it gives the same `Config`.

`table_cell` writes a value as a markdown table cell for docs/config.md, every key with its default
and meaning, which `config_reference` generates.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ..config import Config, config_layers, leaf_types

DEFAULT = "default"
OVERRIDE = "override"
DERIVED = "derived"
# The one key whose value is a mapping of free-form keys (constructor kwargs); each kwarg is a key here.
FREE_SECTION = "model.config"
# Comments start in this column or, after a longer line, two spaces after it.
_COMMENT_COLUMN = 44
# Wide enough that no value is folded over lines: a comment appended to a line must end it.
_NO_FOLD = 1 << 30


class _Dumper(yaml.SafeDumper):
    """Safe YAML with no anchors (equal lists stay written out) and multi-line text on one line."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Single-quoted or plain text with a line break spans lines; double quotes keep it as `\n`.
    style = '"' if "\n" in value or "\r" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def flow_yaml(value: Any) -> str:
    """`value` as YAML on one line: `10`, `null`, `[0.9, 0.999]`, `'null'` for the text null."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, sort_keys=False, width=_NO_FOLD)
    # A plain scalar document ends with the `...` marker.
    return text.removesuffix("...\n").strip()


def _nested(value: Any) -> bool:
    """Whether `value` is a collection holding a collection (written as a block over several lines)."""
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
    return any(isinstance(item, (Mapping, list)) for item in items)


def _value_lines(name: str, value: Any) -> list[str]:
    """`name: value`, on one line, or `name:` and an indented block for a collection of collections."""
    if not _nested(value):
        return [f"{name}: {flow_yaml(value)}"]
    block = yaml.dump(value, Dumper=_Dumper, default_flow_style=None, sort_keys=False, width=_NO_FOLD)
    return [f"{name}:", *(f"  {line}" for line in block.splitlines())]


def leaf_values(cfg: Config) -> dict[str, Any]:
    """Every value key -> its value as plain YAML data, in schema order; `model.config` by kwarg.

    An empty `model.config` stays one key (`{}`), so that every key of the schema is printed.
    """
    tree = dataclasses.asdict(cfg)
    out: dict[str, Any] = {}
    for key in leaf_types():
        value: Any = tree
        for part in key.split("."):
            value = value[part]
        if key == FREE_SECTION and value:
            out.update({f"{key}.{name}": kwarg for name, kwarg in value.items()})
        else:
            out[key] = value
    return out


def given_keys(layer: Mapping[str, Any], prefix: str = "") -> set[str]:
    """The value keys one config layer (a YAML file's or the overrides' plain tree) sets, dotted."""
    keys = set()
    sections = leaf_types()
    for name, value in layer.items():
        key = f"{prefix}{name}"
        keys.add(key)
        if key == FREE_SECTION and isinstance(value, Mapping):
            keys.update(f"{key}.{kwarg}" for kwarg in value)
        elif key not in sections and isinstance(value, Mapping):
            keys |= given_keys(value, f"{key}.")
    return keys


def sources(cfg: Config, path: str | os.PathLike | None, overrides: Sequence[str]) -> dict[str, str]:
    """Every key of `leaf_values(cfg)` -> where its value came from (see the module docstring).

    `cfg` must be what `load_config(path, overrides)` returned: the layers are read again for their keys.
    """
    file_layer, override_layer = config_layers(path, overrides)
    from_file, from_overrides = given_keys(file_layer), given_keys(override_layer)
    defaults = leaf_values(Config())
    out = {}
    for key, value in leaf_values(cfg).items():
        if key in from_overrides:
            out[key] = OVERRIDE
        elif key in from_file:
            out[key] = str(path)
        elif key in defaults and value == defaults[key]:
            out[key] = DEFAULT
        else:
            out[key] = DERIVED
    return out


def report(cfg: Config, path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> str:
    """The YAML text `h3train config` prints: every key in schema order, each with its source as a comment."""
    where = sources(cfg, path, overrides)
    given = " ".join(str(part) for part in (path, *overrides) if part is not None)
    rows: list[tuple[str, str | None]] = [
        (f"# h3train config {given}".rstrip(), None),
        (f"# every key, resolved; the comment says where its value came from: {DEFAULT}, the file, {OVERRIDE}", None),
    ]
    opened: list[str] = []
    for key, value in leaf_values(cfg).items():
        *sections, name = key.split(".")
        same = 0
        while same < min(len(sections), len(opened)) and sections[same] == opened[same]:
            same += 1
        rows.extend(("  " * depth + sections[depth] + ":", None) for depth in range(same, len(sections)))
        opened = sections
        indent = "  " * len(sections)
        first, *rest = _value_lines(name, value)
        rows.append((indent + first, where[key]))
        rows.extend((indent + line, None) for line in rest)
    return "\n".join(_with_comment(line, comment) for line, comment in rows) + "\n"


def _with_comment(line: str, comment: str | None) -> str:
    if comment is None:
        return line
    return f"{line.ljust(_COMMENT_COLUMN - 2)}  # {comment}"


def table_cell(value: Any) -> str:
    """`value` as a markdown table cell: its one-line YAML as code, `|` escaped so the cell stays whole."""
    return "`" + flow_yaml(value).replace("|", "\\|") + "`"
