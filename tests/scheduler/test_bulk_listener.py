"""The bulk listener (api.steps.bulk_listener): a real port on a real app, spoken to over real
sockets. It must answer exactly what the API routes answer (weights and gradient uploads),
refuse what they refuse (before reading a body it would refuse), lose nothing on a client that
goes away, and be named in the work assignment only when it runs."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from domain.settings import Settings
from hotstate import keys
from roots.api import create_app
from scheduler import context
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import admin, job, running_job, shard_result_blobs, shards_of
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.waiting import wait_for

LIMIT = 4 * 1024 * 1024


def make_client(sqlite_url: str, tmp_path: Path, **settings: object) -> TestClient:
    return TestClient(create_app(Settings(database_url=sqlite_url, data_dir=tmp_path / "data",
                                          admin_token=ADMIN, max_upload_bytes=LIMIT, **settings)))


@pytest.fixture
def app_client(sqlite_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(sqlite_url, tmp_path, bulk_port=0) as client:
        yield client
    context.reset()


def listener_url(client: TestClient) -> str:
    return f"http://127.0.0.1:{client.app.state.bulk_listener.port}"


def gradients(job_id: str, step: int = 0) -> str:
    return f"/v1/jobs/{job_id}/steps/{step}/gradients"


def both(client: TestClient, method: str, path: str, **kw: object) -> tuple[httpx.Response, ...]:
    """The same request to the API route and to the listener."""
    with httpx.Client(base_url=listener_url(client), timeout=30) as direct:
        return client.request(method, path, **kw), direct.request(method, path, **kw)


def test_the_assignment_names_the_listener_and_its_answers_are_the_routes(
        app_client: TestClient) -> None:
    job_id, [(dev, hdr), (other, other_hdr)] = running_job(app_client)
    a = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()["assignment"]
    port = app_client.app.state.bulk_listener.port
    assert a["bulk_url"] == f"http://testserver:{port}"  # the host the agent used, this port
    for query in ({"step": 0}, {"step": 3}, {}, {"step": -1}, {"step": "x"}):
        api, bulk = both(app_client, "get", f"/v1/jobs/{job_id}/weights", params=query, headers=hdr)
        assert (bulk.status_code, bulk.content) == (api.status_code, api.content), query
        assert bulk.headers["content-type"] == api.headers["content-type"]
    for headers in ({}, admin(None), other_hdr):  # no token 401, admin 403; the other phone: 200
        api, bulk = both(app_client, "get", f"/v1/jobs/{job_id}/weights", params={"step": 0},
                         headers=headers)
        assert (bulk.status_code, bulk.content) == (api.status_code, api.content)
    ctx = context.get_context()
    blobs = shard_result_blobs(ctx, job_id, 0)
    mine, theirs = shards_of(job_id, dev)[0], shards_of(job_id, other)[0]
    with httpx.Client(base_url=listener_url(app_client), timeout=30) as direct:
        first = direct.post(gradients(job_id), content=blobs[mine], headers=hdr)
        assert first.status_code == 200 and first.json() == {"accepted": [mine], "duplicates": []}
        assert ctx.blobs.get(keys.grad(job_id, 0, mine)) is not None
        again = direct.post(gradients(job_id), content=blobs[mine], headers=hdr)
        assert again.json() == {"accepted": [], "duplicates": [mine]}
    # one store behind both ports: what came in on one is a duplicate on the other
    via_api = app_client.post(gradients(job_id), content=blobs[mine], headers=hdr)
    assert via_api.json() == {"accepted": [], "duplicates": [mine]}
    for refused in ([("post", gradients(job_id)), {"content": blobs[theirs], "headers": hdr}],
                    [("post", gradients(job_id)), {"content": b"garbage", "headers": hdr}],
                    [("post", gradients(job_id)), {"content": blobs[mine]}],
                    [("post", gradients(job_id)), {"content": blobs[mine],
                                                   "headers": {"Authorization": "Bearer nope"}}],
                    [("post", gradients(job_id)), {"content": blobs[mine], "headers": admin(None)}],
                    [("post", gradients("no-such-job")), {"content": blobs[mine], "headers": hdr}]):
        (method, path), kw = refused
        api, listener = both(app_client, method, path, **kw)
        assert api.status_code >= 400, api.text
        assert (listener.status_code, listener.json()) == (api.status_code, api.json())
    # the step completes through the listener and apply_step runs on what it stored
    with httpx.Client(base_url=listener_url(app_client), timeout=30) as direct:
        for device, headers in ((dev, hdr), (other, other_hdr)):
            for k in shards_of(job_id, device):
                direct.post(gradients(job_id), content=blobs[k], headers=headers)
    assert run_apply_step(ctx, job_id, 0) in ("applied", "stale")  # the hook may have run it
    assert job(ctx, job_id).step == 1
    api, listener = both(app_client, "post", gradients(job_id), content=blobs[mine], headers=hdr)
    assert listener.status_code == api.status_code == 409
    assert listener.json() == api.json() and "step 1" in listener.json()["detail"]


def raw_request(port: int, headers: dict[str, str], body: bytes = b"",
                path: str = "/v1/jobs/j/steps/0/gradients", method: str = "POST",
                ) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest(method, path, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    conn.endheaders()
    if body:
        conn.send(body)
    return conn.getresponse()


def test_refusals_come_before_the_body_and_close_the_connection(app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    port = app_client.app.state.bulk_listener.port
    # announced over the limit: 413 at once, without waiting for a body that never comes
    big = raw_request(port, {**hdr, "Content-Length": str(LIMIT + 1)}, path=gradients(job_id))
    assert big.status == 413 and "limit" in big.read().decode()
    assert big.getheader("Connection") == "close"
    chunked = raw_request(port, {**hdr, "Transfer-Encoding": "chunked"}, path=gradients(job_id))
    assert chunked.status == 411 and "Content-Length" in chunked.read().decode()
    nonsense = raw_request(port, {**hdr, "Content-Length": "12abc"}, path=gradients(job_id))
    assert nonsense.status == 400
    wrong_path = raw_request(port, {**hdr, "Content-Length": "0"}, path="/v1/jobs")
    assert wrong_path.status == 404 and "only the step's bulk data" in wrong_path.read().decode()
    wrong_method = raw_request(port, hdr, method="GET", path=gradients(job_id))
    assert wrong_method.status == 405 and wrong_method.getheader("Allow") == "POST"
    post_weights = raw_request(port, {**hdr, "Content-Length": "0"}, path=f"/v1/jobs/{job_id}/weights")
    assert post_weights.status == 405 and post_weights.getheader("Allow") == "GET"


def test_a_client_that_leaves_mid_body_stores_nothing(app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    ctx = context.get_context()
    mine = shards_of(job_id, dev)[0]
    body = shard_result_blobs(ctx, job_id, 0)[mine]
    port = app_client.app.state.bulk_listener.port
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (f"POST {gradients(job_id)} HTTP/1.1\r\nHost: x\r\nAuthorization: "
                f"{hdr['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body[: len(body) // 2])
    # the listener is still serving, and the half upload left no trace
    r = httpx.post(listener_url(app_client) + gradients(job_id), content=body, headers=hdr)
    assert r.json() == {"accepted": [mine], "duplicates": []}


def test_keep_alive_carries_several_uploads_on_one_connection(app_client: TestClient) -> None:
    job_id, [(dev, hdr), (other, other_hdr)] = running_job(app_client)
    blobs = shard_result_blobs(context.get_context(), job_id, 0)
    conn = http.client.HTTPConnection("127.0.0.1", app_client.app.state.bulk_listener.port)
    answers = []
    for k in shards_of(job_id, dev):
        conn.request("POST", gradients(job_id), body=blobs[k], headers=hdr)
        resp = conn.getresponse()
        answers.append((resp.status, resp.read()))
        assert resp.getheader("Connection") != "close"
    conn.close()
    assert [status for status, _ in answers] == [200] * len(answers)


def test_no_listener_no_bulk_url_and_a_taken_port_is_skipped(sqlite_url: str, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with make_client(sqlite_url, tmp_path) as client:  # bulk_port unset
        job_id, [(dev, hdr), _] = running_job(client)
        a = client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()
        assert a["assignment"]["bulk_url"] is None
    context.reset()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with make_client(sqlite_url, tmp_path / "b", bulk_port=port) as client:
            assert client.app.state.bulk_listener is None
            assert "not available" in caplog.text
            assert client.get("/healthz").status_code == 200
    context.reset()


def test_over_https_only_an_operator_set_url_is_advertised(sqlite_url: str, tmp_path: Path) -> None:
    from api.steps.bulk_listener import BulkListener

    plain = BulkListener(None, "127.0.0.1", 0, LIMIT)
    plain.port = 9001
    assert plain.url_for("http", "10.0.0.7") == "http://10.0.0.7:9001"
    assert plain.url_for("http", "::1") == "http://[::1]:9001"
    assert plain.url_for("https", "api.lab") is None  # a bearer token never goes out bare
    public = BulkListener(None, "0.0.0.0", 0, LIMIT, public_url="https://up.lab/")
    public.port = 9001
    assert public.url_for("https", "api.lab") == "https://up.lab"


def test_bodies_held_at_once_are_bounded_and_a_stalled_one_frees_its_place(
        sqlite_url: str, tmp_path: Path) -> None:
    """With room for one body, an upload waits while another client trickles its body in, and
    goes through once that client leaves: a fleet uploading at once cannot hold a model-sized
    buffer per connection."""
    import threading

    class Place:
        """One place for a body; counts who asked for it (the listener enters it with `with`)."""

        def __init__(self) -> None:
            self.inner, self.asked = threading.BoundedSemaphore(1), 0

        def __enter__(self) -> None:
            self.asked += 1
            self.inner.acquire()

        def __exit__(self, *exc: object) -> None:
            self.inner.release()

    place = Place()
    with make_client(sqlite_url, tmp_path, bulk_port=0) as client:
        client.app.state.bulk_listener.bodies = place
        job_id, [(dev, hdr), _] = running_job(client)
        blobs = shard_result_blobs(context.get_context(), job_id, 0)
        mine = shards_of(job_id, dev)
        port = client.app.state.bulk_listener.port
        staller = socket.create_connection(("127.0.0.1", port))
        staller.sendall((f"POST {gradients(job_id)} HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         f"{hdr['Authorization']}\r\nContent-Length: {len(blobs[mine[0]])}\r\n\r\n"
                         ).encode() + blobs[mine[0]][:100])
        wait_for("the trickling upload to take the one place", lambda: place.asked == 1)
        answers: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answers.append(httpx.post(
            listener_url(client) + gradients(job_id), content=blobs[mine[1]], headers=hdr,
            timeout=60)))
        waiter.start()
        wait_for("both uploads to ask for the one place", lambda: place.asked == 2)
        assert not answers  # the second waits: it has not got the place the trickler holds
        staller.close()
        waiter.join(60)
        assert answers and answers[0].json() == {"accepted": [mine[1]], "duplicates": []}
    context.reset()


def test_an_agent_leaving_mid_download_leaves_the_listener_serving(
        app_client: TestClient, capfd: pytest.CaptureFixture[str]) -> None:
    # weights bigger than the sockets' buffers (~15 MB), so the send is cut off mid-way
    job_id, [(dev, hdr), _] = running_job(app_client, model={"hidden": 1024},
                                          dataset="synthetic:3x32x32:10:256")
    port = app_client.app.state.bulk_listener.port
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall((f"GET /v1/jobs/{job_id}/weights?step=0 HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: {hdr['Authorization']}\r\n\r\n").encode())
            sock.recv(100)  # the answer has started; leave with the rest unread
    r = httpx.get(listener_url(app_client) + f"/v1/jobs/{job_id}/weights", params={"step": 0},
                  headers=hdr, timeout=30)
    assert r.status_code == 200
    assert "Traceback" not in capfd.readouterr().err


def _connected_pair(timeout_s: float) -> tuple[socket.socket, socket.socket]:
    """A blocking receiving socket with a kernel receive timeout, as the handler sets it up."""
    import struct

    rx, tx = socket.socketpair()
    rx.settimeout(None)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                  struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
    return rx, tx


def test_a_body_is_read_whole_from_the_buffered_reader_and_then_the_socket() -> None:
    """The request line parsed through the buffered reader leaves part of the body in its
    buffer; the rest is read from the socket in one MSG_WAITALL call, sent in pieces here."""
    import threading
    import time

    from api.steps.bulk_listener import read_exactly

    body = bytes(range(256)) * 40_000  # 10 MB, more than any socket buffer
    rx, tx = _connected_pair(30)

    def send() -> None:
        tx.sendall(b"POST /x HTTP/1.1\r\n" + body[:5000])
        time.sleep(0.05)
        for i in range(5000, len(body), 1 << 20):
            tx.sendall(body[i:i + (1 << 20)])

    sender = threading.Thread(target=send)
    sender.start()
    rfile = rx.makefile("rb")
    assert rfile.readline() == b"POST /x HTTP/1.1\r\n"
    got = read_exactly(rfile, len(body), rx)
    sender.join()
    assert got is not None and bytes(got) == body
    rx.close(), tx.close()


def test_a_client_that_stalls_mid_body_frees_the_thread() -> None:
    from api.steps.bulk_listener import read_exactly

    rx, tx = _connected_pair(0.3)
    tx.sendall(b"x" * 1000)  # then nothing: the kernel's receive timeout ends the wait
    assert read_exactly(rx.makefile("rb"), 5000, rx) is None
    tx.sendall(b"y" * 10)
    tx.close()  # and a client that leaves mid-body
    rx2, tx2 = _connected_pair(30)
    tx2.sendall(b"z" * 100)
    tx2.close()
    assert read_exactly(rx2.makefile("rb"), 5000, rx2) is None
    rx.close(), rx2.close()


@pytest.mark.parametrize("size", [100_000, 0])
def test_connections_get_the_configured_kernel_buffers(sqlite_url: str, tmp_path: Path,
                                                       size: int) -> None:
    """PHALANX_BULK_SOCKET_BUFFER_BYTES fixes both kernel buffers of every bulk connection
    (Linux reports twice the figure); 0 leaves them to the kernel."""
    with socket.socket() as fresh:
        default_rcv = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    with make_client(sqlite_url, tmp_path, bulk_port=0, bulk_socket_buffer_bytes=size) as client:
        listener = client.app.state.bulk_listener
        seen: list[tuple[int, int]] = []
        server = listener._server  # read the sizes of the connection the server accepts
        original = server.get_request

        def get_request() -> tuple[socket.socket, object]:
            conn, addr = original()
            seen.append((conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                         conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))
            return conn, addr

        server.get_request = get_request
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            sock.sendall(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 404")
        got = seen[0]
    context.reset()
    if size:
        assert got == (2 * size, 2 * size)
    else:
        assert got[1] == default_rcv and got[0] != 2 * 100_000


def test_a_step_number_past_int64_is_404_not_a_500(app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    r = httpx.post(listener_url(app_client) + f"/v1/jobs/{job_id}/steps/{'9' * 5000}/gradients",
                   content=b"x" * 10, headers=hdr, timeout=30)
    assert r.status_code == 404, r.text
    assert httpx.get(listener_url(app_client) + f"/v1/jobs/{job_id}/weights",
                     params={"step": 0}, headers=hdr, timeout=30).status_code == 200


# -- what one client may hold (issue 19: threads, trickled bodies, one device's slots) -----

def _upload_head(job_id: str, hdr: dict[str, str], length: int) -> bytes:
    return (f"POST {gradients(job_id)} HTTP/1.1\r\nHost: x\r\nAuthorization: "
            f"{hdr['Authorization']}\r\nContent-Length: {length}\r\n\r\n").encode()


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (waits up to 30 s for it to say so)."""
    sock.settimeout(30)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
            if data.startswith(b"HTTP/1.1 4") or data.startswith(b"HTTP/1.1 5"):
                continue  # an answer, then the close
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_connections_past_the_bound_are_closed_at_once_without_a_thread(
        sqlite_url: str, tmp_path: Path) -> None:
    import threading

    from api.metrics import BULK_REFUSED_CONNECTIONS

    with make_client(sqlite_url, tmp_path, bulk_port=0, bulk_max_connections=4) as client:
        port = client.app.state.bulk_listener.port
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        server = client.app.state.bulk_listener._server
        wait_for("the four to be served", lambda: server.open_connections == 4)
        threads = threading.active_count()
        refused_before = BULK_REFUSED_CONNECTIONS.labels("max_connections")._value.get()
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        extra[0].settimeout(30)
        busy = extra[0].recv(4096)  # a 503 the agent retries, not a port that seems gone
        assert busy.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in busy
        assert all(_closed_by_server(s) for s in extra)
        assert threading.active_count() <= threads  # no thread was started for them
        assert BULK_REFUSED_CONNECTIONS.labels("max_connections")._value.get() - refused_before == 20
        for s in idle + extra:
            s.close()
        wait_for("the idle ones to be let go", lambda: server.open_connections == 0)
        with socket.create_connection(("127.0.0.1", port)) as again:
            again.sendall(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
            assert again.recv(100).startswith(b"HTTP/1.1 404")
    context.reset()


def test_headers_that_never_finish_are_cut_at_the_header_deadline(
        sqlite_url: str, tmp_path: Path) -> None:
    """Without the deadline the kernel's per-recv timeout (120 s) would hold the thread: a
    client sending a byte now and then would hold it for ever."""
    with make_client(sqlite_url, tmp_path, bulk_port=0, bulk_header_timeout_s=0.5) as client:
        port = client.app.state.bulk_listener.port
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/jobs/j/steps/0/gradients HTTP/1.1\r\nHost: x\r\n")
            assert _closed_by_server(sock)
        with socket.create_connection(("127.0.0.1", port)) as sock:  # a kept-alive wait too
            sock.sendall(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 404")
            assert _closed_by_server(sock)
    context.reset()


def _trickle(sock: socket.socket, every_s: float) -> None:
    """One byte at a time until the server cuts the connection."""
    import time

    try:
        while True:
            sock.sendall(b"x")
            time.sleep(every_s)
    except OSError:
        return


def test_a_trickled_body_is_cut_and_frees_its_slot_for_the_next_upload(
        sqlite_url: str, tmp_path: Path) -> None:
    """A body that arrives a byte every 0.1 s keeps every recv alive, so only a deadline per
    piece of the body ends it; the upload waiting for its one body slot then goes through."""
    import threading

    with make_client(sqlite_url, tmp_path, bulk_port=0, bulk_stall_s=0.5) as client:
        listener = client.app.state.bulk_listener
        listener.bodies = threading.BoundedSemaphore(1)
        job_id, [(dev, hdr), (other, other_hdr)] = running_job(client)
        blobs = shard_result_blobs(context.get_context(), job_id, 0)
        trickler = socket.create_connection(("127.0.0.1", listener.port))
        trickler.sendall(_upload_head(job_id, hdr, 3_000_000))
        feeding = threading.Thread(target=_trickle, args=(trickler, 0.1), daemon=True)
        feeding.start()
        wait_for("the trickled body to take the one slot",
                 lambda: listener.device_bodies._held.get(dev) == 1)
        mine = shards_of(job_id, other)[0]
        answer = httpx.post(listener_url(client) + gradients(job_id), content=blobs[mine],
                            headers=other_hdr, timeout=60)
        assert answer.status_code == 200 and answer.json()["accepted"] == [mine]
        feeding.join(30)
        assert not feeding.is_alive()  # the trickler was cut off
        trickler.close()
    context.reset()


def test_one_device_cannot_take_every_body_slot(sqlite_url: str, tmp_path: Path) -> None:
    with make_client(sqlite_url, tmp_path, bulk_port=0, bulk_bodies_per_device=1) as client:
        listener = client.app.state.bulk_listener
        job_id, [(dev, hdr), (other, other_hdr)] = running_job(client)
        blobs = shard_result_blobs(context.get_context(), job_id, 0)
        slow = socket.create_connection(("127.0.0.1", listener.port))
        slow.sendall(_upload_head(job_id, hdr, 3_000_000) + b"x" * 1000)  # holds its slot
        wait_for("the slow upload to hold its slot",
                 lambda: listener.device_bodies._held.get(dev) == 1)
        second = httpx.post(listener_url(client) + gradients(job_id),
                            content=blobs[shards_of(job_id, dev)[0]], headers=hdr, timeout=60)
        assert second.status_code == 429 and dev in second.json()["detail"]
        assert second.headers.get("connection") == "close"
        theirs = shards_of(job_id, other)[0]
        answer = httpx.post(listener_url(client) + gradients(job_id), content=blobs[theirs],
                            headers=other_hdr, timeout=60)
        assert answer.status_code == 200  # another device is not held up
        slow.close()
        wait_for("the slot to be given back", lambda: not listener.device_bodies._held)
        retry = httpx.post(listener_url(client) + gradients(job_id),
                           content=blobs[shards_of(job_id, dev)[0]], headers=hdr, timeout=60)
        assert retry.status_code == 200
    context.reset()
