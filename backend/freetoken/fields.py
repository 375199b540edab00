"""Option fields: one reading of a dataclass field's annotation for every place that fills one from outside.

``EngineConfig``, ``BackendOptions`` and ``SamplingParams`` are dataclasses whose annotations
(``int | None``, ``Literal["auto", "cpu"]``, ``bool``) say what each field takes. The CLI flags,
the config.pbtxt parameters (text) and a request's sampling parameters (JSON) all read an
annotation through ``field_types`` here, so they cannot disagree about a field. Imports nothing
of freetoken (config.py sits above it).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


def option(default: Any, help: str) -> Any:
    """A dataclass field with its help text (shown by ``--help``) beside it."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class FieldType:
    """What an annotation allows: ``float | None`` is ``FieldType(float, optional=True)``."""

    kind: type  # int, float, bool, str or list; object when several are allowed (``str | list[str]``)
    optional: bool = False  # None is a value
    choices: tuple[str, ...] | None = None  # a Literal's values (kind str)


def field_type(annotation: Any) -> FieldType:
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) > 1:
            return FieldType(object, optional)
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return FieldType(str, optional, tuple(typing.get_args(annotation)))
    return FieldType(typing.get_origin(annotation) or annotation, optional)


def field_types(cls: type) -> dict[str, FieldType]:
    """Each field of the dataclass ``cls`` by name, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: field_type(hints[f.name]) for f in dataclasses.fields(cls)}


# ----- command-line flags -----


def add_flags(group: argparse._ActionsContainer, cls: type) -> None:
    """One flag per field of ``cls``: ``max_prefill_length`` -> ``--max-prefill-length``; a bool
    field gets ``--name`` / ``--no-name``."""
    kinds = field_types(cls)
    for f in dataclasses.fields(cls):
        kind = kinds[f.name]
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata["help"]
        if "default" not in help and f.default is not None:  # a help text that says its default keeps it
            help += f" (default: {to_text(f.default)})"
        if kind.kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            group.add_argument(flag, dest=f.name, type=kind.kind, choices=kind.choices, default=f.default, help=help)


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` that the flags ``add_flags(..., cls)`` parsed into ``args`` describe."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# ----- text (config.pbtxt parameters) -----


def parse_text(text: str, kind: FieldType) -> Any:
    """A field's value from its text; ``ValueError("must be ..., got '...'")`` if it is not one."""
    text = text.strip()
    if kind.optional and text.lower() in ("", "none"):
        return None
    if kind.choices is not None:
        if text not in kind.choices:
            raise ValueError(f"must be one of {', '.join(kind.choices)}, got {text!r}")
        return text
    if kind.kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    try:
        return kind.kind(text)
    except ValueError:
        raise ValueError(f"must be {kind.kind.__name__}, got {text!r}") from None


def to_text(value: Any) -> str:
    """The text ``parse_text`` reads back as ``value`` (None is empty, booleans lower case)."""
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)
