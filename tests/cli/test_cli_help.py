"""`h3train COMMAND --help`: every option's default said once, in words that read."""

from __future__ import annotations

import argparse
import re

import pytest

from h3train.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", list(_commands()))
def test_every_default_is_said_once(command: str) -> None:
    parser = _commands()[command]
    text = parser.format_help()
    # A default that is no value (an option not given, an unset flag, no text) says nothing.
    assert not re.search(r"\(default: (None|False|True|)\)", text), text
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help:
            said = formatter._expand_help(action)
            assert said.lower().count("default") <= 1, said


def test_options_say_their_defaults() -> None:
    commands = {name: " ".join(parser.format_help().split()) for name, parser in _commands().items()}
    encode = commands["encode"]
    assert "--heldout HELDOUT clips held out into the dataset OUT/heldout (seeded by id) (default: 0)" in encode
    # Geometry flags left out take the components folder's preset first, then the released settings.
    assert "canvas short edge, a multiple of 32 (default: the preset of --components, else 768)" in encode
    assert "(else" not in encode
    assert "--num-samples NUM_SAMPLES samples to write (default: 16)" in commands["synth"]
    assert "dtype of the written weights (default: float32)" in commands["export"]
    assert "(default: auto)" in commands["bench"]
