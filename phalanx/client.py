"""The user's HTTP client for a Phalanx control plane (DESIGN.md, "User-facing contract").

One exception type, `PhalanxError`, for everything that can go wrong: the server's `detail`
(4xx/5xx), an unreachable server, a response that is not what the contract says. The CLI turns
it into one line and a non-zero exit.

Where the server and token come from (`resolve_target`): explicit arguments (the CLI's flags,
which typer also fills from `PHALANX_SERVER` / `PHALANX_TOKEN`), then the config file that
`phalanx login` writes (`$PHALANX_CONFIG`, else `$XDG_CONFIG_HOME/phalanx/config.json`, else
`~/.config/phalanx/config.json`; mode 0600).
"""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)


class PhalanxError(Exception):
    """A failed call: `status` is the HTTP status (None when no answer came), `detail` the
    server's `detail` as sent."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class Unreachable(PhalanxError):
    """No answer: the server is down, unreachable, or too slow."""


class NoServer(PhalanxError):
    """Nothing says which server to talk to."""



def format_detail(detail: Any) -> str:
    """FastAPI's `detail`: a string, or a list of validation errors naming their fields."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for err in detail:
            if isinstance(err, dict) and "msg" in err:
                loc = [str(p) for p in err.get("loc", []) if p not in ("body", "query", "path")]
                parts.append(f"{'.'.join(loc)}: {err['msg']}" if loc else str(err["msg"]))
            else:
                parts.append(str(err))
        return "; ".join(parts)
    return json.dumps(detail) if detail is not None else ""


# -- where to talk to ------------------------------------------------------------------------

