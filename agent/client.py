"""The agent's HTTP client: stdlib, sync, connections kept alive (agent.transport), one small
exception tree (after httpx).

    ClientError
    ├── TransportError          the request may not have reached the server: retry with backoff
    │   └── RequestTimeout
    └── StatusError             the server answered 4xx/5xx (.status, .detail)
        ├── Unauthorized        401: token revoked or device deleted: stop
        ├── Conflict            409: e.g. a step that is no longer current
        └── ServerError         5xx or 429: retry with backoff

Low-level errors (socket errors, timeouts, HTTPException, bad JSON) are translated in `_send`
only. `Backoff` is full-jitter exponential backoff (AWS architecture blog): a delay drawn
uniformly from [0, min(cap, base * 2**attempt)], so a fleet reconnecting after a control-plane
restart spreads out instead of retrying in lockstep.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import urllib.parse
from dataclasses import dataclass
from typing import Any

from agent import __version__
from agent.transport import Body, KeepAliveTransport, Transport
from wire.assignment import Assignment
from wire.messages import WireError
from wire.sockopts import DEFAULT_SOCKET_BUFFER_BYTES


class ClientError(Exception):
    """Any failure talking to the control plane."""


class TransportError(ClientError):
    """No usable answer: refused, reset, DNS, TLS, garbled reply."""


class RequestTimeout(TransportError):
    pass


class StatusError(ClientError):
    def __init__(self, status: int, detail: Any, url: str) -> None:
        super().__init__(f"{status} from {url}: {detail}")
        self.status, self.detail, self.url = status, detail, url


class Unauthorized(StatusError):
    pass


def revoked_message(exc: Unauthorized) -> str:
    """What a person must read when the control plane refuses this device's token."""
    return (f"the control plane refused this device's token ({exc.detail}): the token was "
            "revoked, ended (replaced by a rotation this agent never saved), or the device "
            "deleted; enroll again with `phalanx-agent enroll`")


class Conflict(StatusError):
    pass


class ServerError(StatusError):
    pass


RETRYABLE = (TransportError, ServerError)

log = logging.getLogger(__name__)
# the most a phone holds of one answer: control-plane JSON is small; weights and shard data are
# model- or shard-sized (engine.graph.MAX_PARAMS float32 parameters, plus buffers and framing)
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_ARRAYS_BYTES = 1024 * 1024 * 1024


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes | memoryview  # big binary answers: a pooled buffer (agent.transport)

    def json(self) -> Any:
        try:  # a pooled body (binary: a server or proxy answering JSON routes with octets)
            return json.loads(bytes(self.body) if isinstance(self.body, memoryview) else self.body)
        except ValueError:
            raise TransportError(f"server sent invalid JSON ({len(self.body)} bytes)") from None


def _status_error(status: int, detail: Any, url: str) -> StatusError:
    if status == 401:
        return Unauthorized(status, detail, url)
    if status == 409:
        return Conflict(status, detail, url)
    if status >= 500 or status == 429:  # 429: the server is busy with this device's others
        return ServerError(status, detail, url)
    return StatusError(status, detail, url)


