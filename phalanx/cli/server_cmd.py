"""`phalanx server` (migrations, then uvicorn) and `phalanx db upgrade`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from phalanx.cli.settings import load_settings

db_app = typer.Typer(help="Database schema commands.", no_args_is_help=True)


def _prepare() -> tuple[object, str]:
    """Migrate the schema and make sure an admin token exists (written to a private file when
    generated)."""
    from api.auth import ensure_admin_token
    from domain.store.db import make_engine, make_session_factory, upgrade

    settings = load_settings()
    url = settings.resolved_database_url
    upgrade(url)
    if settings.admin_token is None:
        engine = make_engine(url)
        ensure_admin_token(make_session_factory(engine), settings.admin_token_file,
                           echo=lambda m: typer.echo(m, err=True))
        engine.dispose()
    return settings, url


def server(
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    port: int = typer.Option(8000, help="TCP port"),
    workers: int = typer.Option(1, min=1, max=64, help="uvicorn worker processes "
                                "(forced to 1 in embedded mode: no PHALANX_REDIS_URL)"),
    access_log: bool = typer.Option(False, help="log every request (slow under load)"),
    bulk_port: int | None = typer.Option(
        None, min=0, max=65535, help="port for the steps' bulk transfers, weights down and "
        "gradients up (a thread per connection; agents are told it and fall back to --port); "
        "default --port + 1, 0: off"),
    tls_cert: Optional[Path] = typer.Option(
        None, exists=True, dir_okay=False, help="PEM certificate (chain): serve https on --port "
        "and the bulk port (PHALANX_TLS_CERT_FILE)"),
    tls_key: Optional[Path] = typer.Option(
        None, exists=True, dir_okay=False, help="PEM private key of --tls-cert "
        "(PHALANX_TLS_KEY_FILE)"),
) -> None:
    """Run the control plane: migrate the database, then serve the API."""
    import os

    import uvicorn

    from phalanx.cli.serving import GRACEFUL_S, serve

    if bulk_port is None:
        bulk_port = int(os.environ.get("PHALANX_BULK_PORT") or (port + 1 if port < 65535 else 0))
    if bulk_port:  # the environment carries it to uvicorn's worker processes too
        os.environ.update(PHALANX_BULK_PORT=str(bulk_port), PHALANX_BULK_HOST=host,
                          PHALANX_BULK_REUSE_PORT="1" if workers > 1 and
                          os.environ.get("PHALANX_REDIS_URL") else "0")
    else:
        os.environ.pop("PHALANX_BULK_PORT", None)
    for name, path in (("PHALANX_TLS_CERT_FILE", tls_cert), ("PHALANX_TLS_KEY_FILE", tls_key)):
        if path is not None:  # the environment carries them to uvicorn's workers too
            os.environ[name] = str(path.resolve())
    settings, _ = _prepare()
    from api.process import tune_interpreter

    tune_interpreter(settings)  # type: ignore[arg-type]
    common = {"host": host, "port": port, "access_log": access_log, "log_level": "info",
              "loop": "auto", "http": "auto", "timeout_graceful_shutdown": GRACEFUL_S,
              # --workers N: a worker that has not answered the supervisor's ping by then is
              # killed and started again; uvicorn's 5 s killed every worker of a loaded machine
              # (load 40 on 2 cores) while it was still importing, over and over
              "timeout_worker_healthcheck": 30}
    if settings.tls_cert_file is not None:  # type: ignore[attr-defined]
        common.update(ssl_certfile=str(settings.tls_cert_file),  # type: ignore[attr-defined]
                      ssl_keyfile=str(settings.tls_key_file))  # type: ignore[attr-defined]
    if settings.embedded:  # type: ignore[attr-defined]
        from roots.api import create_app

        if workers > 1:
            typer.echo("phalanx: embedded mode (no PHALANX_REDIS_URL): running 1 worker", err=True)
        config = uvicorn.Config(create_app(settings, start_scheduler=True),  # type: ignore[arg-type]
                                **common)
    elif workers > 1:
        config = uvicorn.Config("roots.api:app_from_env", factory=True, workers=workers, **common)
    else:
        from roots.api import create_app

        config = uvicorn.Config(create_app(settings), **common)  # type: ignore[arg-type]
    serve(config)  # SIGTERM, SIGHUP and Ctrl-C stop it alike (phalanx.cli.serving)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the database schema to the newest migration."""
    from domain.store.db import upgrade

    url = load_settings().resolved_database_url
    upgrade(url)
    typer.echo(f"database at {url.split('@')[-1]} is at the newest schema")


def register(app: typer.Typer) -> None:
    app.command()(server)
    app.add_typer(db_app, name="db")
