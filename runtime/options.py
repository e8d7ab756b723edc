"""A service's command-line flags generated from its config dataclass, so each option is spelled once: its name,
type and default in the field, its help in the field's docstring (the string right under it).

    add_options(parser, Config)   one flag per field: ``--field-name`` typed from the annotation (int, float, str,
                                  Path; a ``Literal`` gives choices), the dataclass's default; a bool defaulting
                                  to False is ``--field-name``, one defaulting to True is ``--no-field-name``
    options(args, Config)         the config from the parsed flags (a ``ValueError`` of its checks names the value)

A field's ``metadata`` may say ``flag`` (another spelling, kept where one is already in use), ``choices``,
``required``, ``default`` (a command-line default other than the dataclass's, or a function that gives it: the
pools' ``--dtype auto``, the gateway's ``--db`` from the environment), ``cli=False`` (not a flag: the caller sets
it) or, for a field that is itself a config dataclass, ``flags``: which of its fields get a flag and their
spellings (the trainer's ``--snapshot-every`` is ``snapshots.every_steps``; a spelling may come with a note for
its help, as ``(flag, note)``; "all", the default: every one, as that config spells it), and ``defaults`` by field
name.
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
        return f.metadata["default"]() if callable(f.metadata["default"]) else f.metadata["default"]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _shown(f: dataclasses.Field) -> bool:
    return not callable(f.metadata.get("default"))


@dataclasses.dataclass(frozen=True)
class _Flag:
    dest: str  # the field's name, or "<field>.<its field>" for a field of a nested config
    flag: str
    kind: Any
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    required: bool = False
    shown: bool = True  # the default in the help (not one a function gave: it may come from the environment)


def _own_flags(cls: type) -> list[_Flag]:
    """The flags of the scalar fields of ``cls`` (none for a nested config: ``_flags`` expands those)."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    return [_Flag(f.name, f.metadata.get("flag", "--" + f.name.replace("_", "-")), hints[f.name], _default(f),
                  docs.get(f.name, ""), f.metadata.get("choices"), f.metadata.get("required", False), _shown(f))
            for f in dataclasses.fields(cls)
            if f.metadata.get("cli", True) and not dataclasses.is_dataclass(hints[f.name])]


def _flags(cls: type) -> list[_Flag]:
    """Every flag of ``cls``: its scalar fields', then those of each nested config field that its ``flags``
    metadata names ("all", the default: every one, spelled as in the nested config; or a mapping of field name
    to spelling), with the defaults of its instance in ``cls`` (or its ``defaults`` metadata)."""
    hints, own, out = get_type_hints(cls), {g.dest: g for g in _own_flags(cls)}, []
    for f in dataclasses.fields(cls):
        if f.name in own:
            out.append(own[f.name])
        if f.name in own or not f.metadata.get("cli", True):
            continue
        chosen, instance, defaults = f.metadata.get("flags", "all"), _default(f), f.metadata.get("defaults", {})
        for sub in _own_flags(hints[f.name]):
            if chosen != "all" and sub.dest not in chosen:
                continue
            given = defaults.get(sub.dest, getattr(instance, sub.dest))
            flag, note = (sub.flag, "") if chosen == "all" else (chosen[sub.dest], "")
            if isinstance(flag, tuple):
                flag, note = flag
            out.append(dataclasses.replace(sub, dest=f"{f.name}.{sub.dest}", flag=flag,
                                           doc=f"{sub.doc} ({note})" if note else sub.doc,
                                           default=given() if callable(given) else given,
                                           shown=sub.shown and not callable(given)))
    return out


def _add(parser: argparse.ArgumentParser, g: _Flag) -> None:
    help_ = g.doc.replace("%", "%%") or None
    if g.kind is bool:
        if g.default:
            negated = g.flag if g.flag.startswith("--no-") else "--no-" + g.flag[2:]
            parser.add_argument(negated, dest=g.dest, action="store_false", help=help_ and f"turns off: {help_}")
        else:
            parser.add_argument(g.flag, dest=g.dest, action="store_true", help=help_)
        parser.set_defaults(**{g.dest: g.default})
    elif get_origin(g.kind) is Literal or g.kind in SCALARS:
        if g.shown and g.default not in ("", None) and not g.required:
            help_ = f"{help_ or ''} (default {str(g.default).replace('%', '%%')})".lstrip()
        kw = {"required": True} if g.required else {"default": g.default}
        choices = get_args(g.kind) if get_origin(g.kind) is Literal else g.choices
        parser.add_argument(g.flag, dest=g.dest, type=str if choices else g.kind, choices=choices, help=help_,
                            metavar=None if choices else g.flag.lstrip("-").replace("-", "_").upper(), **kw)
    else:
        raise TypeError(f"{g.dest}: a {g.kind} field gets no flag; give it metadata cli=False")


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of config dataclass ``cls`` (see the module docstring)."""
    for g in _flags(cls):
        _add(parser, g)


def options(args: argparse.Namespace, cls: type, parser: argparse.ArgumentParser | None = None, **fixed: Any) -> Any:
    """``cls`` from the flags ``add_options`` added (and ``fixed``, for the fields without one). A value its checks
    refuse (their ``ValueError`` names it) ends the program as ``parser``'s usage error (exit 2) when given."""
    values, nested = dict(fixed), {}
    for g in _flags(cls):
        name, _, sub = g.dest.partition(".")
        if name in fixed:
            continue
        if sub:
            nested.setdefault(name, {})[sub] = getattr(args, g.dest)
        else:
            values[name] = getattr(args, g.dest)
    try:
        for f in dataclasses.fields(cls):
            if f.name in nested:
                values[f.name] = dataclasses.replace(_default(f), **nested[f.name])
        return cls(**values)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))
