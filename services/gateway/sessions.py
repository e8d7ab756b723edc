"""The gateway's sessions and their sampling sessions: the one owner of those it holds in memory, over the
control-plane database.

``SessionBook`` creates, finds, keeps alive, expires and finishes sessions, and numbers, binds, finds and joins
their sampling sessions (a sampling session is ``"{session}:sample:{n}"``, bound to one policy version);
``GatewayCore`` (what both doors call) asks it and keeps none of its own. A record is found in memory first, then
in the database (another gateway over it may have made it). An open session is heard from by every request naming
it, recorded in the database at most every ``SESSION_TOUCH_S`` so that a heartbeat through any replica counts; one
not heard from for ``idle_s`` is finished when its tenant next opens a session or a sampling session (the official
SDK never finishes its sessions). A finished session and its sampling sessions leave memory (the database keeps
them), so what a gateway holds is bounded by the quotas on open ones.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from lathe.errors import FailedPrecondition, InvalidArgument, NotFound, SessionGone

from .quotas import Quotas
from .records import SamplingSession, Session
from .store import ControlStore

SESSION_IDLE_S = 900.0  # a session not heard from for this long is finished when its tenant next opens one
SESSION_TOUCH_S = 60.0  # how often (at most) a gateway records in the database that a session was heard from
MAX_DISPLAY_NAME = 256  # characters of a session's display name (its column's width)

R = TypeVar("R", Session, SamplingSession)


class SessionBook:
    def __init__(self, store: ControlStore, quotas: Quotas, idle_s: float = SESSION_IDLE_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not idle_s > 0:
            raise ValueError(f"session_idle_s = {idle_s} must be > 0")
        self.store, self.quotas, self.idle_s, self.clock = store, quotas, idle_s, clock
        self.sessions: dict[str, Session] = {}
        self.sampling: dict[str, SamplingSession] = {}

    def load(self, sessions: list[Session], sampling: list[SamplingSession]) -> None:
        """Hold the open sessions and sampling sessions the database lists (a gateway starting)."""
        self.sessions = {s.session_id: s for s in sessions}
        self.sampling = {rec.sampling_session_id: rec for rec in sampling}

    def find(self, session_id: str) -> Session | None:
        return _held(self.sessions, session_id, self.store.get_session)

    def mine(self, tenant: str, session_id: str) -> Session:
        """The tenant's session as it is (``NotFound`` for anyone else's), without hearing from it."""
        return _owned(self.find(session_id), tenant, "session_id", session_id)

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
        for sampling_session_id in self.store.session_members(session_id)[1]:
            self.sampling.pop(sampling_session_id, None)

    # ---- sampling sessions ----

    def find_sampling(self, sampling_session_id: str) -> SamplingSession | None:
        return _held(self.sampling, sampling_session_id, self.store.get_sampling)

    def sampling_session(self, tenant: str, sampling_session_id: str) -> SamplingSession:
        return _owned(self.find_sampling(sampling_session_id), tenant, "sampling_session_id", sampling_session_id)

    def admit_sampling(self, tenant: str, session_id: str, seq_id: int | None) -> None:
        """Refuse a new sampling session in ``session_id`` over the tenant's ``max_sampling_sessions``; a repeat of
        the client's ``seq_id`` makes none and passes."""
        if seq_id is None or self.find_sampling(f"{session_id}:sample:{seq_id}") is None:
            self.expire_idle(tenant)
            self.quotas.admit_sampling_session(tenant, self.store.open_sessions(tenant)[1])

    def bind_sampling(self, tenant: str, session_id: str, seq_id: int | None, base_model: str, model_path: str,
                      version: float, follows: str = "") -> SamplingSession:
        """Sampling session ``"{session_id}:sample:{n}"`` bound to ``model_path`` at ``version`` (or the base
        model): ``n`` is the client's ``seq_id`` (a repeat returns the one already made, here or by another
        gateway) or else the session's next number; ``follows``: the run an inflight session follows. Synchronous,
        so that numbering cannot interleave."""
        s = self.open(tenant, session_id)
        if seq_id is not None and seq_id < 0:
            raise InvalidArgument(f"sampling_session_seq_id must be >= 0, got {seq_id}")
        self.admit_sampling(tenant, session_id, seq_id)
        n = self.store.number(session_id, "next_sampler", seq_id)
        s.next_sampler = max(s.next_sampler, n + 1)
        sid = f"{session_id}:sample:{n}"
        if self.find_sampling(sid) is None:
            self.store.put_sampling(SamplingSession(sid, tenant, base_model, model_path, version, follows))
            self.find_sampling(sid)  # the database's record: another gateway's, should it have made it first
        return self.sampling[sid]

    def join_sampling(self, tenant: str, sampling_session_id: str) -> int:
        """A client number for a new client of the tenant's sampling session, unique among its clients."""
        self.sampling_session(tenant, sampling_session_id)
        return self.store.join_sampling(sampling_session_id)


def _held(memory: dict[str, R], key: str, load: Callable[[str], R | None]) -> R | None:
    """``memory[key]``, else the database's record (``load``), held in memory from then on; None if neither."""
    rec = memory.get(key)
    if rec is None and (rec := load(key)) is not None:
        memory[key] = rec
    return rec


def _owned(rec: R | None, tenant: str, field: str, key: str) -> R:
    """``rec`` if it is the tenant's; else ``NotFound``, the same answer as for a record that does not exist."""
    if rec is None or rec.tenant != tenant:
        raise NotFound(f"unknown {field} {key!r}")
    return rec
