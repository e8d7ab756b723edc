"""Reading the JSON bodies of the Tinker HTTP door field by field.

A body that is not a JSON object, a missing required field or a field of the wrong type is an
``InvalidArgument`` whose message names the field by its full path (``sampling_params.top_k``), so every
handler checks its input the same way and none writes error text of its own. ``null`` counts as absent,
as in Tinker's pydantic models, except for a number its SDK type requires (``nullable=False``): the SDK writes
NaN and the infinities as ``null``, so there ``null`` is a non-finite number, refused. Unknown fields are
ignored (newer SDKs add fields). Values must also fit the messages they go into: integers in 64 (or the
given) bits, finite numbers, strings that are UTF-8. A body is parsed only if it holds no more values than
the caller allows, counted before any Python list of them exists.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lathe.errors import InvalidArgument

_REQUIRED: Any = object()
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
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
    def parse(cls, body: bytes, max_values: int) -> Fields:
        """The body's JSON object, if it holds at most ``max_values`` list items and object members, which are at
        most one more than its commas (a comma inside a string counts too, erring on the safe side)."""
        values = body.count(b",") + 1
        if values > max_values:
            raise InvalidArgument(f"the request body holds up to {values} JSON values (one more than its commas), "
                                  f"over the limit of {max_values} (max_request_tokens)")
        try:
            return cls(json.loads(body or b"{}"))
        except ValueError as e:  # not UTF-8, not JSON, or an integer of more digits than Python converts
            raise InvalidArgument(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidArgument("the request body is nested too deeply") from None

    def path(self, name: str) -> str:
        return f"{self._where}.{name}" if self._where else name

    def get(self, name: str, kind: type, default: Any = _REQUIRED, *, int_max: int = INT64_MAX,
            nullable: bool = True) -> Any:
        """The value of ``name``, checked to be a ``kind`` (an int is also a float, a bool is no number,
        ``object`` takes anything); ``default`` when it is absent, which is an error if no default is given.
        An int must lie in ``[-int_max - 1, int_max]`` (``INT32_MAX`` for an int32 field), a float be finite,
        a string be encodable as UTF-8 (JSON can carry lone surrogates; protobuf strings cannot).
        ``nullable=False``: an explicit ``null`` is refused instead of taken as absent (a number the SDK's type
        requires, whose ``null`` is how the SDK writes NaN or an infinity)."""
        value = self._data.get(name)
        if value is None and not nullable and name in self._data:
            raise InvalidArgument(f"{self.path(name)} = null must be a finite number (the tinker SDK sends NaN and "
                                  "infinities as null)")
        if value is None:
            if default is _REQUIRED:
                raise InvalidArgument(f"{self.path(name)} is required")
            return default
        if isinstance(value, bool) and kind in (int, float):
            ok = False
        elif kind is float and isinstance(value, int):
            ok = abs(value) < 2**1023
            value = float(value) if ok else value
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise InvalidArgument(f"{self.path(name)} must be {_TYPE_NAMES[kind]}, got {_show(value)}")
        if kind is int and not -int_max - 1 <= value <= int_max:
            raise InvalidArgument(f"{self.path(name)} = {_show(value)} is out of range [{-int_max - 1}, {int_max}]")
        if kind is float and not math.isfinite(value):
            raise InvalidArgument(f"{self.path(name)} = {value} must be a finite number")
        if kind is str:
            check_text(value, self.path(name))
        return value

    def sub(self, name: str, required: bool = True) -> Fields:
        """The nested object ``name`` (an empty one when it is absent and not required)."""
        return Fields(self.get(name, dict, _REQUIRED if required else {}), self.path(name))

    def strings(self, name: str) -> dict[str, str]:
        """An optional object of metadata; values that are not strings are kept as their JSON text."""
        out = {k: v if isinstance(v, str) else json.dumps(v) for k, v in self.get(name, dict, {}).items()}
        for k, v in out.items():
            check_text(k, f"{self.path(name)} key")
            check_text(v, f"{self.path(name)}[{_show(k)}]")
        return out


def check_text(value: str, where: str) -> None:
    """Refuse a string that is not valid UTF-8 text (a lone surrogate from a JSON escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{where} is not valid UTF-8 text: {e.reason} at position {e.start}") from None


def _show(value: object) -> str:
    """A value for an error message: its JSON text, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
