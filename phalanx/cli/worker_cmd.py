"""`phalanx worker [--beat] [--queues control,steps]`: a Celery worker for the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from phalanx.cli.settings import load_settings

if TYPE_CHECKING:  # celery is imported by the command itself: `phalanx --help` stays quick
    from celery import Celery

    from scheduler.celery_app import BrokerProblem


def _wait_for_broker(celery: Celery, wait_s: float) -> BrokerProblem | None:
    """The broker's problem that remains after `wait_s` s of retries; a transport that does not
    import is answered at once (waiting cannot install a package)."""
    from scheduler.celery_app import broker_problem

    retrying = Retrying(stop=stop_after_delay(wait_s), wait=wait_exponential(0.2, max=5),
                        retry=retry_if_result(lambda p: p is not None and p.kind == "unreachable"),
                        retry_error_callback=lambda state: state.outcome.result())
    return retrying(broker_problem, celery)


def stop_on_hangup(celery: Celery) -> None:
    """SIGHUP stops the worker as SIGTERM does (a warm shutdown: the tasks running finish,
    then the process ends); Celery's own answer, away from a terminal, restarts it in place."""
    from celery.apps.worker import install_worker_term_handler

    worker_cls = celery.Worker  # this app's own subclass
    install_tweaks = worker_cls.install_platform_tweaks

    def install_platform_tweaks(self: object, worker: object) -> None:
        install_tweaks(self, worker)
        install_worker_term_handler(worker, sig="SIGHUP")

    worker_cls.install_platform_tweaks = install_platform_tweaks  # type: ignore[method-assign]


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""

    @app.command()
    def worker(
        beat: bool = typer.Option(False, "--beat", help="also run the (single) beat scheduler"),
        queues: str = typer.Option("control,steps", "--queues", "-Q",
                                   help="comma-separated queues to consume"),
        concurrency: int = typer.Option(4, "--concurrency", "-c", help="worker threads"),
        loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
        broker_wait: float = typer.Option(
            30.0, "--broker-wait", min=0.0,
            help="seconds to wait at start for the broker to answer before giving up"),
    ) -> None:
        """Run scheduler tasks (reconcile, placement, apply_step) from the Redis broker."""
        settings = load_settings()  # before scheduler.celery_app: it reads them at import
        from api.process import tune_interpreter
        from roots.worker import install

        if settings.embedded:
            typer.echo("PHALANX_REDIS_URL is not set: in embedded mode `phalanx server` runs "
                       "the scheduler itself; a separate worker needs Redis.", err=True)
            raise typer.Exit(2)
        celery = install(settings)
        problem = _wait_for_broker(celery, broker_wait)
        if problem is not None:
            # one line and a non-zero exit (the supervisor restarts us), not Celery's
            # traceback-and-retry loop
            typer.echo(f"phalanx worker: {problem.detail}", err=True)
            raise typer.Exit(1)
        # before any step's arrays: steps are applied here too (sliced steps, reconcile's)
        kept = tune_interpreter(settings)
        if kept:
            typer.echo(f"phalanx worker: malloc keeps a step's arrays ({':'.join(kept)})",
                       err=True)
        # threads, not prefork: one process that a SIGKILL stops whole, and numpy releases the GIL
        argv = ["worker", "-Q", queues, "--pool", "threads", "--concurrency", str(concurrency),
                "--loglevel", loglevel, "--without-gossip", "--without-mingle"]
        if beat:
            # a thread, not Celery's -B child process: a SIGKILLed worker takes its beat along
            # instead of leaving an orphan that keeps scheduling
            from celery.beat import EmbeddedService, Scheduler

            # in-memory schedule: the default PersistentScheduler keeps a shelve (pickle) file
            EmbeddedService(celery, thread=True, scheduler_cls=Scheduler).start()
        stop_on_hangup(celery)
        celery.worker_main(argv)
