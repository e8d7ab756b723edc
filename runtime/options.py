"""A service's command-line flags generated from its config dataclass, so each option is spelled once: its name,
type and default in the field, its help in the field's docstring (the string right under it).

    add_options(parser, Config)   one flag per field: ``--field-name`` typed from the annotation (int, float, str,
                                  Path; a ``Literal`` gives choices), the dataclass's default; a bool defaulting
                                  to False is ``--field-name``, one defaulting to True is ``--no-field-name``
    options(args, Config)         the config from the parsed flags (a ``ValueError`` of its checks names the value)

A field's ``metadata`` may say ``flag`` (another spelling, kept where one is already in use), ``choices``,
``default`` (a command-line default other than the dataclass's: the pools' ``--dtype auto``), ``cli=False`` (not a flag:
the caller sets it) or, for a field that is itself a config dataclass, ``flags``: which of its fields get a
flag, and their spellings (the trainer's ``--snapshot-every`` is ``snapshots.every_steps``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

SCALARS = (int, float, str, Path)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under its line in the body of ``cls`` or of the dataclass
    it extends), joined into one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if "default" in f.metadata:
        return f.metadata["default"]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add(parser: argparse.ArgumentParser, dest: str, flag: str, kind: Any, default: Any, doc: str,
         choices: tuple[Any, ...] | None = None) -> None:
    help_ = doc.replace("%", "%%") or None
    if kind is bool:
        if default:
            negated = flag if flag.startswith("--no-") else "--no-" + flag[2:]
            parser.add_argument(negated, dest=dest, action="store_false", help=help_ and f"turns off: {help_}")
        else:
            parser.add_argument(flag, dest=dest, action="store_true", help=help_)
        parser.set_defaults(**{dest: default})
    elif get_origin(kind) is Literal:
        parser.add_argument(flag, dest=dest, choices=get_args(kind), default=default, help=help_)
    elif kind in SCALARS:
        parser.add_argument(flag, dest=dest, type=kind, default=default, choices=choices, help=help_)
    else:
        raise TypeError(f"{dest}: a {kind} field gets no flag; give it metadata cli=False")


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of config dataclass ``cls`` (see the module docstring)."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            sub_hints, sub_docs, defaults = get_type_hints(hints[f.name]), field_docs(hints[f.name]), _default(f)
            for name, flag in f.metadata["flags"].items():
                _add(parser, f"{f.name}.{name}", flag, sub_hints[name], getattr(defaults, name), sub_docs.get(name, ""))
            continue
        _add(parser, f.name, f.metadata.get("flag", _flag(f.name)), hints[f.name], _default(f), docs.get(f.name, ""),
             f.metadata.get("choices"))


def options(args: argparse.Namespace, cls: type, **fixed: Any) -> Any:
    """``cls`` from the flags ``add_options`` added (and ``fixed``, for the fields without one)."""
    hints, values = get_type_hints(cls), dict(fixed)
    for f in dataclasses.fields(cls):
        if f.name in values or not f.metadata.get("cli", True):
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            picked = {name: getattr(args, f"{f.name}.{name}") for name in f.metadata["flags"]}
            values[f.name] = dataclasses.replace(_default(f), **picked)
        else:
            values[f.name] = getattr(args, f.name)
    return cls(**values)