class Client:
    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = 30.0,
                 transport: Transport | None = None,
                 socket_buffer_bytes: int = DEFAULT_SOCKET_BUFFER_BYTES,
                 ca_file: str | None = None) -> None:
        scheme = urllib.parse.urlsplit(base_url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"server URL must be http(s)://..., got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.transport = transport or KeepAliveTransport(socket_buffer_bytes, ca_file)
        self._refused_downgrade = False

    # -- plumbing --------------------------------------------------------------------------
    def _send(self, method: str, path: str, *, json_body: Any = None, body: Body | None = None,
              content_type: str = "application/octet-stream", timeout_s: float | None = None,
              base_url: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> Response:
        url = (base_url or self.base_url) + path
        headers = {"User-Agent": f"phalanx-agent/{__version__}", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if json_body is not None:
            body, content_type = json.dumps(json_body).encode(), "application/json"
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            resp = Response(*self.transport(method, url, headers, body,
                                            timeout_s or self.timeout_s, max_bytes))
        except TimeoutError as exc:
            raise RequestTimeout(f"{method} {url} timed out") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:  # AnswerTooLarge too
            raise TransportError(f"{method} {url}: {exc!r}") from exc
        if resp.status >= 400:
            raise _status_error(resp.status, _detail(resp), url)
        return resp

    # -- the API ---------------------------------------------------------------------------
    def register(self, enrollment_token: str, name: str, labels: dict[str, str],
                 spec: dict[str, Any]) -> dict[str, Any]:
        body = {"enrollment_token": enrollment_token, "name": name, "labels": labels, "spec": spec}
        return self._send("POST", "/v1/devices/register", json_body=body).json()

    def heartbeat(self, device_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._send("POST", f"/v1/devices/{_q(device_id)}/heartbeat", json_body=body).json()

    def rotate_token(self, device_id: str) -> dict[str, Any]:
        """A new device token (the one asking keeps working for the server's grace period)."""
        return self._send("POST", f"/v1/devices/{_q(device_id)}/token", json_body={}).json()

    def ship_logs(self, device_id: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
        """The agent's recent log lines, answering an operator's request."""
        return self._send("POST", f"/v1/devices/{_q(device_id)}/logs",
                          json_body={"lines": lines}).json()

    def report_upgrade(self, device_id: str, version: str, outcome: str,
                       detail: str) -> dict[str, Any]:
        """An agent build this phone could not install, or rolled back (outcome)."""
        return self._send("POST", f"/v1/devices/{_q(device_id)}/upgrade-report",
                          json_body={"version": version, "outcome": outcome,
                                     "detail": detail[:2000]}).json()

    def agent_archive(self, path: str, max_bytes: int) -> tuple[bytes, str | None]:
        """The agent archive a rollout names, from this server only (a path, not a URL), and
        its release signature (header X-Phalanx-Release-Signature; None when absent): the
        upgrader checks both before anything is unpacked (agent.release)."""
        if not path.startswith("/") or path.startswith("//"):
            raise ValueError(f"agent archive path {path!r}: must be a path on this server")
        resp = self._send("GET", path, max_bytes=max_bytes)
        signature = {k.lower(): v for k, v in resp.headers.items()}.get(
            "x-phalanx-release-signature")
        return bytes(resp.body), signature

    @property
    def over_https(self) -> bool:
        """Whether this client talks to its server over TLS (the server's certificate then
        authenticates what it answers)."""
        return urllib.parse.urlsplit(self.base_url).scheme.lower() == "https"

    def work(self, device_id: str, wait_s: float) -> Assignment | None:
        """This step's work for the device, or None; an assignment this agent cannot read is
        a TransportError naming what differs (retried: a server mid-upgrade)."""
        resp = self._send("GET", f"/v1/devices/{_q(device_id)}/work?wait={wait_s:g}",
                          timeout_s=wait_s + self.timeout_s)
        answer = resp.json()
        found = answer.get("assignment") if isinstance(answer, dict) else None
        if found is None:
            return None
        try:
            return Assignment.from_json(found)
        except WireError as exc:
            raise TransportError(f"unreadable work assignment: {exc}") from None

    def weights(self, job_id: str, step: int, bulk_url: str | None = None
                ) -> bytes | memoryview:
        """From the API, or from the bulk listener at `bulk_url` (the assignment names it)."""
        path = f"/v1/jobs/{_q(job_id)}/weights?step={int(step)}"
        return self._send("GET", path, base_url=self._bulk_base(bulk_url),
                          max_bytes=MAX_ARRAYS_BYTES).body

    def weights_slice(self, job_id: str, step: int, part: int, bulk_url: str | None = None,
                      wait_s: float = 0.0) -> tuple[bytes | memoryview, str | None]:
        """Slice `part`'s weights message of a sliced job and the state it is (its nonce);
        `wait_s`: wait that long for a slice of the next step to be applied (the API port)."""
        path = f"/v1/jobs/{_q(job_id)}/weights?step={int(step)}&slice={int(part)}"
        if wait_s:
            path += f"&wait={wait_s:g}"
        resp = self._send("GET", path, base_url=self._bulk_base(bulk_url),
                          max_bytes=MAX_ARRAYS_BYTES, timeout_s=self.timeout_s + wait_s)
        state = {k.lower(): v for k, v in resp.headers.items()}.get("x-phalanx-state")
        return resp.body, state

    def shard_data(self, job_id: str, shard: int, start: int = 0
                   ) -> tuple[bytes | memoryview, int | None]:
        """A chunk of the shard's samples from `start` on, as stored (the phone normalizes
        them: engine.stored.normalize), and the shard's sample count; None from a server
        before chunks, which answers with the whole shard, normalized."""
        resp = self._send("GET", f"/v1/jobs/{_q(job_id)}/shards/{int(shard)}/data"
                          f"?start={int(start)}&encoding=raw", max_bytes=MAX_ARRAYS_BYTES)
        total = {k.lower(): v for k, v in resp.headers.items()}.get("x-phalanx-shard-samples")
        try:
            return resp.body, int(total) if total is not None else None
        except ValueError:
            raise TransportError(f"bad X-Phalanx-Shard-Samples: {total!r}") from None

    def report_diverged(self, job_id: str, step: int, shard: int, reason: str,
                        kind: str = "diverged") -> dict[str, Any]:
        """The job's current step has no result for `shard` on any phone (`kind`: diverged, not
        finite; compute_error, the engine raised the same error on every try): the server fails
        the job."""
        path = f"/v1/jobs/{_q(job_id)}/steps/{int(step)}/diverged"
        body: dict[str, Any] = {"shard": int(shard), "reason": reason[:500]}
        if kind != "diverged":  # an older server knows only the default
            body["kind"] = kind
        return self._send("POST", path, json_body=body).json()

    def upload_gradients(self, job_id: str, step: int, body: Body,
                         bulk_url: str | None = None) -> dict[str, Any]:
        """To the API, or to the bulk listener at `bulk_url` (the assignment names it); `body`
        in one piece or in parts (`wire.messages.encode_results_parts`)."""
        path = f"/v1/jobs/{_q(job_id)}/steps/{int(step)}/gradients"
        return self._send("POST", path, body=body, base_url=self._bulk_base(bulk_url)).json()

    def _bulk_base(self, bulk_url: str | None) -> str | None:
        """The bulk listener's base URL, or None (the API) when using it would step down from
        https to plain http: the server's word is no reason to send tokens in clear."""
        base = _base(bulk_url)
        if base is not None and urllib.parse.urlsplit(self.base_url).scheme == "https" \
                and urllib.parse.urlsplit(base).scheme != "https":
            if not self._refused_downgrade:
                log.warning("the server named a plain-http bulk URL (%s) for this https agent: "
                            "weights and uploads go through the API's https instead", base)
                self._refused_downgrade = True
            return None
        return base


def _base(url: str | None) -> str | None:
    if url is not None and urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"bulk URL must be http(s)://..., got {url!r}")
    return url.rstrip("/") if url else None


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _detail(resp: Response) -> Any:
    try:
        data = json.loads(resp.body)
    except ValueError:
        return resp.body[:200].decode("utf-8", errors="replace")
    return data.get("detail", data) if isinstance(data, dict) else data


class Backoff:
    """Full-jitter exponential backoff: `delay()` then `reset()` after a success."""

    def __init__(self, base_s: float = 0.5, cap_s: float = 60.0,
                 rng: random.Random | None = None) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self.rng = rng or random.Random()  # seeded from os.urandom: no two agents alike
        self.attempt = 0

    def delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.attempt, 62))
        self.attempt += 1
        return self.rng.uniform(0.0, ceiling)

    def reset(self) -> None:
        self.attempt = 0
