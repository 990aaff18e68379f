"""Command-line options from a frozen dataclass: your script's options are one typed object, never a namespace.

``parse_options(Options)`` turns each field into ``--field-name VALUE`` through transformers' ``HfArgumentParser``
(``rlhfkit[hf]``). Each option's help is the field's description: ``metadata["help"]``, else its entry in the
class docstring's Google-style ``Attributes:`` section, else the ``#`` comment on the field's line. Bool fields take
true/false (also yes/no, 1/0); ``X | None`` fields accept ``none``; ``tuple[X, ...]`` and ``list[X]`` fields take
one or more values. A field whose type is a dataclass (e.g. :class:`~rlhfkit.deepspeed_engine.DeepSpeedEngineConfig`)
is one group of options, ``--<field>-<its field>`` (``--deepspeed-zero-stage 2``), built into that dataclass.
``--config run.yaml`` (or ``.json``) reads options from a file (keys are field names, a dataclass field's options a
nested mapping); the command line wins over the file, the file over the defaults. The dataclass's own
``__post_init__`` validates the result.

What it does not do: subcommands, unions other than ``X | None``, or fields of other types (those keep their
defaults and get no option; one without a default is a TypeError).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from rlhfkit._optional import require

__all__ = ["field_descriptions", "parse_options"]

T = TypeVar("T")
_SCALARS = (str, int, float)
_ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*:\s*(.*)$")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The script's docstring as written, and each option's default after its help."""


@dataclasses.dataclass(frozen=True)
class _Option:
    """One command-line option: ``flat`` its name (``deepspeed_zero_stage``), ``group`` the dataclass field it
    belongs to (None at the top level), ``name`` the field's name in its own dataclass."""

    flat: str
    group: str | None
    name: str
    hint: Any
    default: Any
    help: str


def _docstring_descriptions(cls: type) -> dict[str, str]:
    """Field name -> text of the class docstring's ``Attributes:`` section (``a, b: text`` describes both)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return {}
    found: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or (depth == 0 and line.rstrip().endswith(":")):
            break  # the next section
        entry = _ENTRY.match(line.strip()) if depth == indent else None
        if entry:
            names = [name.strip() for name in entry.group(1).split(",")]
            for name in names:
                found[name] = entry.group(2).strip()
        elif names:
            for name in names:
                found[name] = f"{found[name]} {line.strip()}".strip()
    return found


def _comment_descriptions(cls: type) -> dict[str, str]:
    """Field name -> the ``#`` comment on the field's line in the class body (nothing when the source is not
    available, e.g. a class built at run time)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError, SyntaxError):  # no file, or a file that is not Python (a class run from a doc page)
        return {}
    found, depth, line_tokens = {}, 0, []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.INDENT:
            depth += 1
        elif token.type == tokenize.DEDENT:
            depth -= 1
        elif token.type in (tokenize.NEWLINE, tokenize.NL):
            line_tokens = []
        elif token.type == tokenize.COMMENT:
            if depth == 1 and len(line_tokens) >= 2 and line_tokens[0].type == tokenize.NAME \
                    and line_tokens[1].string == ":":
                found[line_tokens[0].string] = token.string.lstrip("#").strip()
        else:
            line_tokens.append(token)
    return found


def field_descriptions(cls: type) -> dict[str, str]:
    """Each init field of the dataclass ``cls`` -> its description (``metadata["help"]``, else the docstring's
    ``Attributes:`` entry, else the comment on its line); fields without one are left out."""
    documented, commented = _docstring_descriptions(cls), _comment_descriptions(cls)
    found = {}
    for field in dataclasses.fields(cls):
        text = field.metadata.get("help") or documented.get(field.name) or commented.get(field.name)
        if field.init and text:
            found[field.name] = text
    return found


