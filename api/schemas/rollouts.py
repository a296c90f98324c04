"""Agent rollouts: the build phones should run, and what a phone reports when it cannot."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from api.schemas.common import RequestModel

MAX_PARALLEL = 10_000


class RolloutIn(RequestModel):
    version: str | None = Field(
        default=None, max_length=40,
        description="the agent version to roll out; this server can serve only its own "
                    "agent build, so this must be that version (default: it)")
    max_parallel: int = Field(default=1, ge=1, le=MAX_PARALLEL,
                              description="how many phones may upgrade at the same time")


class RolloutDevices(BaseModel):
    up_to_date: int = Field(description="phones running the rollout's version")
    upgrading: int = Field(description="phones told to install it, not yet back with it")
    failed: int = Field(description="phones that could not install it (not asked again)")
    waiting: int = Field(description="phones still to upgrade (between jobs, a few at a time)")
    cannot: int = Field(description="phones whose agent cannot upgrade itself (older than "
                        "self-upgrade, or not started by launch.sh): reinstall with install.sh")


class ServedAgent(BaseModel):
    version: str
    sha256: str = Field(description="SHA-256 of /agent.tar.gz as this replica serves it")


class RolloutRead(BaseModel):
    active: bool
    version: str | None = None
    sha256: str | None = None
    max_parallel: int | None = None
    set_by: str | None = None
    updated: dt.datetime | None = None
    served: ServedAgent
    devices: RolloutDevices
    versions: dict[str, int] = Field(description="devices per reported agent version")


class UpgradeReportIn(RequestModel):
    version: str = Field(min_length=1, max_length=40, description="the version it tried")
    outcome: Literal["failed", "rolled_back"] = Field(
        description="failed: not installed (download, hash, unpacking); rolled_back: installed "
                    "but the new agent did not start, the previous one runs again")
    detail: str = Field(default="", max_length=2000)