def config_path() -> Path:
    if os.environ.get("PHALANX_CONFIG"):
        return Path(os.environ["PHALANX_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "phalanx" / "config.json"


DEFAULT_CONTEXT = "default"
COMPLETE_TIMEOUT_S = 3600.0  # completing an upload: hashing and unpacking a file of GiBs


@dataclass
class Contexts:
    """The login file, as kubeconfig keeps clusters: named contexts (server, token, CA) and
    the current one. A file from before contexts (one server and token) reads as "default"."""

    contexts: dict[str, dict[str, Any]]
    current: str | None

    @classmethod
    def load(cls, path: Path | None = None) -> Contexts:
        path = path or config_path()
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls({}, None)
        except (OSError, ValueError) as exc:
            raise PhalanxError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            return cls({}, None)
        if "contexts" not in data:  # the flat file of one login
            return cls({DEFAULT_CONTEXT: data}, DEFAULT_CONTEXT) if data else cls({}, None)
        return cls(dict(data.get("contexts") or {}), data.get("current-context"))

    def selected(self) -> dict[str, Any]:
        """The context PHALANX_CONTEXT names, else the current one (empty: none)."""
        asked = os.environ.get("PHALANX_CONTEXT")
        if asked and asked not in self.contexts:
            raise PhalanxError(f"no context {asked!r} (phalanx config get-contexts lists them)")
        return self.contexts.get(asked or self.current or "", {})

    def save(self, path: Path | None = None) -> Path:
        """Written readable by its owner only (created 0600, never world-readable)."""
        path = path or config_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"current-context": self.current, "contexts": self.contexts}, fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The selected context's server, token and CA file."""
    return Contexts.load(path).selected()


def save_config(server: str, token: str, path: Path | None = None,
                ca_file: str | None = None, context: str | None = None) -> Path:
    """Save a login as `context` (default: the current one, else "default") and make it the
    current context."""
    saved = Contexts.load(path)
    name = context or saved.current or DEFAULT_CONTEXT
    saved.contexts[name] = {"server": server, "token": token,
                            **({"ca_file": ca_file} if ca_file else {})}
    saved.current = name
    return saved.save(path)


@dataclass(frozen=True)
class InstallPins:
    install_sh: str
    archive: str


def install_line(server: str, enroll_token: str, pins: InstallPins,
                 ca_file: str | None = None) -> str:
    """The Termux one-liner: the script and the agent archive are checked against the hashes the
    admin's CLI saw (a lab network in between cannot swap either). `ca_file`: the server's
    certificate is the lab's own, copied to the phone as `server.pem` beside the line."""
    cacert = "--cacert server.pem " if ca_file else ""
    ca = " --ca-file server.pem" if ca_file else ""
    return (f"curl -fsSL {cacert}-o install.sh {server}/install.sh && echo \"{pins.install_sh}  "
            f"install.sh\" | sha256sum -c && bash install.sh --server {server} --token "
            f"{enroll_token} --sha256 {pins.archive}{ca}")


@dataclass(frozen=True)
class Target:
    server: str
    token: str | None
    ca_file: str | None = None  # https with a lab's own CA (PHALANX_CA_FILE, `login --ca-file`)


def resolve_target(server: str | None = None, token: str | None = None) -> Target:
    saved = load_config() if server is None or token is None else {}
    if server and saved.get("server") and server.rstrip("/") != saved["server"].rstrip("/"):
        saved = {}  # another server than the saved one: its token and CA are not for this one
    server = server or saved.get("server")
    if not server:
        raise NoServer("no server configured: run `phalanx login --server URL` (or pass "
                       "--server, or set PHALANX_SERVER)")
    token = token or saved.get("token")
    ca_file = os.environ.get("PHALANX_CA_FILE") or saved.get("ca_file")
    return Target(server.rstrip("/"), token, ca_file)


# -- the client ------------------------------------------------------------------------------

def _items(data: Any, key: str) -> list[dict[str, Any]]:
    """Lists come as a JSON array or as `{key: [...]}` / `{"items": [...]}`."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for k in (key, "items"):
            if isinstance(data.get(k), list):
                return data[k]
    raise PhalanxError(f"unexpected response shape for a list of {key}: {str(data)[:200]}")


class PhalanxClient:
    def __init__(self, server: str, token: str | None = None, *, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None,
                 ca_file: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server = server.rstrip("/")
        self.ca_file = ca_file
        verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout_s,
                                  transport=transport, verify=verify)

    @classmethod
    def from_target(cls, target: Target, **kwargs: Any) -> PhalanxClient:
        return cls(target.server, target.token, ca_file=target.ca_file, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PhalanxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send one request; any failure becomes a PhalanxError with the server's detail."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{method} {self.server}{path}: timed out ({exc})") from exc
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach {self.server}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except (ValueError, AttributeError):
                detail = resp.text.strip() or resp.reason_phrase
            message = f"{format_detail(detail)} (HTTP {resp.status_code})"
            raise PhalanxError(message, resp.status_code, detail)
        return resp

    def pages(self, path: str, key: str, limit: int = 500,
              params: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Every item of a paged list (`{"items", "next_offset"}`), following the offsets."""
        items: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            data = self.json("GET", path,
                             params={**(params or {}), "limit": limit, "offset": offset})
            items.extend(_items(data, key))
            nxt = data.get("next_offset") if isinstance(data, dict) else None
            offset = nxt if isinstance(nxt, int) and nxt > offset else None
        return items

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.request(method, path, **kwargs)
        if resp.status_code == 204 or not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError as exc:
            raise PhalanxError(f"{method} {path}: the server sent non-JSON") from exc

    # -- health
    def health(self) -> dict[str, Any]:
        return self.json("GET", "/healthz")

    # -- devices
    def devices(self, selector: str | None = None,
                state: str | None = None) -> list[dict[str, Any]]:
        """Devices whose labels match `selector` (Kubernetes syntax) and whose state is one of
        `state` (comma-separated), filtered by the server."""
        params = {k: v for k, v in (("selector", selector), ("state", state)) if v}
        return self.pages("/v1/devices", "devices", params=params)

    def device_logs(self, device_id: str, timeout_s: float = 60.0,
                    poll_s: float = 0.5) -> dict[str, Any]:
        """Ask a device's agent for its recent log lines and wait for them (it ships them after
        its next heartbeat); PhalanxError when none came within `timeout_s`."""
        self.json("POST", f"/v1/devices/{device_id}/logs/request")
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.json("GET", f"/v1/devices/{device_id}/logs")
            if got.get("requested_at") is None and got.get("shipped_at"):
                return got  # the request was answered (shipping clears it)
            if time.monotonic() > deadline:
                raise PhalanxError(f"device {device_id} sent no logs within {timeout_s:g} s: is "
                                   f"it online? (phalanx devices describe {device_id})")
            time.sleep(poll_s)

    def device(self, device_id: str) -> dict[str, Any]:
        return self.json("GET", f"/v1/devices/{device_id}")

    def device_action(self, device_id: str, action: str) -> dict[str, Any]:
        """`cordon`, `uncordon` or `drain`."""
        return self.json("POST", f"/v1/devices/{device_id}/{action}")

    def label_device(self, device_id: str, labels: dict[str, str | None]) -> dict[str, Any]:
        """Set labels (a value) or remove them (None): a merge patch."""
        return self.json("PATCH", f"/v1/devices/{device_id}", json={"labels": labels})

    def device_events(self, device_id: str) -> list[dict[str, Any]]:
        return self.pages(f"/v1/devices/{device_id}/events", "events")

    def delete_device(self, device_id: str) -> dict[str, Any]:
        return self.json("DELETE", f"/v1/devices/{device_id}")

    # -- tokens
    def rollout(self) -> dict[str, Any]:
        """The agent rollout in force, how far it is, and the build the server serves."""
        return self.json("GET", "/v1/agent/rollout")

    def start_rollout(self, max_parallel: int = 1, version: str | None = None) -> dict[str, Any]:
        """Roll the server's agent build out to every phone, `max_parallel` at a time."""
        body: dict[str, Any] = {"max_parallel": max_parallel}
        if version is not None:
            body["version"] = version
        return self.json("PUT", "/v1/agent/rollout", json=body)

    def stop_rollout(self) -> dict[str, Any]:
        return self.json("DELETE", "/v1/agent/rollout")

    def create_enrollment_token(self, **body: Any) -> dict[str, Any]:
        return self.json("POST", "/v1/enrollment-tokens", json=body)

    def install_pins(self) -> InstallPins:
        """The sha256 of /install.sh and /agent.tar.gz as this server serves them now."""
        return InstallPins(*(hashlib.sha256(self.request("GET", path).content).hexdigest()
                             for path in ("/install.sh", "/agent.tar.gz")))

    def create_user_token(self, name: str, **body: Any) -> dict[str, Any]:
        body["name"] = name
        return self.json("POST", "/v1/tokens", json=body)

    # -- jobs
    def submit_job(self, spec: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """The created job; with dry_run, its plan and where it could run (nothing created)."""
        return self.json("POST", "/v1/jobs", json=spec,
                         params={"dry_run": "true"} if dry_run else None)

    def jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        return self.pages("/v1/jobs", "jobs", params={"state": state} if state else None)

    def tokens(self) -> list[dict[str, Any]]:
        return self.pages("/v1/tokens", "tokens")

    def enrollment_tokens(self) -> list[dict[str, Any]]:
        return self.pages("/v1/enrollment-tokens", "tokens")

    def revoke_token(self, token_id: str, enrollment: bool = False) -> dict[str, Any]:
        kind = "enrollment-tokens" if enrollment else "tokens"
        return self.json("DELETE", f"/v1/{kind}/{token_id}")

    def job(self, job_id: str) -> dict[str, Any]:
        return self.json("GET", f"/v1/jobs/{job_id}")

    def job_events(self, job_id: str) -> list[dict[str, Any]]:
        return self.pages(f"/v1/jobs/{job_id}/events", "events")

    def job_metrics(self, job_id: str) -> Any:
        return self.json("GET", f"/v1/jobs/{job_id}/metrics")

    def job_curve(self, job_id: str) -> list[dict[str, Any]]:
        """Every step's metrics, oldest first (the pages follow `since_step`)."""
        items: list[dict[str, Any]] = []
        since = 0
        while True:
            page = self.json("GET", f"/v1/jobs/{job_id}/metrics",
                             params={"since_step": since, "limit": 10000})
            items.extend(_items(page, "metrics"))
            nxt = page.get("next_offset") if isinstance(page, dict) else None
            if not isinstance(nxt, int) or nxt <= since:
                return items
            since = nxt

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self.json("POST", f"/v1/jobs/{job_id}/cancel")

    def checkpoint(self, job_id: str) -> bytes:
        return self.request("GET", f"/v1/jobs/{job_id}/checkpoint").content

    # -- datasets
    def datasets(self) -> list[dict[str, Any]]:
        return self.pages("/v1/datasets", "datasets")

    def dataset(self, name: str) -> dict[str, Any]:
        return self.json("GET", f"/v1/datasets/{name}")

    def delete_dataset(self, name: str) -> dict[str, Any]:
        """Remove one of your datasets (an admin: any), its files too."""
        return self.json("DELETE", f"/v1/datasets/{name}")

    def share_dataset(self, name: str, public: bool = True) -> dict[str, Any]:
        """Let every user see and train on a dataset, or no longer (admin)."""
        return self.json("PATCH", f"/v1/datasets/{name}", json={"public": public})

    def upload_resumable(self, name: str, data: bytes | Path,
                         on_progress: Callable[[int], None] | None = None,
                         attempts: int = 6, chunk_bytes: int = 4 << 20) -> dict[str, Any]:
        """Upload a dataset file in chunks (`/v1/datasets/uploads`, domain/store/uploads.py): a
        dropped connection or a chunk whose answer was lost is resumed from where the server
        says the upload stands, up to `attempts` times in a row; the created dataset. A path
        is read a chunk at a time (a file bigger than this machine's memory uploads too)."""
        total = len(data) if isinstance(data, bytes) else data.stat().st_size
        opened = self.json("POST", "/v1/datasets/uploads", json={
            "name": name, "size": total, "sha256": _sha256(data)})
        base = f"/v1/datasets/uploads/{opened['id']}"
        size = min(chunk_bytes, int(opened["chunk_max_bytes"]))
        offset = int(opened["offset"])

        def send_next() -> int:
            try:
                answer = self.json("PUT", base, params={"offset": offset},
                                   content=_part(data, offset, size),
                                   headers={"Content-Type": "application/octet-stream"})
            except PhalanxError as exc:
                if exc.status != 409:  # 409: it already has this chunk, or more
                    raise
                answer = self.json("GET", base)
            return int(answer["offset"])

        def resume(state: RetryCallState) -> None:
            nonlocal offset
            try:
                offset = int(self.json("GET", base)["offset"])
            except Unreachable:
                pass  # still down: the next attempt asks again

        retrying = Retrying(retry=retry_if_exception_type(Unreachable),
                            stop=stop_after_attempt(attempts), reraise=True,
                            wait=wait_exponential(multiplier=0.2, max=5), before_sleep=resume)
        while offset < total:
            offset = retrying(send_next)
            if on_progress is not None:
                on_progress(offset)
        # the server hashes, unpacks and checks the whole file in this request
        return self.json("POST", f"{base}/complete", timeout=COMPLETE_TIMEOUT_S)

    def upload_dataset(self, name: str, data: bytes) -> dict[str, Any]:
        files = {"file": (f"{name}.npz", data, "application/octet-stream")}
        return self.json("POST", "/v1/datasets", data={"name": name}, files=files)


def _sha256(data: bytes | Path) -> str:
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    digest = hashlib.sha256()
    with data.open("rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _part(data: bytes | Path, offset: int, size: int) -> bytes:
    if isinstance(data, bytes):
        return data[offset : offset + size]
    with data.open("rb") as fh:
        fh.seek(offset)
        return fh.read(size)
