"""How the control plane's database is opened and migrated: ``create_engine`` (SQLite's pragmas and transactions, or
PostgreSQL) and ``upgrade`` (the alembic migration in ``migrations/``, under the database's write lock).

Engines: a SQLite file (WAL, ``synchronous=NORMAL``: a commit survives kill -9 of the process, not a power cut;
a busy timeout lets two processes share it), in-memory SQLite (``sqlite://``: nothing survives the process),
or PostgreSQL (``postgresql+psycopg://``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

MIGRATIONS = Path(__file__).with_name("migrations")
PG_LOCK_ID = 0x6C617468  # the advisory lock two gateways take to migrate one PostgreSQL database in turn


def create_engine(db_url: str, busy_timeout_ms: int) -> Engine:
    """An engine for ``db_url``; a SQLite one waits ``busy_timeout_ms`` for another process's write."""
    url = sa.make_url(db_url)
    if url.get_backend_name() != "sqlite":
        return sa.create_engine(url, pool_pre_ping=True)
    memory = url.database in (None, "", ":memory:")
    if not memory:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, poolclass=StaticPool if memory else None,
                              connect_args={"check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi: sqlite3.Connection, record: object) -> None:
        dbapi.isolation_level = None  # SQLAlchemy emits BEGIN itself (below), so DDL is transactional too
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", f"busy_timeout={busy_timeout_ms}"):
            dbapi.execute(f"PRAGMA {pragma}")

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the migrations not yet applied up to ``revision``, holding the database's write lock so two gateways
    migrate in turn."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect().execution_options(sqlite_immediate=True) as conn, conn.begin():
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": PG_LOCK_ID})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