def _split_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(base: type, optional: bool) -> Any:
    convert = _parse_bool if base is bool else base

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        return convert(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors: "invalid int value: 'x'"
    return parse


def _shadow_type(option: _Option) -> Any:
    """The type the option has in the dataclass handed to ``HfArgumentParser`` (None: not an option)."""
    base, optional = _split_optional(option.hint)
    if base is bool or (optional and base in _SCALARS):
        return _converter(base, optional)
    if base in _SCALARS or typing.get_origin(base) is typing.Literal:
        return base
    if typing.get_origin(base) in (tuple, list):
        args = typing.get_args(base)
        item = args[0] if args else None
        if item in (*_SCALARS, bool) and (typing.get_origin(base) is list or len(args) == 1 or args[1] is ...):
            return list[_converter(item, False)]
    return None


def _options(cls: type, *, group: str | None = None, defaults: Any = None) -> list[_Option]:
    """The options of the dataclass ``cls``; a dataclass-typed field is a group of its own fields' options."""
    hints, descriptions, options = typing.get_type_hints(cls), field_descriptions(cls), []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if defaults is not None:
            default = getattr(defaults, field.name)
        elif field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        hint = hints[field.name]
        if group is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested = default if default is not dataclasses.MISSING else None
            options.extend(_options(hint, group=field.name, defaults=nested))
            continue
        flat = f"{group}_{field.name}" if group else field.name
        option = _Option(flat=flat, group=group, name=field.name, hint=hint, default=default,
                         help=descriptions.get(field.name, ""))
        if _shadow_type(option) is None:
            if default is dataclasses.MISSING:
                raise TypeError(f"option field '{flat}' of {cls.__name__} has type {hint!r} and no default; "
                                "parse_options supports str, int, float, bool, Literal, tuple/list of those, their "
                                "'| None' forms and dataclasses of them")
            continue  # keeps its default
        options.append(option)
    return options


def _shadow_dataclass(name: str, options: list[_Option], group: str | None) -> type:
    """A plain dataclass of ``options`` for ``HfArgumentParser`` (the option's help in its metadata)."""
    fields = []
    for option in options:
        shadow = _shadow_type(option)
        metadata = {"help": option.help.replace("%", "%%") or "(default: %(default)s)"}
        if option.default is dataclasses.MISSING:
            spec = dataclasses.field(metadata=metadata)
        elif typing.get_origin(shadow) is list:
            spec = dataclasses.field(default_factory=lambda d=option.default: list(d or ()), metadata=metadata)
        else:
            spec = dataclasses.field(default=option.default, metadata=metadata)
        fields.append((option.flat, shadow, spec))
    namespace = {"_argument_group_name": group} if group else {}
    return dataclasses.make_dataclass(name, fields, kw_only=True, namespace=namespace)


def _file_argv(path: str, options: list[_Option]) -> list[str]:
    """The options in the YAML or JSON file at ``path`` as command-line words (they go before the real ones, so
    that the command line wins)."""
    text = Path(path).read_text()
    values = json.loads(text) if path.endswith(".json") else require("yaml", "hf", user="--config").safe_load(text)
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got "
                         f"{type(values).__name__}")
    known = {option.flat: option for option in options}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        key = str(key).replace("-", "_")
        if isinstance(value, dict) and any(option.group == key for option in options):
            flat.update({f"{key}_{str(inner).replace('-', '_')}": item for inner, item in value.items()})
        else:
            flat[key] = value
    unknown = sorted(set(flat) - set(known))
    if unknown:
        raise ValueError(f"--config {path}: unknown option(s) {unknown}; known: {sorted(known)}")
    words = []
    for key, value in flat.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        words += [f"--{key}", *("none" if item is None else str(item).lower() if isinstance(item, bool) else str(item)
                                for item in items)]
    return words


def _build(cls: type, options: list[_Option], parsed: dict[str, Any]) -> Any:
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for option in options:
        value = parsed[option.flat]
        if typing.get_origin(_split_optional(option.hint)[0]) is tuple and value is not None:
            value = tuple(value)
        (groups.setdefault(option.group, {}) if option.group else top)[option.name] = value
    hints = typing.get_type_hints(cls)
    for group, values in groups.items():
        field = next(f for f in dataclasses.fields(cls) if f.name == group)
        if field.default_factory is not dataclasses.MISSING:  # the default instance keeps the fields not parsed
            top[group] = dataclasses.replace(field.default_factory(), **values)
        elif field.default is not dataclasses.MISSING and field.default is not None:
            top[group] = dataclasses.replace(field.default, **values)
        else:
            top[group] = hints[group](**values)
    return cls(**top)


def parse_options(cls: type[T], argv: Sequence[str] | None = None, *, description: str | None = None) -> T:
    """Build ``cls`` (a dataclass) from ``--field-name`` options in ``argv`` (default: ``sys.argv[1:]``), after
    those of ``--config FILE`` when given; ``description`` heads ``--help``."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"parse_options needs a dataclass type, got {cls!r}")
    transformers = require("transformers", user="rlhfkit.options")
    argv = list(sys.argv[1:] if argv is None else argv)
    options = _options(cls)
    if any(option.flat == "config" for option in options):
        raise TypeError(f"{cls.__name__} has a field named 'config'; parse_options uses --config for option files")
    flats = [option.flat for option in options]
    if len(set(flats)) != len(flats):
        raise TypeError(f"{cls.__name__}: two options share a name in {sorted(flats)}; rename a field")
    shadows = [_shadow_dataclass(cls.__name__, [o for o in options if o.group is None], None)]
    for group in dict.fromkeys(o.group for o in options if o.group):
        shadows.append(_shadow_dataclass(f"{cls.__name__}_{group}", [o for o in options if o.group == group],
                                         f"{group} options"))
    parser = transformers.HfArgumentParser(shadows, description=description, formatter_class=_Formatter)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML or JSON file of options (field names as keys); the command line wins over it")
    finder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    finder.add_argument("--config", default=None)
    config_path = finder.parse_known_args(argv)[0].config
    words = _file_argv(config_path, options) if config_path else []
    parsed = vars(parser.parse_args(words + argv))
    return _build(cls, options, parsed)
