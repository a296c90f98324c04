"""Prometheus metrics: the registry and `/metrics` exposition (see docs/contracts.md, docs/deploy.md).

Three sources, one page:

- HTTP requests (counts and latency by route *template*): per process. With several uvicorn
  workers set `PROMETHEUS_MULTIPROC_DIR` (an empty, per-container directory) and prometheus-client
  keeps the counters in shared files that any worker aggregates at scrape time.
- Scheduler task durations (`domain.task_metrics.observe_task`): shared through Redis, or this process's memory when
  embedded (`domain.task_metrics`), so a Celery worker in another pod still shows up here.
- Fleet, job and queue gauges: read from Postgres / Redis at scrape time (`api.metrics_store`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import redis
from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from api.metrics_store import StoreCollector
from domain import task_metrics
from wire.buffers import BUFFERS, BufferPool

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

QUEUES = ("control", "steps")
# kombu's Redis transport keeps priority levels in extra lists named `<queue>\x06\x16<level>`
PRIORITY_SEP = "\x06\x16"
PRIORITY_LEVELS = (0, 3, 6, 9)
UNMATCHED = "unmatched"  # 404s: never the raw path (one series per scanner's guess)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)

disable_created_metrics()  # `_created` series double the page and no panel reads them
REQUESTS = CollectorRegistry(auto_describe=False)
HTTP_REQUESTS = Counter("phalanx_http_requests", "HTTP requests by route template and status",
                        ["method", "route", "status"], registry=REQUESTS)
HTTP_LATENCY = Histogram("phalanx_http_request_duration_seconds",
                         "HTTP request latency by route template", ["method", "route"],
                         buckets=REQUEST_BUCKETS, registry=REQUESTS)
# labelled, so no process writes a series (a multiprocess file) before it refuses anything
BULK_REFUSED_CONNECTIONS = Counter(
    "phalanx_bulk_refused_connections", "Connections the bulk listener closed at once, by "
    "reason: max_connections (it already served PHALANX_BULK_MAX_CONNECTIONS)", ["reason"],
    registry=REQUESTS)
BUFFER_POOL_BYTES = Gauge(
    "phalanx_buffer_pool_bytes", "Bytes of model-sized buffers (uploads, states, weights "
    "messages) the server's processes keep to hand out again (PHALANX_BUFFER_POOL_MB)",
    multiprocess_mode="livesum", registry=REQUESTS)
BUFFER_POOL_REUSED = Counter(
    "phalanx_buffer_pool_reused", "Model-sized buffers handed out again instead of fresh pages "
    "the kernel faults in and zeroes", registry=REQUESTS)
SHARD_RESULTS = Counter("phalanx_shard_results", "Shards whose results devices uploaded (a "
                        "partial counts each shard it adds): accepted (the first of its shard "
                        "and step) or duplicate (dropped: first wins)",
                        ["outcome"], registry=REQUESTS)
SLICES_SERVED = Counter("phalanx_weights_slices_served", "A sliced job's weights slices served: "
                        "`ahead` once applied and before their step commits (the phone fetches "
                        "them while the other slices are applied), `committed` after",
                        ["when"], registry=REQUESTS)
UPLOADED_RESULTS = Counter("phalanx_uploaded_results", "Results in devices' uploads: a shard's "
                           "own, or a partial adding the several shards a phone holds "
                           "(engine.tree; one upload instead of one per shard)",
                           ["kind"], registry=REQUESTS)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class RequestMetrics:
    """ASGI wrapper: counts and times every HTTP request by the route that matched it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = str(scope.get("method", "GET"))
            HTTP_REQUESTS.labels(method, route, str(status[0])).inc()
            HTTP_LATENCY.labels(method, route).observe(time.perf_counter() - started)


class QueueCollector(Collector):
    """Celery queue depths: LLEN of each queue (and its priority lists) in the Redis broker."""

    def __init__(self, redis_url: str | None) -> None:
        self._url = redis_url
        self._client: Any = None

    def _depths(self) -> dict[str, int]:
        if self._url is None:  # embedded: the in-memory transport has no backlog to speak of
            return dict.fromkeys(QUEUES, 0)
        if self._client is None:
            self._client = redis.Redis.from_url(self._url, socket_connect_timeout=1,
                                                socket_timeout=1)
        pipe = self._client.pipeline(transaction=False)
        for queue in QUEUES:
            pipe.llen(queue)
            for level in PRIORITY_LEVELS[1:]:
                pipe.llen(f"{queue}{PRIORITY_SEP}{level}")
        lengths = pipe.execute()
        per = len(PRIORITY_LEVELS)
        return {q: sum(lengths[i * per:(i + 1) * per]) for i, q in enumerate(QUEUES)}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("phalanx_queue_depth", "Celery messages waiting, by queue",
                                   labels=["queue"])
        for queue, depth in self._depths().items():
            family.add_metric([queue], float(depth))
        yield family


class Guarded(Collector):
    """A source that may fail (database or Redis down): `/metrics` still answers, and says so."""

    def __init__(self, source: str, collector: Collector, up: dict[str, bool]) -> None:
        self._source, self._collector, self._up = source, collector, up

    def collect(self) -> Iterable[Any]:
        try:
            families = list(self._collector.collect())
        except Exception as exc:
            log.warning("metrics source %s failed: %s", self._source, exc)
            self._up[self._source] = False
            return []
        self._up[self._source] = True
        return families


class SourcesUp(Collector):
    def __init__(self, up: dict[str, bool]) -> None:
        self._up = up

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("phalanx_metrics_source_up",
                                   "1 when the source answered this scrape", labels=["source"])
        for source, ok in sorted(self._up.items()):
            family.add_metric([source], 1.0 if ok else 0.0)
        yield family


def _queue_collector(app: FastAPI, redis_url: str | None) -> QueueCollector:
    collector = getattr(app.state, "metrics_queue_collector", None)
    if collector is None:
        collector = app.state.metrics_queue_collector = QueueCollector(redis_url)
    return collector


def build_registry(app: FastAPI) -> CollectorRegistry:
    """Everything one scrape shows, for this app's settings and store."""
    settings = app.state.settings
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir():
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(REQUESTS)
    up: dict[str, bool] = {}
    store = StoreCollector(app.state.session_factory, app.state.clock)
    tasks = task_metrics.TaskCollector(task_metrics.stats_store(settings.redis_url))
    for source, collector in (("store", store), ("tasks", tasks),
                              ("queues", _queue_collector(app, settings.redis_url))):
        registry.register(Guarded(source, collector, up))
    registry.register(SourcesUp(up))
    return registry


def render(app: FastAPI) -> bytes:
    return generate_latest(build_registry(app))


router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format (version 0.0.4)."""
    body = await run_in_threadpool(render, request.app)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _pool_metrics(held_bytes: int, reused: bool) -> None:
    """The process's buffer pool (wire.buffers) as the two series above: called under the
    pool's lock after each request and sweep."""
    BUFFER_POOL_BYTES.set(held_bytes)
    if reused:
        BUFFER_POOL_REUSED.inc()


def watch_buffer_pool(pool: BufferPool = BUFFERS) -> None:
    pool.watch = _pool_metrics
