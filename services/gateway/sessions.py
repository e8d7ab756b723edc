"""The gateway's sessions: the one owner of the sessions it holds in memory, over the control-plane database.

``SessionBook`` creates, finds, keeps alive, expires and finishes sessions; ``GatewayCore`` (what both doors call)
asks it for a session and tells it nothing else. A session is found in memory first, then in the database
(another gateway over it may have made it). An open session is heard from by every request naming it, recorded
in the database at most every ``SESSION_TOUCH_S`` so that a heartbeat through any replica counts; one not heard
from for ``idle_s`` is finished when its tenant next opens a session or a sampling session (the official SDK
never finishes its sessions). A finished session leaves memory (the database keeps it), and so do its sampling
sessions, which the book's owner drops when told (``on_let_go``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from lathe.errors import FailedPrecondition, InvalidArgument, NotFound, SessionGone

from .quotas import Quotas
from .records import Session
from .store import ControlStore

SESSION_IDLE_S = 900.0  # a session not heard from for this long is finished when its tenant next opens one
SESSION_TOUCH_S = 60.0  # how often (at most) a gateway records in the database that a session was heard from
MAX_DISPLAY_NAME = 256  # characters of a session's display name (its column's width)


class SessionBook:
    def __init__(self, store: ControlStore, quotas: Quotas, on_let_go: Callable[[list[str]], None],
                 idle_s: float = SESSION_IDLE_S, clock: Callable[[], float] = time.time) -> None:
        """``on_let_go(sampling_session_ids)``: a finished session's sampling sessions, to drop from memory."""
        if not idle_s > 0:
            raise ValueError(f"session_idle_s = {idle_s} must be > 0")
        self.store, self.quotas, self.on_let_go, self.idle_s, self.clock = store, quotas, on_let_go, idle_s, clock
        self.sessions: dict[str, Session] = {}

    def load(self, sessions: list[Session]) -> None:
        """Hold the open sessions the database lists (a gateway starting)."""
        self.sessions = {s.session_id: s for s in sessions}

    def find(self, session_id: str) -> Session | None:
        s = self.sessions.get(session_id)
        if s is None and (s := self.store.get_session(session_id)) is not None:
            self.sessions[session_id] = s
        return s

    def mine(self, tenant: str, session_id: str) -> Session:
        """The tenant's session as it is (``NotFound`` for anyone else's), without hearing from it."""
        s = self.find(session_id)
        if s is None or s.tenant != tenant:
            raise NotFound(f"unknown session_id {session_id!r}")
        return s

    def get(self, tenant: str, session_id: str) -> Session:
        """The tenant's session; an open one is heard from, and one another gateway finished (or expired) since
        is read as finished."""
        s = self.mine(tenant, session_id)
        now = self.clock()
        if not s.finished and now - s.last_seen >= min(SESSION_TOUCH_S, self.idle_s / 4):
            if self.store.touch_session(session_id, now):
                s.last_seen = now
            else:
                self._let_go(session_id)
                s = self.find(session_id) or s
        return s

    def open(self, tenant: str, session_id: str) -> Session:
        """The session, which must still be open to create models or sampling clients in it."""
        s = self.get(tenant, session_id)
        if s.finished:
            raise FailedPrecondition(f"session {session_id!r} has finished ({s.finished}); start a new one")
        return s

    def heartbeat(self, tenant: str, session_id: str) -> None:
        """Keep an open session alive; a finished one answers ``SessionGone`` (HTTP 410: the SDK stops beating)."""
        s = self.get(tenant, session_id)
        if s.finished:
            raise SessionGone(f"session {session_id!r} has finished ({s.finished})")

    def create(self, tenant: str, user_metadata: dict[str, str], display_name: str | None = None) -> str:
        self.expire_idle(tenant)
        self.quotas.admit_session(tenant, self.store.open_sessions(tenant)[0], user_metadata)
        if display_name is not None and not 0 < len(display_name) <= MAX_DISPLAY_NAME:
            raise InvalidArgument(f"display_name has {len(display_name)} characters; give 1 to {MAX_DISPLAY_NAME}, "
                                  "or none")
        s = Session("sess-" + uuid.uuid4().hex[:16], tenant, dict(user_metadata), display_name=display_name,
                    created_at=self.clock())
        self.store.put_session(s)
        self.sessions[s.session_id] = s
        return s.session_id

    def finish(self, tenant: str, session_id: str, reason: str) -> None:
        """Close a session (the first reason wins); its runs, futures and checkpoints stay. It and its sampling
        sessions leave this gateway's memory (a request naming one reads it from the database again), so what the
        gateway holds of a tenant's sessions is bounded by the quotas on open ones."""
        s = self.get(tenant, session_id)
        if not s.finished:
            s.finished = reason or "finished"
            self.store.finish_session(s)
        self._let_go(session_id)

    def expire_idle(self, tenant: str) -> None:
        """Finish the tenant's sessions not heard from for ``idle_s``."""
        reason = f"expired: not heard from for {self.idle_s:g} s"
        for session_id in self.store.expire_sessions(tenant, self.clock() - self.idle_s, reason):
            self._let_go(session_id)

    def _let_go(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self.on_let_go(self.store.session_members(session_id)[1])
