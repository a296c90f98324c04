"""api.steps.bulk_body: gradient uploads reach the app as one body message, everything else as sent.

Driven as ASGI, the way uvicorn drives it: the server's `receive` hands the body over in pieces.
"""

from __future__ import annotations

import asyncio
from typing import Any

from api.steps.bulk_body import WholeBodyReader
from api.steps.handlers import is_gradient_upload

UPLOAD = "/v1/jobs/j1/steps/3/gradients"


class Recorder:
    """The inner app: records every receive() message it got, answers 200."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.called = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.called = True
        while True:
            message = await receive()
            self.messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def anyone(scope: dict[str, Any]) -> bool:
    return True


async def nobody(scope: dict[str, Any]) -> bool:
    return False


def drive(path: str, pieces: list[bytes], *, length: int | None = None, method: str = "POST",
          disconnect_after: int | None = None, limit: int = 1 << 20,
          admits: Any = anyone) -> tuple[Recorder, list]:
    inner = Recorder()
    app = WholeBodyReader(inner, is_gradient_upload, limit, admits)
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    queue: list[dict[str, Any]] = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)]
    if disconnect_after is not None:
        queue = queue[:disconnect_after] + [{"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return inner, sent


def test_an_upload_in_pieces_reaches_the_app_as_one_message() -> None:
    pieces = [b"a" * 65536, b"b" * 65536, b"c" * 10]
    inner, sent = drive(UPLOAD, pieces, length=sum(map(len, pieces)))
    assert inner.messages == [{"type": "http.request", "body": b"".join(pieces),
                               "more_body": False}]
    assert sent[0]["status"] == 200


def test_a_client_that_leaves_mid_upload_reaches_nothing() -> None:
    inner, sent = drive(UPLOAD, [b"a" * 100, b"b" * 100], length=300, disconnect_after=1)
    assert not inner.called and sent == []


def test_other_paths_uploads_without_a_length_and_oversized_uploads_pass_through() -> None:
    pieces = [b"x" * 10, b"y" * 10]
    for kwargs in ({"path": "/v1/datasets", "length": 20},        # not a gradient upload
                   {"path": UPLOAD, "length": None},               # chunked: no Content-Length
                   {"path": UPLOAD, "length": 20, "limit": 19}):   # over the limit: 413 later
        path = kwargs.pop("path")
        inner, _ = drive(path, pieces, **kwargs)
        assert [m["body"] for m in inner.messages] == pieces, path


def test_an_upload_without_a_device_token_is_not_read_here() -> None:
    """Its body passes through in pieces to the stack, where the route refuses it from its
    headers before reading it."""
    pieces = [b"a" * 65536, b"b" * 10]
    inner, _ = drive(UPLOAD, pieces, length=65546, admits=nobody)
    assert [m["body"] for m in inner.messages] == pieces


def test_at_most_max_bodies_are_held_at_once() -> None:
    """With one place, a second upload does not start reading while the first is held."""

    async def scenario() -> list[str]:
        log: list[str] = []
        gate = asyncio.Event()

        async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
            log.append(f"app {scope['path']}")
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        reader = WholeBodyReader(inner, lambda path: True, 1 << 20, anyone, max_bodies=1)

        def request(name: str, held: bool) -> Any:
            async def receive() -> dict[str, Any]:
                log.append(f"read {name}")
                if held:
                    await gate.wait()
                return {"type": "http.request", "body": b"x", "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                return None

            scope = {"type": "http", "method": "POST", "path": name,
                     "headers": [(b"content-length", b"1")]}
            return reader(scope, receive, send)

        first = asyncio.create_task(request("/first", held=True))
        second = asyncio.create_task(request("/second", held=False))
        for _ in range(20):  # let both run as far as they can
            await asyncio.sleep(0)
        log.append("release")
        gate.set()
        await asyncio.gather(first, second)
        return log

    assert asyncio.run(scenario()) == ["read /first", "release", "app /first", "read /second",
                                       "app /second"]


def test_the_app_built_by_create_app_reads_uploads_whole(tmp_path) -> None:
    from domain.settings import Settings
    from roots.api import create_app
    from scheduler import context

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                              data_dir=tmp_path / "data", admin_token="phx-admin-" + "2" * 24))
    try:
        stack = app.build_middleware_stack()
        layers = []
        while stack is not None and len(layers) < 20:
            layers.append(type(stack).__name__)
            stack = getattr(stack, "app", None)
        assert "WholeBodyReader" in layers
        assert layers.index("WholeBodyReader") < layers.index("BodySizeLimit")
    finally:
        context.reset()
