"""`phalanx sim`: many lightweight simulated phones in one process against a real server.

Each phone is a `PhoneModel` (the same physics as the demo's phones) and an asyncio task: it
enrolls, then heartbeats with telemetry every interval, after a random initial offset so the
fleet does not beat in lockstep. On a failed request a phone backs off exponentially with full
jitter (as the real agent does), so a control-plane restart produces a reconnect storm of the
right shape. One shared `httpx.AsyncClient` (bounded connection pool) carries every phone's
requests with the phone's own bearer token.

What it reports: requests, requests/s, errors by kind, latency percentiles, per endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from agent.runtime.agent import FEATURES, compute_class
from phalanx.sim.compute import take_work
from phalanx.sim.liar import Liar, Lie
from phalanx.sim.model import PhoneModel
from phalanx.sim.profiles import fleet_mix
from wire.states import FINISHED_STATES

this_class = functools.cache(compute_class)  # the simulated phones' (this machine's): once


@dataclass
class FleetOptions:
    server: str
    phones: int = 100
    duration_s: float = 30.0
    interval_s: float | None = None  # None: what the server asks for at enrollment
    enroll_token: str | None = None
    admin_token: str | None = None  # creates the enrollment token, and cleans up
    concurrency: int = 64  # open connections
    load: float = 0.3  # mean CPU load of a phone (its temperature and power follow it)
    time_scale: float = 10.0
    seed: int = 0
    cleanup: bool = True
    compute: bool = False  # take and compute real work (see phalanx.sim.compute)
    job: dict[str, Any] | None = None  # submit this job (admin token) and stop when it ends
    follow_job: str | None = None  # or stop when this already submitted job ends
    backoff_cap_s: float = 30.0  # longest wait between retries of a failing phone
    stop: threading.Event | None = None  # set from another thread to end the run early
    labels: dict[str, str] = field(default_factory=dict)
    liars: int = 0  # the first N phones corrupt their results (phalanx.sim.liar; --compute)
    lie: str = "flip:1:0"  # how: MODE[:EVERY[:FROM_STEP]]


@dataclass
class FleetStats:
    started: float = field(default_factory=time.monotonic)
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    enrolled: int = 0
    retries: int = 0
    finished: float | None = None

    def record(self, endpoint: str, seconds: float, error: str | None) -> None:
        self.requests[endpoint] += 1
        lat = self.latencies[endpoint]
        if len(lat) < 200_000:
            lat.append(seconds)
        if error:
            self.errors[f"{endpoint}: {error}"] += 1

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def report(self) -> dict[str, Any]:
        total = sum(self.requests.values())
        every = sorted(x for lat in self.latencies.values() for x in lat)
        return {
            "phones_enrolled": self.enrolled,
            "requests": total,
            "elapsed_s": round(self.elapsed_s, 2),
            "requests_per_s": round(total / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0,
            "errors": sum(self.errors.values()),
            "errors_by_kind": dict(self.errors),
            "retries": self.retries,
            "latency_ms": _percentiles(every),
            "endpoints": {ep: {"requests": n, "latency_ms": _percentiles(sorted(self.latencies[ep]))}
                          for ep, n in sorted(self.requests.items())},
        }


def _percentiles(sorted_s: list[float]) -> dict[str, float]:
    if not sorted_s:
        return {}
    pick = lambda q: round(1000 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))], 2)  # noqa: E731
    return {"p50": pick(0.5), "p95": pick(0.95), "p99": pick(0.99), "max": pick(1.0)}


class Backoff:
    """Full-jitter exponential backoff: uniform(0, min(cap, base * 2**n))."""

    def __init__(self, rng: random.Random, base_s: float = 0.5, cap_s: float = 30.0) -> None:
        self.rng, self.base_s, self.cap_s, self.failures = rng, base_s, cap_s, 0

    def next_delay(self) -> float:
        self.failures += 1
        return self.rng.uniform(0, min(self.cap_s, self.base_s * 2 ** min(self.failures, 16)))

    def reset(self) -> None:
        self.failures = 0


class PhoneStopped(Exception):
    """The server revoked this phone (401/404): it stops, like a real agent."""


class LightPhone:
    def __init__(self, index: int, fleet: Fleet) -> None:
        self.fleet = fleet
        self.rng = random.Random(fleet.opts.seed * 100_003 + index)
        profile = fleet.profiles[index]
        self.name = f"{fleet.run_id}-{index:05d}"
        self.model = PhoneModel(profile, battery_pct=self.rng.uniform(30, 100),
                                plugged=self.rng.random() < 0.8, time_scale=fleet.opts.time_scale,
                                seed=index)
        self.device_id: str | None = None
        self.token: str | None = None
        self.interval_s = fleet.opts.interval_s or 10.0
        self.backoff = Backoff(self.rng, cap_s=fleet.opts.backoff_cap_s)
        self.load = 0.0
        self.profiles: dict[str, Any] = {}  # measured throughput per arch (--compute)
        self.computed_shards = 0
        self.liar = Liar(Lie.parse(fleet.opts.lie)) if index < fleet.opts.liars else None

    async def call(self, endpoint: str, method: str, path: str, *,
                   expected: tuple[int, ...] = (), **kwargs: Any) -> httpx.Response:
        """One request, retried with backoff on transport errors and 5xx/429. A 4xx counts as
        an error unless it is `expected` (the step protocol's 409 "step moved on", ...)."""
        while not self.fleet.stopping.is_set():
            started = time.monotonic()
            error = None
            try:
                async with self.fleet.in_flight:
                    resp = await self.fleet.http.request(method, path, **kwargs)
                if resp.status_code >= 400 and resp.status_code not in expected:
                    error = str(resp.status_code)
            except httpx.HTTPError as exc:
                resp, error = None, type(exc).__name__
            self.fleet.stats.record(endpoint, time.monotonic() - started, error)
            if resp is not None and (resp.status_code < 500 and resp.status_code != 429):
                self.backoff.reset()
                gone = resp.status_code == 401 or (resp.status_code == 404 and endpoint == "heartbeat")
                if gone and self.device_id:
                    raise PhoneStopped(f"{self.name}: {resp.status_code}")
                return resp
            self.fleet.stats.retries += 1
            await self.fleet.sleep(self.backoff.next_delay())
        raise asyncio.CancelledError

    def sample(self) -> dict[str, Any]:
        m, s = self.model, self.model.state
        freqs = [cur for _, _, cur in m.core_freqs_khz()]
        return {"ts": time.time(), "battery_pct": round(s.battery_pct, 1), "charging": m.charging,
                "battery_temp_c": round(s.battery_c, 1), "cpu_temp_c": m.cpu_temp_c,
                "power_w": round(s.power_w, 3),
                "cpu_freq_mhz": round(sum(freqs) / len(freqs) / 1000.0, 1),
                "throttled": m.throttled, "busy": False}

    async def enroll(self) -> None:
        body = {"enrollment_token": self.fleet.enroll_token, "name": self.name,
                "labels": {"sim": self.fleet.run_id, **self.fleet.opts.labels},
                "spec": self.model.profile.hardware_spec()}
        async with self.fleet.enroll_slots:
            resp = await self.call("register", "POST", "/v1/devices/register", json=body)
        if resp.status_code != 201:
            raise PhoneStopped(f"{self.name}: enrollment refused ({resp.status_code}): {resp.text}")
        data = resp.json()
        self.device_id, self.token = data["device_id"], data["device_token"]
        if self.fleet.opts.interval_s is None:
            self.interval_s = float(data.get("heartbeat_interval_s") or 10.0)
        self.fleet.stats.enrolled += 1

    async def heartbeat(self) -> None:
        self.model.advance(self.interval_s, self.load)
        body: dict[str, Any] = {"telemetry": [self.sample()], "agent_version": "sim"}
        if self.fleet.opts.compute:
            # the simulated phones compute with the real engine in this process: its compute
            # class (and its portable path) is this machine's
            body["capabilities"] = {"backends": ["numpy"], "archs": ["logreg", "mlp", "cnn"],
                                    "features": list(FEATURES)}
            if (facts := this_class()) is not None:
                body["capabilities"]["compute_class"] = facts
            if self.profiles:
                body["profiles"] = self.profiles
        headers = {"Authorization": f"Bearer {self.token}"}
        await self.call("heartbeat", "POST", f"/v1/devices/{self.device_id}/heartbeat",
                        json=body, headers=headers)

    async def run(self) -> None:
        await self.enroll()
        await self.fleet.sleep(self.rng.uniform(0, self.interval_s))
        while not self.fleet.stopping.is_set():
            if not self.fleet.opts.compute:  # with --compute the work loop sets the load
                self.load = min(1.0, max(0.0, self.rng.gauss(self.fleet.opts.load, 0.1)))
            await self.heartbeat()
            await self.fleet.sleep(self.interval_s)


class Fleet:
    def __init__(self, opts: FleetOptions, http: httpx.AsyncClient | None = None) -> None:
        self.opts = opts
        self.run_id = f"sim{random.Random().getrandbits(24):06x}"
        self.profiles = fleet_mix(opts.phones)
        self.stats = FleetStats()
        self.stopping = asyncio.Event()
        self.enroll_slots = asyncio.Semaphore(max(1, opts.concurrency // 2))
        # requests past the pool's size wait here, not in httpcore's pool queue: that queue is
        # scanned on every connection released, so thousands of phones waiting in it after a
        # server restart cost the simulator more CPU than the server (seen at 2,500 phones per
        # process: 1 request/s got through while the process ran at 100% CPU)
        self.in_flight = asyncio.Semaphore(opts.concurrency)
        limits = httpx.Limits(max_connections=opts.concurrency,
                              max_keepalive_connections=opts.concurrency)
        self.http = http or httpx.AsyncClient(base_url=opts.server.rstrip("/"), limits=limits,
                                              timeout=httpx.Timeout(30.0, pool=60.0))
        self.enroll_token = opts.enroll_token
        self.phones = [LightPhone(i, self) for i in range(opts.phones)]

    async def sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    def _admin(self) -> dict[str, str]:
        if not self.opts.admin_token:
            raise SystemExit("phalanx sim needs an admin token (--token) or --enroll-token")
        return {"Authorization": f"Bearer {self.opts.admin_token}"}

    async def prepare(self) -> None:
        if self.enroll_token:
            return
        body = {"description": f"phalanx sim {self.run_id}", "labels": {"sim": self.run_id}}
        resp = await self.http.post("/v1/enrollment-tokens", json=body, headers=self._admin())
        if resp.status_code != 201:
            raise SystemExit(f"cannot create an enrollment token: HTTP {resp.status_code} "
                             f"{resp.text[:300]}")
        self.enroll_token = resp.json()["token"]

    async def _phone(self, phone: LightPhone, work: Callable[[LightPhone], Awaitable[None]] | None
                     ) -> None:
        try:
            if work is None:
                await phone.run()
            else:
                await asyncio.gather(phone.run(), work(phone))
        except PhoneStopped as exc:
            self.stats.errors[f"stopped: {exc}"[:120]] += 1
        except asyncio.CancelledError:
            pass

    async def run(self, progress: Callable[[FleetStats], None] | None = None,
                  work: Callable[[LightPhone], Awaitable[None]] | None = None) -> dict[str, Any]:
        await self.prepare()
        self.stats = FleetStats()
        tasks = [asyncio.create_task(self._phone(p, work)) for p in self.phones]
        job_id = await self.submit_job() if self.opts.job else self.opts.follow_job
        job: dict[str, Any] | None = None
        deadline = time.monotonic() + self.opts.duration_s
        while time.monotonic() < deadline and not all(t.done() for t in tasks):
            await self.sleep(min(1.0, deadline - time.monotonic()))
            if progress:
                progress(self.stats)
            if self.opts.stop is not None and self.opts.stop.is_set():
                break
            if job_id:
                job = await self.job(job_id) or job
                if job and job.get("state") in FINISHED_STATES:
                    break
        self.stats.finished = time.monotonic()
        self.stopping.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        report = self.stats.report()
        if job_id:
            report["job"] = {k: (job or {}).get(k) for k in
                             ("id", "state", "reason", "step", "total_steps", "metrics",
                              "exactness", "compute_class")}
            report["job"]["id"] = job_id
            report["computed_shards"] = sum(p.computed_shards for p in self.phones)
        if self.opts.liars:
            report["liars"] = await self.liars()
        if self.opts.cleanup and self.opts.admin_token:
            failures = await self.cleanup()
            report["cleanup_errors"] = len(failures)
            report["cleanup_failures"] = failures[:10]  # what went wrong, for the operator
        await self.http.aclose()
        return report

    async def submit_job(self) -> str:
        resp = await self.http.post("/v1/jobs", json=self.opts.job, headers=self._admin())
        if resp.status_code != 201:
            raise SystemExit(f"job refused: HTTP {resp.status_code} {resp.text[:300]}")
        return str(resp.json()["id"])

    async def job(self, job_id: str) -> dict[str, Any] | None:
        try:
            resp = await self.http.get(f"/v1/jobs/{job_id}", headers=self._admin())
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    async def liars(self) -> list[dict[str, Any]]:
        """Each lying phone: its lies, and whether the server quarantined it (and why)."""
        out = []
        for phone in self.phones:
            if phone.liar is None:
                continue
            quarantined = None
            if phone.device_id and self.opts.admin_token:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = await self.http.get(f"/v1/devices/{phone.device_id}",
                                               headers=self._admin())
                    quarantined = resp.json().get("quarantine_reason")
            out.append({"name": phone.name, "device_id": phone.device_id,
                        "lie": str(phone.liar.lie), "results": phone.liar.results,
                        "lies": phone.liar.lies, "quarantined": quarantined})
        return out

    async def cleanup(self) -> list[str]:
        """Delete the devices this run enrolled; why each failed delete failed."""
        slots = asyncio.Semaphore(self.opts.concurrency)

        # A pooled connection idle past the server's keep-alive timeout may be closed under us
        # (seen: ReadError); DELETE is idempotent (404 counts as done), so try it again.
        retrying = AsyncRetrying(retry=retry_if_exception_type(httpx.TransportError),
                                 stop=stop_after_attempt(3), wait=wait_fixed(0.2), reraise=True)

        async def delete(phone: LightPhone) -> str | None:
            async with slots:
                try:
                    resp = await retrying(self.http.delete, f"/v1/devices/{phone.device_id}",
                                          headers=self._admin())
                except httpx.HTTPError as exc:
                    return f"{phone.device_id}: {type(exc).__name__}: {exc}"
                if resp.status_code < 300 or resp.status_code == 404:
                    return None
                return f"{phone.device_id}: HTTP {resp.status_code} {resp.text[:200]}"

        results = await asyncio.gather(*(delete(p) for p in self.phones if p.device_id))
        return [failure for failure in results if failure is not None]


def run_fleet(opts: FleetOptions, progress: Callable[[FleetStats], None] | None = None
              ) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        return await Fleet(opts).run(progress, take_work if opts.compute else None)

    return asyncio.run(main())
