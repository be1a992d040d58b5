"""Loading a config: YAML layers over the schema's defaults, `key=value` overrides, one spelling per setting.

Every error is a one-line `ConfigError` naming the key; the loaded config is checked (`values.check_values`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import NEAR, ConfigError, did_you_mean, did_you_mean_each
from .schema import SAMPLE_FIELDS, SAMPLES_KEY, Config, get_key, leaf_types, sample_key
from .values import AUTO_KEYS, auto_choice_error, check_values


def _schema() -> DictConfig:
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    # `model.config` holds free-form constructor kwargs (checked against the model class later).
    OmegaConf.set_struct(schema.model.config, False)
    return schema


_CONVERT = re.compile(r"Value '(?P<value>.*)' of type '\w+' could not be converted to (?P<kind>\w+)")


def _one_line(exc: OmegaConfBaseException) -> str:
    """An OmegaConf error in the user's terms: the key, what it holds, what it takes."""
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0].strip()
    if "Key '" in msg and "not in" in msg:
        return unknown_key(key)
    converted = _CONVERT.search(msg)
    if key and converted:
        kind = converted["kind"].lower()
        article = "an" if kind[0] in "aeiou" else "a"
        return f"config key '{key}' is {converted['value']!r}; it takes {article} {kind}"
    if key in AUTO_KEYS and (bad := re.match(r"Value '(.*)' of type '\w+' is incompatible", msg)):
        return auto_choice_error(key, bad[1])  # `bool | str` refuses a number before the value checks
    if key and (boolean := re.match(r"Value '(.*)' is not a valid bool", msg)):
        return f"config key '{key}' is {boolean[1]!r}; it takes true or false"
    if key and (
        "is not Optional" in msg or msg.startswith(("Incompatible value 'None'", "Value 'None' is incompatible"))
    ):
        return f"config key '{key}' cannot be null; give it a value or leave it out for the default"
    if key:
        return f"invalid value for config key '{key}': {msg}"
    return msg


def _schema_tree() -> dict[str, Any]:
    """The schema as plain containers: a dict is a section, a list a list-valued key, anything else a value."""
    return OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)  # type: ignore[return-value]


