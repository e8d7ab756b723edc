"""``tinker://<run_id>/<kind>/<name>``: the public address of a checkpoint.

Tinker's SDK splits the part after the scheme on ``/`` and wants exactly three parts, so neither the
run id nor the name may contain ``/``. Run ids are model ids such as ``sess-1f2e:train:0`` (``:`` is
fine). Every part also becomes a segment of an object-store key and appears raw in REST URLs, so the
charset is kept small: letters, digits and ``._-`` (plus ``:`` in run ids), starting with a letter or
digit (which also rules out ``.`` and ``..``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lathe.errors import InvalidArgument
from lathe.types import RECOVERY_KIND

SCHEME = "tinker://"
LISTED_KINDS = ("weights", "sampler_weights", "external_weights")  # external: PEFT files for download
KINDS = (*LISTED_KINDS, RECOVERY_KIND)  # recovery: the trainer's own snapshots of a run, never listed

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_RUN_ID_LEN = 200
MAX_NAME_LEN = 128


def check_part(field: str, value: str, *, run_id: bool = False) -> None:
    """Raise ``InvalidArgument`` naming ``field`` unless ``value`` is a valid run id (or name / file name)."""
    pattern, limit, allowed = (_RUN_ID, MAX_RUN_ID_LEN, "._:-") if run_id else (_NAME, MAX_NAME_LEN, "._-")
    if not value:
        raise InvalidArgument(f"{field} is empty")
    if len(value) > limit:
        raise InvalidArgument(f"{field} {value[:32]!r}... is {len(value)} characters long; the limit is {limit}")
    if not pattern.fullmatch(value):
        raise InvalidArgument(f"{field} {value!r} may contain only letters, digits and {allowed!r}, "
                              "and must start with a letter or digit")


def check_kind(kind: str) -> None:
    """Raise ``InvalidArgument`` unless ``kind`` is one of ``KINDS``."""
    if kind not in KINDS:
        raise InvalidArgument(f"kind {kind!r} must be one of {', '.join(map(repr, KINDS))}")


@dataclass(frozen=True, slots=True)
class CheckpointPath:
    """A validated checkpoint address; ``str()`` formats it as ``tinker://<run_id>/<kind>/<name>``."""

    run_id: str
    kind: str
    name: str

    def __post_init__(self) -> None:
        check_part("run_id", self.run_id, run_id=True)
        check_kind(self.kind)
        check_part("name", self.name)

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> CheckpointPath:
        """Parse ``tinker://<run_id>/<kind>/<name>``; errors name the path and the bad part."""
        if not path.startswith(SCHEME):
            raise InvalidArgument(f"checkpoint path {path!r} must start with {SCHEME!r}")
        parts = path[len(SCHEME):].split("/")
        if len(parts) != 3:
            raise InvalidArgument(f"checkpoint path {path!r} must be {SCHEME}<run_id>/<kind>/<name>: "
                                  f"exactly 3 '/'-separated parts after the scheme, got {len(parts)}")
        try:
            return cls(*parts)
        except InvalidArgument as e:
            raise InvalidArgument(f"checkpoint path {path!r}: {e.message}") from None
