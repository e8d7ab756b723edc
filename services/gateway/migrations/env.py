"""Alembic's entry for the control plane's migrations: runs them on the connection ``store_engine.upgrade`` passes,
inside the transaction it holds (never from a URL of its own, never offline)."""

from alembic import context

context.configure(connection=context.config.attributes["connection"], transaction_per_migration=False)
with context.begin_transaction():
    context.run_migrations()
