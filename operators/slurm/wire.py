"""One JSON encoding for the frozen dataclasses that cross a process boundary (a trigger's
event, a task's XCom, a job's accounting record): ``to_json`` gives plain JSON values,
``from_json`` reads them back by the fields' declared types. Pure.

Airflow stores trigger events and XComs as JSON, so what these give must stay plain: str,
numbers, None, lists and dicts. A datetime travels as its ISO text; a nested message as its
own ``to_json``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar, TypeVar

M = TypeVar("M", bound="JsonMessage")


class _Absent:
    """A field's value when the message leaves its key out, to tell "not there" from None."""

    _instance: ClassVar[_Absent | None] = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


def _encode(value: Any) -> Any:
    if isinstance(value, JsonMessage):
        return value.to_json()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (a field's resolved type) where that type needs it."""
    if value is None:
        return None
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
        for arg in args:
            if arg is not type(None):
                return _decode(arg, value)
    if isinstance(kind, type) and issubclass(kind, JsonMessage):
        return kind.from_json(value)
    if kind is datetime:
        return datetime.fromisoformat(value)
    if typing.get_origin(kind) is tuple:
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[Message, ...]
            return tuple(_decode(args[0], v) for v in value)
        return tuple(value)
    return value


class JsonMessage:
    """Base of a frozen dataclass sent as JSON. ``json_omit``: fields kept out of the JSON (read
    back as their defaults), ``json_omit_empty``: kept out while empty; a field whose value is
    :data:`ABSENT` is left out."""

    json_omit: ClassVar[frozenset[str]] = frozenset()
    # Fields left out while empty: added later, so that payloads without them keep their keys.
    json_omit_empty: ClassVar[frozenset[str]] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in self.json_omit and getattr(self, f.name) is not ABSENT
                and not (f.name in self.json_omit_empty and not getattr(self, f.name))}

    @classmethod
    def from_json(cls: type[M], data: Mapping[str, Any]) -> M:
        """The message back from :meth:`to_json`'s dict; keys it does not know are ignored
        (a payload written by an older or newer version of this package)."""
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: _decode(hints[name], value) for name, value in data.items()
                      if name in known})
