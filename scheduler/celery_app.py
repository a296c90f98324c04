"""The Celery app: Redis broker in production, the in-memory transport when embedded.

JSON only (never pickle); task arguments are ids, never objects. Two queues: `control`
(reconcile, placement) and `steps` (apply_step), so a slow placement pass never delays a step.
Processes start it through their composition root (`roots.worker`, `roots.api`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from celery import Celery
from kombu import Exchange, Queue

from domain.settings import Settings, get_settings

CONTROL, STEPS = "control", "steps"
TASK_MODULES = ["scheduler.tasks.reconcile", "scheduler.tasks.steps", "scheduler.tasks.slices"]


def celery_config(settings: Settings) -> dict[str, Any]:
    embedded = settings.embedded
    return {
        "broker_url": settings.redis_url or "memory://",
        # embedded: kombu's in-memory queues, woken by each message (scheduler.memory_broker);
        # the polling interval is only a safety net there
        "broker_transport": "scheduler.memory_broker:Transport" if embedded else None,
        "broker_transport_options": (
            {"polling_interval": 0.5} if embedded else {"visibility_timeout": 300}
        ),
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "result_accept_content": ["json"],
        "task_ignore_result": True,  # completion is signalled through the store, never results
        "result_backend": None,
        "task_queues": tuple(Queue(q, Exchange(q), routing_key=q) for q in (CONTROL, STEPS)),
        "task_default_queue": CONTROL,
        "task_routes": {
            "scheduler.apply_step": {"queue": STEPS},
            "scheduler.apply_slice": {"queue": STEPS},
            "scheduler.reconcile": {"queue": CONTROL},
            "scheduler.reconcile_job": {"queue": CONTROL},
        },
        "task_acks_late": False,  # opted into per task, only where twice equals once
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        # in-memory beat schedule: the default PersistentScheduler keeps a shelve (pickle) file
        "beat_scheduler": "celery.beat:Scheduler",
        "beat_schedule": {
            "reconcile": {
                "task": "scheduler.reconcile",
                "schedule": float(settings.reconcile_interval_s),
                "options": {"queue": CONTROL, "expires": float(settings.reconcile_interval_s) * 5},
            }
        },
    }


def make_celery(settings: Settings) -> Celery:
    celery = Celery("phalanx", include=TASK_MODULES)
    celery.conf.update(celery_config(settings))
    return celery


def configure(settings: Settings) -> Celery:
    """Point the shared app at `settings` (before it first connects: API install, worker CLI)."""
    app.conf.update(celery_config(settings))
    return app


app = make_celery(get_settings())


@dataclass(frozen=True)
class BrokerProblem:
    """Why tasks cannot be sent now. `transport`: the broker's transport module does not import
    (a broken install; waiting will not help); `unreachable`: the broker does not answer."""

    kind: Literal["transport", "unreachable"]
    detail: str  # for the operator: logs, `phalanx worker`'s exit line
    public: str  # for anyone who asks /readyz: the cause, without addresses or driver text


def broker_problem(celery: Celery, timeout_s: float = 2.0) -> BrokerProblem | None:
    """Load the broker's transport and open one connection; None when both work. Embedded mode's
    in-memory broker always works."""
    if celery.conf.broker_url.startswith("memory://"):
        return None
    try:
        # kombu imports the transport module here, lazily, for the URL's scheme
        conn = celery.connection_for_write(connect_timeout=timeout_s)
    except ImportError as exc:
        detail = (f"the broker's transport cannot load ({exc}): reinstall phalanx with its "
                  "dependencies (celery[redis])")
        return BrokerProblem("transport", detail, detail)
    except Exception as exc:  # noqa: BLE001 - e.g. KeyError: a URL scheme kombu has no transport for
        return BrokerProblem("transport", f"no broker transport for PHALANX_REDIS_URL "
                             f"({type(exc).__name__}: {exc})",
                             f"no broker transport for the configured URL ({type(exc).__name__})")
    try:
        try:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to connect is the answer
            return BrokerProblem("unreachable", f"the broker at {conn.as_uri()} does not answer "
                                 f"({type(exc).__name__}: {exc})",
                                 f"the broker does not answer ({type(exc).__name__})")
        return None
    finally:
        conn.release()
