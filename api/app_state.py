"""The app's typed state: every service a request handler, the fast path or a listener reaches,
built once by `api.main.create_app` and set as `app.state`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.auth import Authenticator
from api.heartbeat_writer_pg import AsyncPgHeartbeatWriter
from api.heartbeats import HeartbeatWriter
from api.limits import DeviceRate
from api.scheduler_port import SchedulerPort
from api.steps.protocol import StepProtocol
from domain.settings import Settings
from hotstate.blobs import BlobStore
from hotstate.version import VersionWatch


class BulkEndpoint(Protocol):
    """What a work answer needs of the bulk listener: the URL a device should upload to."""

    def url_for(self, scheme: str, hostname: str | None) -> str | None: ...


@dataclass(eq=False)
class AppState:
    settings: Settings
    clock: Callable[[], dt.datetime]
    engine: Engine
    session_factory: sessionmaker[Session]
    authenticator: Authenticator
    heartbeats: HeartbeatWriter | AsyncPgHeartbeatWriter
    blobs: BlobStore
    step_protocol: StepProtocol
    version_watch: VersionWatch
    slices_watch: VersionWatch  # slices applied (keys.SLICES_VERSION): wakes waits for them
    scheduler: SchedulerPort
    heartbeat_rate: DeviceRate
    bulk_listener: BulkEndpoint | None = None  # set while the bulk port serves
    metrics_queue_collector: object | None = None  # api.metrics builds it on first scrape
