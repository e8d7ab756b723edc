"""Reading the JSON bodies of the Tinker HTTP door field by field.

A body that is not a JSON object, a missing required field or a field of the wrong type is an
``InvalidArgument`` whose message names the field by its full path (``sampling_params.top_k``), so every
handler checks its input the same way and none writes error text of its own. ``null`` counts as absent,
as in Tinker's pydantic models; unknown fields are ignored (newer SDKs add fields).
"""

from __future__ import annotations

import json
from typing import Any

from lathe.errors import InvalidArgument

_REQUIRED: Any = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "a list"}


class Fields:
    """One JSON object of a request; ``where`` is its path inside the body ("" for the body itself)."""

    def __init__(self, data: object, where: str = "") -> None:
        if not isinstance(data, dict):
            raise InvalidArgument(f"{where or 'the request body'} must be a JSON object, got {type(data).__name__}")
        self._data = data
        self._where = where

    @classmethod
    def parse(cls, body: bytes) -> Fields:
        try:
            return cls(json.loads(body or b"{}"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidArgument(f"the request body is not valid JSON: {e}") from None

    def path(self, name: str) -> str:
        return f"{self._where}.{name}" if self._where else name

    def get(self, name: str, kind: type, default: Any = _REQUIRED) -> Any:
        """The value of ``name``, checked to be a ``kind`` (an int is also a float, a bool is no number,
        ``object`` takes anything); ``default`` when it is absent, which is an error if no default is given."""
        value = self._data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise InvalidArgument(f"{self.path(name)} is required")
            return default
        if isinstance(value, bool) and kind in (int, float):
            ok = False
        elif kind is float and isinstance(value, int):
            value, ok = float(value), True
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise InvalidArgument(f"{self.path(name)} must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:80]}")
        return value

    def sub(self, name: str, required: bool = True) -> Fields:
        """The nested object ``name`` (an empty one when it is absent and not required)."""
        return Fields(self.get(name, dict, _REQUIRED if required else {}), self.path(name))

    def strings(self, name: str) -> dict[str, str]:
        """An optional object of metadata; values that are not strings are kept as their JSON text."""
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in self.get(name, dict, {}).items()}
