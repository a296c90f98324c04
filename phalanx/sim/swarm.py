"""`phalanx sim` at fleet scale: 100,000 phones from one process on one core.

What a phone is here: a row of a `PhoneTable` (its device id, token, battery, temperature,
failures, unsent samples, in arrays) and entries in one timer heap, not an object or a task.
A ticker moves what is due onto a ready list; `connections` worker coroutines, each with its
own keep-alive HTTP/1.1 connection (`phalanx.sim.rawhttp`), take from it and speak for
whichever phone is due. Heartbeats go before enrollments (which hold at most half the
connections, and an eighth whatever is due), so the enrolled part of the fleet keeps its beat
while the rest enrolls.

A phone does what the real agent does (agent/runtime/heartbeat.py): it enrolls with
`POST /v1/devices/register` (`enroll_first`, the default: the whole fleet enrolls, then the
phones start beating, each at a random offset within one interval); every interval (the server's, jittered by ±`jitter`) it takes a
telemetry sample and sends every sample not yet accepted (at most 100 a request) with its
agent version, capabilities, profiles and pause; on a transport error, a 5xx or a 429 it keeps
the samples and tries again after full-jitter exponential backoff (1 s base, 60 s cap, at most
6 intervals); a 401 stops it for good; another 4xx drops the batch. It obeys the interval the
server answers and counts the commands it is sent. With `work_every_s`, it also polls
`GET /v1/devices/{id}/work?wait=0` that often and counts the assignments (it computes none:
`phalanx sim --compute` does, with the light phones of `phalanx.sim.fleet`).

What differs from real phones: connections are shared, so the server sees a few hundred
keep-alive connections rather than one per phone (a real phone beating every 60 s opens a new
connection each time: the server's keep-alive is 5 s); and no phone holds a work long poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import random
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from agent import __version__
from agent.runtime.agent import FEATURES
from engine.models import ARCHS, CUSTOM
from phalanx.sim.fleet import this_class
from phalanx.sim.profiles import fleet_mix
from phalanx.sim.rawhttp import Connection, Response, TransportError, connect, encode_request
from phalanx.sim.swarm_stats import SwarmStats

NEW, ACTIVE, STOPPED = 0, 1, 2  # a phone's state
BEAT, WORK = 0, 1  # what a timer entry is for (key = phone * 2 + kind)
BATCH = 100  # samples per heartbeat request (agent.runtime.heartbeat.BATCH)
BUFFER = 1000  # samples a phone keeps while the server is away (TelemetryBuffer's maxlen)
TOKENS_PER = 10_000  # phones per enrollment token the swarm makes (a registration locks its row)
IDLE_S = 4.0  # a connection idle this long is replaced (uvicorn closes idle ones after 5 s)


SWARM_ABOVE = 1_000  # phones: `phalanx sim --mode auto` runs a swarm above this many


def swarm_mode(mode: str, opts: Any) -> bool:
    """Whether `phalanx sim --mode` (auto, light or swarm) runs a swarm for these
    `phalanx.sim.fleet.FleetOptions`: auto does above SWARM_ABOVE phones unless they compute
    or follow a job (the light phones do)."""
    computes = opts.compute or opts.job is not None
    if mode == "swarm":
        if computes:
            raise SystemExit("--mode swarm does not compute: use --mode light with --compute/--job")
        return True
    if mode not in ("auto", "light"):
        raise SystemExit(f"--mode is auto, light or swarm, not {mode!r}")
    return mode == "auto" and opts.phones > SWARM_ABOVE and not computes


@dataclass
class SwarmOptions:
    server: str
    phones: int = 100_000
    duration_s: float = 60.0
    interval_s: float | None = None  # None: what the server answers at enrollment
    enroll_token: str | None = None
    admin_token: str | None = None  # makes the enrollment tokens, and cleans up
    connections: int = 256
    jitter: float = 0.05  # each wait is the interval times uniform(1 - jitter, 1 + jitter)
    work_every_s: float = 0.0  # 0: no work polls
    timeout_s: float = 30.0
    beats: int = 0  # > 0: stop once every phone has had this many heartbeats accepted
    enroll_first: bool = True  # every phone enrolls before any heartbeats (else each at once)
    seed: int = 0
    cleanup: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    stop: threading.Event | None = None
    json_progress: bool = False  # one JSON line a second on stderr (else a text line each 5 s)
    progress: Callable[[str], None] | None = None  # where progress lines go (default stderr)

    @classmethod
    def from_fleet(cls, opts: Any, **extra: Any) -> SwarmOptions:
        """From `phalanx.sim.fleet.FleetOptions` (the command line's options)."""
        return cls(server=opts.server, phones=opts.phones, duration_s=opts.duration_s,
                   interval_s=opts.interval_s, enroll_token=opts.enroll_token,
                   admin_token=opts.admin_token, connections=opts.concurrency, seed=opts.seed,
                   cleanup=opts.cleanup, labels=dict(opts.labels), stop=opts.stop, **extra)


class PhoneTable:
    """Every phone's state, one array (or list) per field, indexed by the phone's number."""

    __slots__ = ("n", "ids", "tokens", "state", "failures", "unsent", "battery", "temp",
                 "charging", "last_ok", "accepted")

    def __init__(self, n: int, rng: random.Random) -> None:
        self.n = n
        self.ids: list[bytes | None] = [None] * n
        self.tokens: list[bytes | None] = [None] * n
        self.state = bytearray(n)
        self.failures = bytearray(n)  # failed attempts in a row (capped at 255)
        self.unsent = array("H", bytes(2 * n))  # samples taken and not yet accepted
        self.battery = array("f", (rng.uniform(30, 100) for _ in range(n)))
        self.temp = array("f", (rng.uniform(28, 38) for _ in range(n)))
        self.charging = bytearray(rng.random() < 0.8 for _ in range(n))
        self.last_ok = array("d", bytes(8 * n))  # monotonic time of the last accepted beat
        self.accepted = array("I", bytes(4 * n))  # heartbeats accepted


SAMPLE = (b'{"ts":%.3f,"battery_pct":%.1f,"charging":%s,"battery_temp_c":%.1f,'
          b'"cpu_temp_c":%.1f,"power_w":%.2f,"cpu_freq_mhz":%.1f,"throttled":false,"busy":false}')


def heartbeat_tail() -> bytes:
    """What follows the samples in every phone's heartbeat: what a fresh agent sends."""
    caps: dict[str, Any] = {"backends": ["numpy"], "archs": [*ARCHS, CUSTOM],
                            "features": list(FEATURES)}
    if (facts := this_class()) is not None:
        caps["compute_class"] = facts
    rest = {"agent_version": __version__, "capabilities": caps, "profiles": {}, "pause": None}
    return b"]," + json.dumps(rest, separators=(",", ":")).encode()[1:]


class Swarm:
    def __init__(self, opts: SwarmOptions) -> None:
        url = urlsplit(opts.server.rstrip("/"))
        if url.scheme != "http":
            raise SystemExit("the swarm speaks plain http:// (no TLS); use --mode light")
        self.opts = opts
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.host_header = url.netloc.encode()
        self.prefix = url.path.encode()
        self.rng = random.Random(opts.seed)
        self.run_id = f"swarm{random.Random().getrandbits(24):06x}"
        self.phones = PhoneTable(opts.phones, self.rng)
        self.specs = self._specs(opts.phones)
        self.stats = SwarmStats()
        self.interval_s = opts.interval_s or 10.0
        self.heap: list[tuple[float, int]] = []
        self.ready: deque[tuple[float, int]] = deque()
        self.to_enroll: deque[int] = deque(range(opts.phones))
        self.idle: deque[asyncio.Future[None]] = deque()
        self.stopping = False
        # registrations take at most half the connections, and an eighth even while heartbeats
        # wait: the enrolled phones keep their beat, and enrollment goes on if the server lags
        self.enroll_slots, self.enrolling = max(1, opts.connections // 2), 0
        self.enroll_floor = max(1, opts.connections // 8)
        self.enroll_tokens: list[str] = [opts.enroll_token] if opts.enroll_token else []
        self.failing = 0  # phones whose last attempt failed
        self.beaten = 0  # phones with `opts.beats` heartbeats accepted
        self.enrolled_idle: list[int] = []  # enrolled, waiting for the rest (enroll_first)
        self.retrying = 0  # registrations waiting for their backoff
        self.stopped = 0
        self.tail = heartbeat_tail()
        self.labels = json.dumps({"sim": self.run_id, **opts.labels}).encode()

    def _specs(self, n: int) -> list[bytes]:
        """Each phone's hardware spec (JSON), from the simulated profiles' mix."""
        cache: dict[str, bytes] = {}
        out = []
        for profile in fleet_mix(n):
            if profile.key not in cache:
                cache[profile.key] = json.dumps(profile.hardware_spec()).encode()
            out.append(cache[profile.key])
        return out

    # -- dispatch ----------------------------------------------------------------------------
    def _wake(self) -> None:
        while self.idle and (self.ready or self.stopping or (
                self.to_enroll and self.enrolling < self.enroll_slots)):
            waiter = self.idle.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def schedule(self, at: float, key: int) -> None:
        heapq.heappush(self.heap, (at, key))

    async def _next(self) -> tuple[float, int] | None:
        """The next due entry, a phone to enroll as (0.0, -1 - phone), or None when stopping."""
        while not self.stopping:
            if self.to_enroll and (self.enrolling < self.enroll_floor or (
                    not self.ready and self.enrolling < self.enroll_slots)):
                self.enrolling += 1
                return 0.0, -1 - self.to_enroll.popleft()
            if self.ready:
                return self.ready.popleft()
            waiter = asyncio.get_running_loop().create_future()
            self.idle.append(waiter)
            await waiter
        return None

    async def _ticker(self) -> None:
        heap, ready = self.heap, self.ready
        while not self.stopping:
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                ready.append(heapq.heappop(heap))
            if ready:
                self._wake()
            wait = heap[0][0] - now if heap else 0.05
            await asyncio.sleep(min(max(wait, 0.002), 0.05))

    async def _worker(self) -> None:
        conn: Connection | None = None
        while (entry := await self._next()) is not None:
            due, key = entry
            if key < 0:
                try:
                    conn = await self._register(conn, -1 - key)
                finally:
                    self.enrolling -= 1
                if self.to_enroll:
                    self._wake()
                self._start_when_all_enrolled()
                continue
            self.stats.record_lag(max(0.0, time.monotonic() - due))
            phone, kind = divmod(key, 2)
            if self.phones.state[phone] != ACTIVE:
                continue
            conn = await (self._beat(conn, phone) if kind == BEAT else self._poll(conn, phone))
        if conn is not None:
            conn.close()

    # -- one exchange ------------------------------------------------------------------------
    async def _exchange(self, conn: Connection | None, data: bytes
                        ) -> tuple[Response | None, str, float, Connection | None]:
        """Send on `conn` (a new connection if it is closed or idle too long); the answer (or
        None), its status or error kind, the seconds it took, and the connection to use next."""
        started = time.monotonic()
        try:
            if conn is None or conn.closed or started - conn.used_at > IDLE_S:
                if conn is not None:
                    conn.close()
                conn = await connect(self.host, self.port, self.opts.timeout_s)
            try:
                resp = await conn.request(data, self.opts.timeout_s)
            except TransportError as exc:  # a kept-alive connection closed meanwhile: once more
                if conn.requests == 0 or exc.kind not in ("closed", "reset"):
                    raise
                conn = await connect(self.host, self.port, self.opts.timeout_s)
                resp = await conn.request(data, self.opts.timeout_s)
        except TransportError as exc:
            if conn is not None:
                conn.close()
            return None, exc.kind, time.monotonic() - started, None
        conn.used_at = time.monotonic()
        return resp, str(resp.status), conn.used_at - started, conn

    def _note(self, key: str, resp: Response | None) -> None:
        if resp is not None and key not in self.stats.notes:
            self.stats.notes[key] = resp.body[:300].decode("utf-8", "replace")

    # -- enrollment --------------------------------------------------------------------------
    async def _register(self, conn: Connection | None, i: int) -> Connection | None:
        p = self.phones
        token = self.enroll_tokens[i % len(self.enroll_tokens)]
        body = b'{"enrollment_token":%s,"name":"%s-%06d","labels":%s,"spec":%s}' % (
            json.dumps(token).encode(), self.run_id.encode(), i, self.labels, self.specs[i])
        data = encode_request("POST", "/v1/devices/register", self.host_header.decode(),
                              body=body)
        resp, status, took, conn = await self._exchange(conn, self.prefix_request(data))
        self.stats.record("register", status, took if resp is not None else None)
        if resp is not None and resp.status == 201:
            reply = json.loads(resp.body)
            p.ids[i], p.tokens[i] = reply["device_id"].encode(), reply["device_token"].encode()
            p.state[i], p.failures[i] = ACTIVE, 0
            if self.opts.interval_s is None:
                self.interval_s = float(reply.get("heartbeat_interval_s") or self.interval_s)
            self.stats.enrolled += 1
            if self.opts.enroll_first:
                self.enrolled_idle.append(i)
            else:
                self._start(i, time.monotonic())
        elif resp is None or resp.status >= 500 or resp.status == 429:
            self.stats.retries += 1
            self.retrying += 1
            p.failures[i] = min(255, p.failures[i] + 1)
            asyncio.get_running_loop().call_later(self._backoff(p.failures[i], 0.5, 30.0),
                                                  self._enroll_again, i)
        else:  # refused for good (a used-up or revoked enrollment token)
            self._note(f"register: {status}", resp)
            p.state[i] = STOPPED
            self.stopped += 1
        return conn

    def _start(self, i: int, now: float) -> None:
        """The phone's first heartbeat (and work poll) at a random offset within one period."""
        self.schedule(now + self.rng.uniform(0, self.interval_s), 2 * i + BEAT)
        if self.opts.work_every_s > 0:
            self.schedule(now + self.rng.uniform(0, self.opts.work_every_s), 2 * i + WORK)

    def _start_when_all_enrolled(self) -> None:
        if self.enrolled_idle and not (self.to_enroll or self.enrolling or self.retrying):
            now = time.monotonic()
            for i in self.enrolled_idle:
                self._start(i, now)
            self.enrolled_idle = []

    def _enroll_again(self, i: int) -> None:
        self.retrying -= 1
        if not self.stopping:
            self.to_enroll.append(i)
            self._wake()

    def prefix_request(self, data: bytes) -> bytes:
        """A server URL with a path (behind a proxy): every request path under it."""
        if not self.prefix:
            return data
        method, _, rest = data.partition(b" ")
        return method + b" " + self.prefix + rest

    # -- heartbeats and work polls -----------------------------------------------------------
    def _backoff(self, failures: int, base_s: float, cap_s: float) -> float:
        """agent.client.Backoff: uniform(0, min(cap, base * 2**attempt)), attempt from 0."""
        return self.rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(failures - 1, 62)))

    def _samples(self, i: int, n: int) -> bytes:
        """This phone's `n` oldest unsent samples (one per attempt, an interval apart) after a
        step of its physics: a battery that charges or drains, a temperature that wanders."""
        p = self.phones
        charging = p.charging[i]
        battery = min(100.0, max(1.0, p.battery[i] + (0.3 if charging else -0.2)))
        temp = min(48.0, max(24.0, p.temp[i] + self.rng.uniform(-0.8, 0.8)))
        p.battery[i], p.temp[i] = battery, temp
        flag = b"true" if charging else b"false"
        now, step = time.time(), self.interval_s
        return b",".join(SAMPLE % (now - (n - 1 - k) * step, battery, flag, temp - 2.0, temp,
                                   1.2 + 0.05 * (temp - 24.0), 1785.6)
                         for k in range(n))

    async def _beat(self, conn: Connection | None, i: int) -> Connection | None:
        p = self.phones
        unsent = min(BUFFER, p.unsent[i] + 1)
        p.unsent[i] = unsent
        body = b'{"telemetry":[' + self._samples(i, min(unsent, BATCH)) + self.tail
        data = b"POST %s/v1/devices/%s/heartbeat HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s" \
               b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
                   self.prefix, p.ids[i], self.host_header, p.tokens[i], len(body), body)
        resp, status, took, conn = await self._exchange(conn, data)
        self.stats.record("heartbeat", status, took if resp is not None else None)
        now = time.monotonic()
        if resp is not None and resp.status == 200:
            self._beat_accepted(i, resp, now)
        elif resp is None or resp.status >= 500 or resp.status == 429:
            self.stats.retries += 1
            if p.failures[i] == 0:
                self.failing += 1
            p.failures[i] = min(255, p.failures[i] + 1)
            wait = min(self._backoff(p.failures[i], 1.0, 60.0), 6 * self.interval_s)
            self.schedule(now + wait, 2 * i + BEAT)
        elif resp.status == 401:  # revoked or deleted: the agent stops for good
            self._note("heartbeat: 401", resp)
            self._stop_phone(i)
        else:  # the server will never take this batch: the agent drops it
            self._note(f"heartbeat: {status}", resp)
            p.unsent[i] = max(0, unsent - BATCH)
            self.schedule(now + self._interval(), 2 * i + BEAT)
        return conn

    def _beat_accepted(self, i: int, resp: Response, now: float) -> None:
        p = self.phones
        if p.failures[i]:
            self.failing -= 1
            p.failures[i] = 0
        p.unsent[i] = max(0, p.unsent[i] - BATCH)
        p.last_ok[i] = now
        p.accepted[i] += 1
        if p.accepted[i] == self.opts.beats:
            self.beaten += 1
        reply = json.loads(resp.body)
        self.stats.states[str(reply.get("state"))] += 1
        interval = reply.get("heartbeat_interval_s")
        if isinstance(interval, (int, float)) and 0.05 <= interval <= 3600:
            self.interval_s = float(interval)
        for cmd in reply.get("commands") or ():
            self.stats.commands[str(cmd.get("type")) if isinstance(cmd, dict) else "?"] += 1
        # more samples waiting (an outage's backlog): the next batch at once, as the agent does
        self.schedule(now if p.unsent[i] else now + self._interval(), 2 * i + BEAT)

    def _interval(self) -> float:
        j = self.opts.jitter
        return self.interval_s * self.rng.uniform(1.0 - j, 1.0 + j)

    def _stop_phone(self, i: int) -> None:
        if self.phones.failures[i]:
            self.failing -= 1
        self.phones.state[i] = STOPPED
        self.stopped += 1

    async def _poll(self, conn: Connection | None, i: int) -> Connection | None:
        p = self.phones
        data = b"GET %s/v1/devices/%s/work?wait=0 HTTP/1.1\r\nHost: %s\r\n" \
               b"Authorization: Bearer %s\r\n\r\n" % (self.prefix, p.ids[i], self.host_header,
                                                       p.tokens[i])
        resp, status, took, conn = await self._exchange(conn, data)
        self.stats.record("work", status, took if resp is not None else None)
        every = self.opts.work_every_s
        if resp is not None and resp.status == 200:
            if json.loads(resp.body).get("assignment"):
                self.stats.assignments += 1
            wait = every * self.rng.uniform(1.0 - self.opts.jitter, 1.0 + self.opts.jitter)
        elif resp is not None and resp.status == 401:
            self._note("work: 401", resp)
            return conn
        else:
            self._note(f"work: {status}", resp)
            wait = min(self._backoff(max(1, p.failures[i]), 1.0, 60.0), 6 * every)
        self.schedule(time.monotonic() + wait, 2 * i + WORK)
        return conn

    # -- the run -----------------------------------------------------------------------------
    async def _admin(self, method: str, path: str, body: Any = None) -> Response:
        if not self.opts.admin_token:
            raise SystemExit("phalanx sim needs an admin token (--token) or --enroll-token")
        raw = json.dumps(body).encode() if body is not None else None
        data = encode_request(method, path, self.host_header.decode(),
                              {"Authorization": f"Bearer {self.opts.admin_token}"}, raw)
        for attempt in range(3):
            resp, status, _, conn = await self._exchange(None, self.prefix_request(data))
            if conn is not None:
                conn.close()
            if resp is not None:
                return resp
            await asyncio.sleep(0.5 * (attempt + 1))
        raise SystemExit(f"cannot reach {self.opts.server}: {status}")

    async def prepare(self) -> None:
        """Enrollment tokens: the one given, or one per 10,000 phones (at most 16), so that
        concurrent registrations do not queue on one token's row."""
        if self.enroll_tokens:
            return
        for k in range(min(16, max(1, math.ceil(self.opts.phones / TOKENS_PER)))):
            resp = await self._admin("POST", "/v1/enrollment-tokens", {
                "description": f"phalanx sim {self.run_id} ({k})", "labels": {"sim": self.run_id}})
            if resp.status != 201:
                raise SystemExit(f"cannot create an enrollment token: HTTP {resp.status} "
                                 f"{resp.body[:300].decode('utf-8', 'replace')}")
            self.enroll_tokens.append(json.loads(resp.body)["token"])

    def _done(self, deadline: float) -> bool:
        if time.monotonic() >= deadline:
            return True
        stop = self.opts.stop
        return (stop is not None and stop.is_set()) or self.stopped == self.opts.phones or (
            self.opts.beats > 0 and self.beaten + self.stopped >= self.opts.phones)

    def _progress_line(self) -> None:
        line = self.stats.roll(active=self.stats.enrolled - self.stopped, failing=self.failing,
                               backlog=len(self.ready), to_enroll=len(self.to_enroll),
                               connections=self.opts.connections)
        out = self.opts.progress or (lambda text: print(text, file=sys.stderr, flush=True))
        if self.opts.json_progress:
            out(json.dumps(line))
            return
        ms = line["heartbeat_ms"]
        out(f"{line['t']:6.0f}s  enrolled {line['enrolled']:6d}  heartbeats "
            f"{line['heartbeats_per_s']:7.1f}/s  p50 {ms.get('p50', 0):7.1f} ms  p99 "
            f"{ms.get('p99', 0):7.1f} ms  failing {line['failing']:6d}  backlog "
            f"{line['backlog']:5d}  cpu {line['cpu']:.2f}  {line['statuses']}")

    async def run(self) -> dict[str, Any]:
        await self.prepare()
        self.stats = SwarmStats()
        ticker = asyncio.create_task(self._ticker())
        workers = [asyncio.create_task(self._worker()) for _ in range(self.opts.connections)]
        every = 1.0 if self.opts.json_progress else 5.0
        deadline = time.monotonic() + self.opts.duration_s
        next_line = time.monotonic() + every
        while not self._done(deadline):
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= next_line:
                self._progress_line()
                next_line += every
        self.stats.finished = time.monotonic()
        self.stopping = True
        self._wake()
        ticker.cancel()
        done, pending = await asyncio.wait(workers, timeout=self.opts.timeout_s + 5)
        for task in pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        report = self.stats.report()
        report.update(phones=self.opts.phones, phones_stopped=self.stopped,
                      phones_failing=self.failing, connections=self.opts.connections,
                      interval_s=self.interval_s)
        if self.opts.cleanup and self.opts.admin_token:
            failures = await self.cleanup()
            report["cleanup_errors"] = len(failures)
            report["cleanup_failures"] = failures[:10]
        return report

    async def cleanup(self) -> list[str]:
        """Delete the devices this run enrolled; why each failed delete failed."""
        ids = deque(d for d in self.phones.ids if d is not None)
        failures: list[str] = []
        auth = f"Bearer {self.opts.admin_token}".encode()

        async def deleter() -> None:
            conn: Connection | None = None
            while ids:
                device = ids.popleft()
                data = b"DELETE %s/v1/devices/%s HTTP/1.1\r\nHost: %s\r\nAuthorization: %s" \
                       b"\r\n\r\n" % (self.prefix, device, self.host_header, auth)
                for _ in range(3):  # DELETE is idempotent: a 404 is done
                    resp, status, _, conn = await self._exchange(conn, data)
                    if resp is not None:
                        break
                if resp is None or (resp.status >= 300 and resp.status != 404):
                    failures.append(f"{device.decode()}: {status}")
            if conn is not None:
                conn.close()

        await asyncio.gather(*(deleter() for _ in range(min(64, self.opts.connections))))
        return failures


def run_swarm(opts: SwarmOptions) -> dict[str, Any]:
    """Run the swarm on this thread's new event loop (uvloop's when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(Swarm(opts).run())
    return uvloop.run(Swarm(opts).run())
