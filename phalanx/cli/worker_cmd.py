"""`phalanx worker [--beat] [--queues control,steps]`: a Celery worker for the scheduler."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""

    @app.command()
    def worker(
        beat: bool = typer.Option(False, "--beat", help="also run the (single) beat scheduler"),
        queues: str = typer.Option("control,steps", "--queues", "-Q",
                                   help="comma-separated queues to consume"),
        concurrency: int = typer.Option(4, "--concurrency", "-c", help="worker threads"),
        loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    ) -> None:
        """Run scheduler tasks (reconcile, placement, apply_step) from the Redis broker."""
        from api.settings import get_settings
        from scheduler.celery_app import configure

        settings = get_settings()
        if settings.embedded:
            typer.echo("PHALANX_REDIS_URL is not set: in embedded mode `phalanx server` runs "
                       "the scheduler itself; a separate worker needs Redis.", err=True)
            raise typer.Exit(2)
        celery = configure(settings)
        # threads, not prefork: one process that a SIGKILL stops whole, and numpy releases the GIL
        argv = ["worker", "-Q", queues, "--pool", "threads", "--concurrency", str(concurrency),
                "--loglevel", loglevel, "--without-gossip", "--without-mingle"]
        if beat:
            # a thread, not Celery's -B child process: a SIGKILLed worker takes its beat along
            # instead of leaving an orphan that keeps scheduling
            from celery.beat import EmbeddedService, Scheduler

            # in-memory schedule: the default PersistentScheduler keeps a shelve (pickle) file
            EmbeddedService(celery, thread=True, scheduler_cls=Scheduler).start()
        celery.worker_main(argv)
