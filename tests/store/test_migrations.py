"""The schema comes only from migrations, and they must match the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from domain.store.db import make_engine
from domain.store.models import Base


def test_migrations_match_models(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations drifted; add a migration: {diff}"


def test_migrations_create_every_table(db_url: str) -> None:
    engine = make_engine(db_url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    assert set(Base.metadata.tables) <= tables
    assert "alembic_version" in tables
