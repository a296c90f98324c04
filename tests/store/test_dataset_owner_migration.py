"""Migration 0009 (datasets.owner, public, stored_bytes): a dataset stored before it becomes
the admins' and private (nobody can tell who uploaded it), counted at its file's size; the
migration goes down and up again."""

from __future__ import annotations

from alembic import command
from sqlalchemy import text

from domain.store import datasets
from domain.store.db import alembic_config, make_engine, make_session_factory
from domain.store.tokens import Principal


def _migrate(url: str, to: str, down: bool = False) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, to)
    finally:
        engine.dispose()


def test_datasets_from_before_belong_to_the_admins(db_url: str) -> None:
    _migrate(db_url, "0008_job_compute_class", down=True)
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO datasets (name, path, n_samples, input_shape, num_classes, sha256, "
            "size_bytes) VALUES ('old', '/data/datasets/old', 40, '[1, 4, 4]', 3, :sha, 12345)"),
            {"sha": "0" * 64})
    _migrate(db_url, "head")
    with make_session_factory(engine)() as session:
        (row,) = datasets.list_visible(session, Principal(kind="admin"))
        assert (row.name, row.owner, row.public, row.stored_bytes) == ("old", None, False,
                                                                        12345)
        assert datasets.list_visible(session, Principal(kind="user", token_id="tok-1")) == []
    engine.dispose()