def _dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key of `tree`, sections and values, as its full dotted name, in schema order."""
    out = []
    for key, value in tree.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict):
            out += _dotted_keys(value, f"{prefix}{key}.")
    return out


# A key put under the wrong section (`train.lr` for `optim.lr`) is found by its last part alone, so
# that part must be near-identical: a looser match across sections would suggest unrelated keys.
_ELSEWHERE = 0.8


def _last_part(dotted: str) -> str:
    return dotted.rsplit(".", 1)[-1]


def unknown_key(name: str, origin: str = "") -> str:
    """The message for the unknown config key `name` (`origin`: e.g. "in the overrides"), naming the
    nearest valid keys.

    The last part is compared with the keys of the same section (`lora.rnak`: `lora.rank`) and with
    those of other sections (`train.lr`: `optim.lr`), which must match it more closely. Whole dotted
    names are not compared: a long shared section name would make every sibling look near.
    """
    tree = _schema_tree()
    parents = name.split(".")[:-1]
    level: Any = tree
    for part in parents:
        level = level.get(part) if isinstance(level, dict) else None
    prefix = "".join(f"{part}." for part in parents)
    siblings = [f"{prefix}{key}" for key in (level if isinstance(level, dict) else {})]
    elsewhere = [key for key in _dotted_keys(tree) if not key.startswith(prefix) or key.count(".") != len(parents)]
    # The same last part elsewhere (`lr`: `optim.lr`) beats a merely similar sibling (`lora`).
    tries = ((siblings, 1.0), (elsewhere, 1.0), (siblings, NEAR), (elsewhere, _ELSEWHERE))
    hint = next((h for keys, cutoff in tries if (h := did_you_mean(name, keys, cutoff, key=_last_part))), "")
    where = f" {origin}" if origin else ""
    if hint:
        return f"unknown config key '{name}'{where}{hint}: remove it or fix its spelling"
    return f"unknown config key '{name}'{where}: remove it or check the spelling against configs/*.yaml"


def _conform(schema: dict[str, Any], layer: dict[str, Any], prefix: str, origin: str) -> None:
    """Check one layer's shape against the schema before merging, so errors name the key.

    A section given a value, or a value given a section or list, is a `ConfigError`. A scalar for
    a list-valued key is taken as a one-item list (`debug.fault=nan_loss@2`), and an empty section
    (`train:` with nothing under it) as no keys. An unknown key is reported here, where its layer is known.
    """
    for key in list(layer):
        if key not in schema:
            raise ConfigError(unknown_key(f"{prefix}{key}", origin))
        name, want, value = f"{prefix}{key}", schema[key], layer[key]
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation: checked once resolved
        if name in TEXT_OR_LIST_KEYS:
            continue  # checked by its own parser (`dataset_specs`)
        if isinstance(want, dict):
            if value is None:
                layer[key] = {}
            elif not isinstance(value, dict):
                example = (
                    f"{name}.num_layers: 2"
                    if name == "model.config"
                    else next((f"{name}.{k}: {v}" for k, v in want.items() if not isinstance(v, dict)), f"{name}.KEY")
                )
                raise ConfigError(
                    f"config key '{name}' ({origin}) is a section and needs keys under it (e.g. {example}), "
                    f"not {value!r}"
                )
            elif name != "model.config":
                _conform(want, value, f"{name}.", origin)
        elif isinstance(want, list):
            if value is None:
                layer[key] = []
            elif isinstance(value, dict):
                raise ConfigError(f"config key '{name}' ({origin}) takes a list, e.g. {name}=[a, b], not a section")
            elif not isinstance(value, list):
                layer[key] = [value]
        elif isinstance(value, (dict, list)):
            kind = "a section" if isinstance(value, dict) else "a list"
            raise ConfigError(f"config key '{name}' ({origin}) takes a single value, not {kind}")


@functools.cache
def _optional_keys() -> set[str]:
    """Value keys whose default is null: `null` there means "unset"."""
    defaults = Config()
    return {key for key in leaf_types() if get_key(defaults, key) is None}


def parse_overrides(overrides: list[str]) -> DictConfig:
    """`["a.b=1", "c=x"]` -> a config tree; a malformed item names itself.

    The value of a text key (`logging.dir`, `data.path`, `optim.schedule`, ...) is the literal text
    after the first `=`: a ` #`, `1e3` or `on` in a folder name stays as written. A text key whose
    default is null takes `null` to unset it. Every other value is read as YAML (numbers, booleans,
    lists, sections), and the schema then checks its type. A key of `TEXT_OR_LIST_KEYS` is literal
    text unless its value starts with `[` (a list).
    """
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    types_, optional = leaf_types(), _optional_keys()
    tree = OmegaConf.create({})
    try:
        # In the order given, so that a later override of a key wins whichever way each is read.
        for item in overrides:
            key, value = item.split("=", 1)
            key = key.strip()
            if types_.get(key) is str or (key in TEXT_OR_LIST_KEYS and not value.lstrip().startswith("[")):
                OmegaConf.update(tree, key, None if value == "null" and key in optional else value, force_add=True)
            else:
                OmegaConf.update(tree, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key), force_add=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {_one_line(exc)}") from None
    return tree


def _yaml_error(path: str | os.PathLike, exc: Exception) -> ConfigError:
    """A YAML syntax error as `file:line:column: problem`, the way editors and compilers point at it."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}"
        problem = exc.problem or "syntax error"
        context = ""
        if exc.context:
            started = exc.context_mark
            at = f" started at line {started.line + 1}, column {started.column + 1}" if started is not None else ""
            context = f" ({exc.context.strip()}{at})"
        return ConfigError(f"config file '{path}' is not valid YAML: {where}: {problem}{context}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"config file '{path}' is not valid YAML: {first}")


def _read_yaml(path: str | os.PathLike) -> DictConfig:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{path}' is a folder; pass a YAML file such as configs/tiny_fl2va.yaml")
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        # OmegaConf's loader is yaml.SafeLoader-based: no tags, no code execution.
        loaded = OmegaConf.load(p)
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - any YAML error becomes one line
        raise _yaml_error(path, exc) from None
    if not isinstance(loaded, DictConfig):
        kind = "a list" if isinstance(loaded, ListConfig) else f"{type(loaded).__name__}"
        raise ConfigError(
            f"config file '{path}' holds {kind} at the top level; it must be a mapping of sections "
            "(model:, task:, data:, train:, ...) as in configs/tiny_fl2va.yaml"
        )
    return loaded


def config_layers(
    path: str | os.PathLike | None, overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two layers `load_config` merges over the defaults, as plain containers: the file's keys
    (empty without a file) and the overrides', each conformed to the schema, media paths anchored,
    an override of one exclusive key replacing the other from the file."""
    tree = _schema_tree()
    file_raw: dict[str, Any] = {}
    if path is not None:
        file_raw = OmegaConf.to_container(_read_yaml(path), resolve=False)  # type: ignore[assignment]
        _conform(tree, file_raw, "", f"in '{path}'")
        anchor_sample_paths(file_raw, Path(path).resolve().parent, f"in '{path}'")
    raw: dict[str, Any] = OmegaConf.to_container(parse_overrides(list(overrides)), resolve=False)  # type: ignore[assignment]
    _conform(tree, raw, "", "in the overrides")
    anchor_sample_paths(raw, Path.cwd(), "in the overrides")
    _override_replaces_exclusive(file_raw, raw)
    return file_raw, raw


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Load YAML (if given) over the schema defaults, apply overrides, normalise, check values, return a `Config`.

    Checks that read other files or build the model (module names, media paths, the partition) are
    `h3train.run.checks.check`; `h3train.run.preflight.load_checked` runs both.
    """
    schema = _schema()
    layers = [OmegaConf.create(layer) for layer in config_layers(path, overrides)]
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    _normalise(cfg)
    check_values(cfg)
    return cfg


# Pairs of keys a config sets one of: the model's weights come from a folder or from constructor kwargs.
_EXCLUSIVE_KEYS = (("model", "pretrained", "config"),)


def _override_replaces_exclusive(file_raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """An override of one of two exclusive keys drops the other from the file's layer: a tiny config's
    `model.config` gives way to `model.pretrained=DIR` on the command line, and the other way round."""
    for section, first, second in _EXCLUSIVE_KEYS:
        given, in_file = overrides.get(section), file_raw.get(section)
        if not isinstance(given, dict) or not isinstance(in_file, dict):
            continue
        for key, other in ((first, second), (second, first)):
            if given.get(key) not in (None, {}) and other not in given:
                in_file.pop(other, None)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# The words YAML reads as a boolean, for the `AUTO_KEYS` (auto, or a flag) given as text.
_FLAG_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def _normalise(cfg: Config) -> None:
    """One spelling per setting, set once at load: nothing later rewrites the config.

    `model.gradient_checkpointing` is the older spelling of `model.activation_checkpointing: full`:
    true turns `none` or `auto` into `full`, and `full` sets it back to true for readers of the bool. Any other
    pairing is left for `check_values` to refuse.
    """
    if isinstance(cfg.data.path, int) and not isinstance(cfg.data.path, bool):
        cfg.data.path = str(cfg.data.path)  # a folder named by a number, unquoted in YAML
    for section, key in (cfg.model, "compile"), (cfg.parallel, "adaln_tables"):
        value = getattr(section, key)
        if isinstance(value, str) and value.lower() in _FLAG_WORDS:
            # `model.compile=on` (an override's text) or a quoted `"true"` in YAML: the flag, as YAML reads it.
            setattr(section, key, _FLAG_WORDS[value.lower()])
    if cfg.model.gradient_checkpointing and cfg.model.activation_checkpointing in ("none", "auto"):
        cfg.model.activation_checkpointing = "full"
    if cfg.model.activation_checkpointing == "full":
        cfg.model.gradient_checkpointing = True


# Keys that take one text value or a list (`data.path`: a folder, or several datasets).
TEXT_OR_LIST_KEYS = frozenset({"data.path"})


def _absolute(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or value.startswith("${"):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


_REFERENCE_FIELDS = ("kind", "path")


def anchor_sample_paths(layer: dict[str, Any], base: Path, origin: str, key: Callable[..., str] = sample_key) -> None:
    """Shape-check one config layer's `validation.samples` and make its relative media paths absolute.

    Runs on the plain containers of one layer (the YAML file, or the overrides) before they merge, so a
    wrong shape names its item and field (`key(i, field)`: `sample_key`, or a line of a requests file),
    and each path is taken relative to the layer it came from: the config file's folder, or the
    working directory for command-line overrides (`SampleRequestConfig`).
    """
    section = layer.get("validation")
    if not isinstance(section, dict) or section.get("samples") is None:
        return
    samples = section["samples"]
    if isinstance(samples, dict):
        raise ConfigError(f"config key '{SAMPLES_KEY}' ({origin}) takes a list of requests, not a section")
    if not isinstance(samples, list):
        samples = section["samples"] = [samples]
    for i, item in enumerate(samples):
        if not isinstance(item, dict):
            raise ConfigError(
                f"{key(i)} ({origin}) is {item!r}; each request is a mapping such as "
                "{prompt: ..., task: fl2va, keyframes: {first: a.png}, frames: 124, resolution: 1344x768}"
            )
        unknown = sorted(set(item) - set(SAMPLE_FIELDS))
        if unknown:
            raise ConfigError(
                f"{key(i, unknown[0])} ({origin}) is not a request field (fields: {', '.join(SAMPLE_FIELDS)})"
                f"{did_you_mean(str(unknown[0]), SAMPLE_FIELDS)}"
            )
        keyframes = item.get("keyframes")
        if keyframes is not None:
            if not isinstance(keyframes, dict):
                raise ConfigError(
                    f"{key(i, 'keyframes')} ({origin}) is {keyframes!r}; it maps an anchor to an image, "
                    "e.g. {first: stills/a.png, last: stills/b.png}"
                )
            item["keyframes"] = {anchor: _absolute(image, base) for anchor, image in keyframes.items()}
        references = item.get("references")
        if references is not None:
            if not isinstance(references, list):
                references = item["references"] = [references]
            for j, ref in enumerate(references):
                if not isinstance(ref, dict) or set(ref) != set(_REFERENCE_FIELDS):
                    odd = sorted(set(ref) - set(_REFERENCE_FIELDS)) if isinstance(ref, dict) else []
                    raise ConfigError(
                        f"{key(i, f'references[{j}]')} ({origin}) is {ref!r}; expected "
                        "{kind: image | video | audio, path: ...}" + did_you_mean_each(map(str, odd), _REFERENCE_FIELDS)
                    )
                ref["path"] = _absolute(ref["path"], base)
