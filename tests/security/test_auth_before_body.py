"""No route reads a body before it knows who sends it (issue 42, item 4).

Every route that can take a body, found by walking the app's routes (and checked against the
OpenAPI document's request bodies, so neither list can drift from the code), is sent what a
stranger would send: headers announcing a large body, no token, and 1 KiB of it. The 401 must
come back while the rest of the body is still unsent; before, `POST /v1/datasets` parsed and
spooled the whole multipart form first, and the JSON routes waited for their whole body too.
The only deadline is a generous one for an answer to arrive at all.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.routing import iter_route_contexts

from api import body_auth
from domain.settings import Settings
from roots.api import create_app
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer

DEADLINE_S = 20.0  # for the answer to arrive at all: the body's rest never comes
CLAIMED = (32 * 1024 * 1024, 64 * 1024)  # over and under the 1 MiB JSON limit
SENT = 1024
SAFE = {"GET", "HEAD", "OPTIONS"}
# the routes whose credential travels in their body (docs/api.md): the enrollment token, and
# the token a browser pastes into the /ui login form
CREDENTIAL_IN_BODY = {("POST", "/v1/devices/register"), ("POST", "/ui/login")}


def _routes(sqlite_url: str, data_dir: Path) -> tuple[set[tuple[str, str]], dict]:
    """(method, path template) of every route that can be sent a body, and the OpenAPI
    document, from the app itself."""
    app = create_app(Settings(database_url=sqlite_url, data_dir=data_dir,
                              admin_token=ADMIN_TOKEN))
    try:
        found = {(method, route.path_format)
                 for route in iter_route_contexts(app.routes)
                 if route.path_format and route.methods
                 for method in route.methods - SAFE}
        return found, app.openapi()
    finally:
        app.state.engine.dispose()


def _with_bodies(openapi: dict) -> dict[tuple[str, str], dict]:
    return {(method.upper(), path): operation
            for path, operations in openapi["paths"].items()
            for method, operation in operations.items() if "requestBody" in operation}


def _path(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", template)


def _content_type(operation: dict | None) -> str:
    types = list(((operation or {}).get("requestBody") or {}).get("content") or {})
    return types[0] if types else "application/json"


def _first_kib(content_type: str) -> tuple[str, bytes]:
    """A header value and the first KiB of a body of that type (the rest never comes)."""
    if content_type.startswith("multipart/"):
        start = (b"--b0undary\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nx\r\n"
                 b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; "
                 b"filename=\"x.npz\"\r\nContent-Type: application/octet-stream\r\n\r\n")
        return "multipart/form-data; boundary=b0undary", start + b"\0" * (SENT - len(start))
    if content_type == "application/json":
        start = b'{"name": "'
        return content_type, start + b"a" * (SENT - len(start))
    return content_type, b"\0" * SENT


def _stranger(url: str, method: str, path: str, content_type: str, claimed: int | None,
              token: str | None = None) -> int:
    """Send headers announcing `claimed` bytes (None: chunked) and 1 KiB of the body; the
    status of the answer, which must come before the rest of the body is sent."""
    where = urlsplit(url)
    header, first = _first_kib(content_type)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {where.netloc}", f"Content-Type: {header}"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if claimed is None:
        lines.append("Transfer-Encoding: chunked")
        first = f"{len(first):x}\r\n".encode() + first + b"\r\n"
    else:
        lines.append(f"Content-Length: {claimed}")
    with socket.create_connection((where.hostname, where.port), timeout=DEADLINE_S) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + first)
        answer = b""
        try:
            while b"\r\n" not in answer:
                got = sock.recv(4096)
                if not got:
                    break
                answer += got
        except TimeoutError:
            pytest.fail(f"{method} {path} (a stranger's {claimed}-byte body, {SENT} bytes "
                        f"sent): no answer within {DEADLINE_S} s: the body is being waited for")
    status = answer.split(b" ", 2)
    assert len(status) >= 2, f"{method} {path}: no status line in {answer!r}"
    return int(status[1])


@pytest.fixture
def routes(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[set, dict]]:
    yield _routes(sqlite_url, tmp_path / "walk")


def test_the_walk_finds_every_route_with_a_body(routes) -> None:
    found, openapi = routes
    declared = _with_bodies(openapi)
    assert declared, "the OpenAPI document declares no request body: the walk below is empty"
    assert set(declared) <= found, set(declared) - found
    assert ("POST", "/v1/datasets") in found and ("PUT", "/v1/datasets/uploads/{upload_id}") in found
    # every body route takes a bearer token, but those whose credential is in their body
    unauthenticated = {key for key, operation in declared.items()
                       if not operation.get("security")}
    assert unauthenticated <= CREDENTIAL_IN_BODY
    assert {path for _, path in CREDENTIAL_IN_BODY} == set(body_auth.CREDENTIAL_IN_BODY)


def test_a_stranger_is_refused_before_the_body_on_every_route(routes,
                                                              live_server: LiveServer) -> None:
    found, openapi = routes
    declared = _with_bodies(openapi)
    refused = {}
    for method, template in sorted(found - CREDENTIAL_IN_BODY):
        content_type = _content_type(declared.get((method, template)))
        for claimed in CLAIMED:
            refused[(method, template, claimed)] = _stranger(
                live_server.url, method, _path(template), content_type, claimed)
    wrong = {key: status for key, status in refused.items() if status != 401}
    assert not wrong, f"answered other than 401 to a stranger: {wrong}"
    # a body without a length (chunked) is a body too
    assert _stranger(live_server.url, "POST", "/v1/datasets", "multipart/form-data",
                     None) == 401
    # the routes whose credential is in their body: under the ordinary limit, refused at once
    # over it
    for method, path in sorted(CREDENTIAL_IN_BODY):
        assert _stranger(live_server.url, method, path, "application/json", CLAIMED[0]) == 413


def test_a_token_of_the_wrong_kind_is_refused_before_the_upload(live_server: LiveServer
                                                                ) -> None:
    """A phone's token on the multipart upload: 403 from the route's dependencies, before
    the form is read (the route reads it itself, after them)."""
    with live_server.client() as admin:
        enrollment = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
        device = httpx.post(f"{live_server.url}/v1/devices/register", json={
            "enrollment_token": enrollment, "name": "p", "labels": {},
            "spec": {"model": "SM-G975F", "cpu_cores": 8}}, timeout=30).json()
    assert _stranger(live_server.url, "POST", "/v1/datasets", "multipart/form-data",
                     CLAIMED[0], token=device["device_token"]) == 403
    assert _stranger(live_server.url, "POST", "/v1/datasets", "multipart/form-data",
                     CLAIMED[0], token="phx-usr-not-a-token") == 401
