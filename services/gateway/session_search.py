"""Searching a tenant's sessions (Tinker's ``POST /sessions/search``): the query, what matches it, and the pages.

In: a ``SessionQuery`` read from the request (``from_fields``) and a ``Page`` source, the store's sessions of one
tenant in search order (newest first, then by id) strictly after a cursor. Out: at most ``limit`` matching
sessions and the cursor of the last one when more may follow. Owns no state: the cursor is the client's (the
last session it was shown, whose own record gives its place, so no time goes through text and back), and any
gateway answers the next page. One page reads at most ``MAX_SCANNED`` sessions (the store is read inline on the
event loop): a page that stops there holds the matches found so far, and its cursor is the last session read, so
the next page goes on from it.

Both doors build the query with ``SessionQuery.build`` (the HTTP door through ``from_fields``).

Lathe's reading of Tinker's filters: a tenant is the only owner there is, so ``owner`` "own" and "accessible"
both mean the caller's sessions and "user" matches when the caller's tenant is among ``owner_urns``; Lathe has
no projects (``project_ids`` is refused, naming them). ``session_id`` and ``display_name`` are ORed, as Tinker
does: a session matches with its id or with exactly that display name. Statuses: ``active`` (not finished)
and ``client_finished`` (finished by its client, with the reasons asked for); no session of Lathe's is
``failed`` or ``cancelled``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lathe.errors import InvalidArgument
from lathe.registry_types import FINISH_STATUSES
from lathe.types import check_no_project

from .json_fields import Fields
from .records import Session

FINISH_REASONS = FINISH_STATUSES  # Tinker's client finish reasons (the SDK's ServiceClient.close sends them)
MAX_LIMIT = 200
BATCH = 256  # sessions read from the store at a time while filtering
MAX_SCANNED = 16 * BATCH  # sessions read for one page at most

Cursor = tuple[float, str]  # (created_at, session_id) of the last session shown
Page = Callable[[Cursor | None, int], list[Session]]  # the tenant's sessions after a cursor, in search order
StatusFilter = tuple[str, list[str] | None]  # a status type and, for "client_finished", the reasons asked for


@dataclass(frozen=True, slots=True)
class SessionQuery:
    session_id: str | None
    display_name: str | None
    user_metadata: dict[str, str]
    active: bool  # match sessions still open
    finished: frozenset[str]  # match sessions finished for one of these reasons
    owners: frozenset[str] | None  # the tenants matched ("user" owner), None: the caller's
    limit: int
    after: str | None  # the session id of the cursor: the page starts after it

    @classmethod
    def build(cls, *, session_id: str | None = None, display_name: str | None = None,
              user_metadata: dict[str, str] | None = None, statuses: list[StatusFilter] | None = None,
              owner_type: str = "own", owner_urns: list[str] | None = None, limit: int = 50,
              after: str | None = None, project_ids: list[str] | None = None) -> SessionQuery:
        """The query of one search's filters as either door reads them, checked (errors name the field)."""
        check_no_project("project_ids", project_ids)
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidArgument(f"limit = {limit} must be in [1, {MAX_LIMIT}]")
        if owner_type not in ("own", "accessible", "user"):
            raise InvalidArgument(f"owner.type = {owner_type!r} must be 'own', 'accessible' or 'user'")
        owners = frozenset(owner_urns or ()) if owner_type == "user" else None
        active, finished = cls._statuses(statuses)
        return cls(session_id, display_name, dict(user_metadata or {}), active, finished, owners, limit, after)

    @classmethod
    def from_fields(cls, f: Fields) -> SessionQuery:
        """The query of a ``POST /sessions/search`` body."""
        owner = f.sub("owner", required=False)
        listed = f.get("statuses", list, None)
        statuses = None
        if listed is not None:
            parts = [Fields(raw, f"statuses[{i}]") for i, raw in enumerate(listed)]
            statuses = [(p.get("type", str), p.get("reasons", list, None)) for p in parts]
        return cls.build(session_id=f.get("session_id", str, None), display_name=f.get("display_name", str, None),
                         user_metadata=f.strings("user_metadata"), statuses=statuses,
                         owner_type=owner.get("type", str, "own"), owner_urns=owner.get("owner_urns", list, None),
                         limit=f.get("limit", int, 50), project_ids=f.get("project_ids", list, None),
                         after=f.sub("cursor", required=False).get("last_session_id", str, None))

    @staticmethod
    def _statuses(listed: list[StatusFilter] | None) -> tuple[bool, frozenset[str]]:
        if listed is None:
            return True, frozenset(FINISH_REASONS) | {""}
        active, finished = False, set()
        for i, (kind, reasons) in enumerate(listed):
            if kind == "active":
                active = True
            elif kind == "client_finished":
                bad = [r for r in reasons or () if r not in FINISH_REASONS]
                if bad:
                    raise InvalidArgument(f"statuses[{i}].reasons = {bad!r}: reasons are {list(FINISH_REASONS)}")
                finished |= set(reasons) if reasons else {*FINISH_REASONS, ""}
            elif kind not in ("failed", "cancelled"):
                raise InvalidArgument(f"statuses[{i}].type = {kind!r} is not a session status")
        return active, frozenset(finished)

    def matches(self, s: Session) -> bool:
        if self.owners is not None and s.tenant not in self.owners:
            return False
        named = self.session_id is not None or self.display_name is not None
        if named and s.session_id != self.session_id and (self.display_name is None
                                                          or s.display_name != self.display_name):
            return False
        if any(s.user_metadata.get(k) != v for k, v in self.user_metadata.items()):
            return False
        if not s.finished:
            return self.active
        return (s.finished if s.finished in FINISH_REASONS else "") in self.finished


def session_status(s: Session) -> tuple[str, str]:
    """Tinker's status of a session, as (type, reason): ("active", "") while open, ("client_finished", reason)
    once its client finished it for a reason Tinker names, else ("", "") (no status Tinker has)."""
    if not s.finished:
        return "active", ""
    return ("client_finished", s.finished) if s.finished in FINISH_REASONS else ("", "")


def search(query: SessionQuery, page: Page, start: Cursor | None) -> tuple[list[Session], Session | None]:
    """The first ``query.limit`` matching sessions after ``start`` (the place of ``query.after``) among the next
    ``MAX_SCANNED``, and the next page's cursor: the last of them when more match, the last session read when the
    page stopped at ``MAX_SCANNED`` (more may follow), else None."""
    found: list[Session] = []
    for scanned, s in enumerate(_after(page, start), 1):
        if query.matches(s):
            if len(found) == query.limit:
                return found, found[-1]
            found.append(s)
        if scanned == MAX_SCANNED:
            return found, s
    return found, None


def _after(page: Page, cursor: Cursor | None) -> Iterator[Session]:
    while True:
        batch = page(cursor, BATCH)
        yield from batch
        if len(batch) < BATCH:
            return
        cursor = (batch[-1].created_at, batch[-1].session_id)
