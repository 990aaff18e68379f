"""Command-line options from a frozen dataclass: your script's options are one typed object, never a namespace.

``parse_options(Options)`` turns each field into ``--field-name VALUE`` (bool fields take true/false, ``X | None``
fields accept ``none``), with the field's default and its ``metadata["help"]``. What it does not do: subcommands,
config files, or anything beyond flat fields of str, int, float and bool.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["parse_options"]

T = TypeVar("T")
_SCALARS = (str, int, float, bool)


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(name: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((arg for arg in args if arg is not type(None)), hint) if args else hint
    if base not in _SCALARS:
        raise TypeError(f"option field '{name}' has type {hint!r}; parse_options supports str, int, float, bool "
                        "and their '| None' forms")
    convert = _parse_bool if base is bool else base

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        return convert(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def parse_options(cls: type[T], argv: Sequence[str] | None = None, *, description: str | None = None) -> T:
    """Build ``cls`` (a dataclass) from ``--field-name`` flags in ``argv`` (default: ``sys.argv[1:]``); the
    dataclass's own ``__post_init__`` validates the result."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"parse_options needs a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=_converter(field.name, hints[field.name]), default=default,
                            required=field.default is dataclasses.MISSING and field.default_factory is
                            dataclasses.MISSING, help=f"{field.metadata.get('help', '')} (default: {default})")
    return cls(**vars(parser.parse_args(argv)))
