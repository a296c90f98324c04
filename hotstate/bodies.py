"""Upload bodies kept by the API replica that received them (production mode, Redis).

Each gradient upload used to cross Redis twice: the replica SET it (12.9 MB for mobilenet_v1)
and the applying worker read it back; at 8 agents that was ~335 ms of Redis CPU per step and
most of the step (docs/benchmarks.md). Now the replica keeps the body in its own memory (the
`SHELF`) and the shard's result in Redis is a reference naming where the body is
(`peer:<host>:<port>/<id>`). Whoever applies the step reads each body once: from memory when it
is the same process, from the replica's peer port (api.steps.peer_listener) otherwise.

A replica that dies or cannot be reached takes its bodies with it. The applier then deletes the
results that named them (scheduler.apply.read_results), their devices see those shards as
to do again and recompute them: a step is never applied with a result missing. The replica is
marked unreachable in Redis for a while (`keys.peer_down`), and replicas marked so store bodies
in Redis as before, so a peer port that workers cannot reach (a firewall, a wrong
PHALANX_PEER_HOST) costs speed, not progress.

The id in a reference is 128 random bits, known only through Redis: holding it is what lets a
peer read the body (a capability), and a wrong one costs the listener a dict lookup.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hotstate import keys
from hotstate.blobs import BlobStore
from wire.buffers import new_buffer

log = logging.getLogger(__name__)

PEER_PREFIX = "peer:"
PEER_DOWN_TTL_S = 60.0  # how long replicas store bodies in Redis after a peer fetch failed
PEER_HEADER = "X-Phalanx-Peer"  # every peer-port answer names its replica
FETCH_TIMEOUT_S = 10.0  # well below the apply claim (15 s): a stuck peer must not double an apply
FETCH_ATTEMPTS = 2  # a refused or reset connection is tried once more before the replica is down
FETCH_RETRY_PAUSE_S = 0.2


def peer_key(address: str, body_id: str) -> str:
    return f"{PEER_PREFIX}{address}/{body_id}"


def parse_peer_key(key: str) -> tuple[str, str] | None:
    """(address, id) of a peer reference; None for a body key in the blob store."""
    if not key.startswith(PEER_PREFIX):
        return None
    address, _, body_id = key[len(PEER_PREFIX):].rpartition("/")
    return (address, body_id) if address and body_id else None


@dataclass
class _Held:
    job_id: str
    step: int
    body: memoryview
    stored_at: float


class BodyShelf:
    """The bodies this process holds for whoever applies their steps, bounded in bytes.

    A body is dropped when an upload for a later step of its job arrives (that step was
    applied: uploads are accepted only for the job's current step), when it was discarded
    (it won no shard), or `ttl_s` after it came (a job that ended or was cancelled)."""

    def __init__(self, capacity_bytes: int = 2 * 1024**3, ttl_s: float = 600.0) -> None:
        self.capacity_bytes, self.ttl_s = capacity_bytes, ttl_s
        self.address: str | None = None  # host:port of the peer listener; None: not serving
        self._held: dict[str, _Held] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def serve_at(self, address: str | None, capacity_bytes: int | None = None) -> None:
        with self._lock:
            self.address = address
            if capacity_bytes is not None:
                self.capacity_bytes = capacity_bytes
            if address is None:
                self._held.clear()
                self._bytes = 0

    def put(self, job_id: str, step: int, body: bytes | bytearray | memoryview) -> str | None:
        """Keep `body`; its peer reference, or None when not serving or full (the caller then
        stores the body in the blob store)."""
        view = memoryview(body).cast("B").toreadonly()
        now = time.monotonic()
        with self._lock:
            if self.address is None:
                return None
            self._prune(job_id, step, now)
            if self._bytes + view.nbytes > self.capacity_bytes:
                return None
            body_id = uuid.uuid4().hex
            self._held[body_id] = _Held(job_id, step, view, now)
            self._bytes += view.nbytes
            return peer_key(self.address, body_id)

    def _prune(self, job_id: str, step: int, now: float) -> None:
        old = [i for i, h in self._held.items()
               if (h.job_id == job_id and h.step < step) or now - h.stored_at > self.ttl_s]
        for body_id in old:
            self._bytes -= self._held.pop(body_id).body.nbytes

    def get(self, body_id: str) -> memoryview | None:
        with self._lock:
            held = self._held.get(body_id)
            return held.body if held else None

    def discard(self, key: str) -> None:
        parsed = parse_peer_key(key)
        if parsed is None:
            return
        with self._lock:
            held = self._held.pop(parsed[1], None)
            if held is not None:
                self._bytes -= held.body.nbytes

    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def local(self, key: str) -> tuple[bool, memoryview | None]:
        """(is this process's reference, its body)."""
        parsed = parse_peer_key(key)
        if parsed is None or parsed[0] != self.address:
            return False, None
        return True, self.get(parsed[1])


SHELF = BodyShelf()  # one per process: the replica's upload handlers and its local applies


def keep_body(blobs: BlobStore, job_id: str, step: int, body: bytes | memoryview,
              blob_key: str) -> str:
    """Where an upload's body is kept: on this replica's shelf (its peer reference) unless the
    shelf is off, full or marked unreachable; else in the blob store under `blob_key`."""
    if SHELF.address is not None and not blobs.exists(keys.peer_down(SHELF.address)):
        ref = SHELF.put(job_id, step, body)
        if ref is not None:
            return ref
    blobs.set(blob_key, body)
    return blob_key


def drop_body(blobs: BlobStore, key: str) -> None:
    if parse_peer_key(key) is None:
        blobs.delete(key)
    else:
        SHELF.discard(key)


def fetch_bodies(blobs: BlobStore, body_keys: Iterable[str]) -> dict[str, bytes | memoryview | None]:
    """Every body a step's results name: from this process's shelf, from the replicas that
    hold them (one connection per replica, replicas in parallel), or from the blob store.
    A body that cannot be had is None; a replica that cannot be reached is marked down."""
    got = fetch_pieces(blobs, [(key, None) for key in body_keys])
    return {key: value for (key, _), value in got.items()}


Range = tuple[int, int] | None  # [start, stop) of a body; None: all of it
Piece = tuple[str, Range]


def fetch_pieces(blobs: BlobStore, pieces: Iterable[Piece]) -> dict[Piece, bytes | memoryview | None]:
    """`fetch_bodies` for ranges of bodies: what a sliced step's task reads (its slice of each
    gradient, scheduler.apply), so each task moves only its share of the bytes. A piece
    that cannot be had whole is None."""
    out: dict[Piece, bytes | memoryview | None] = {}
    remote: dict[str, list[tuple[Piece, str]]] = defaultdict(list)
    whole_in_store: list[Piece] = []
    for piece in pieces:
        key, span = piece
        parsed = parse_peer_key(key)
        if parsed is None:
            if span is None:
                whole_in_store.append(piece)  # read together below (MGET)
            else:
                data = blobs.get_range(key, span[0], span[1] - span[0])
                out[piece] = data if len(data) == span[1] - span[0] else None
            continue
        mine, body = SHELF.local(key)
        if mine:
            out[piece] = _cut(body, span)
        else:
            query = f"?range={span[0]}-{span[1]}" if span is not None else ""
            remote[parsed[0]].append((piece, f"/bodies/{parsed[1]}{query}"))
    if whole_in_store:
        out.update(zip(whole_in_store, blobs.get_many([key for key, _ in whole_in_store])))
    if remote:
        with ThreadPoolExecutor(max_workers=min(8, len(remote))) as pool:
            for address, got in zip(remote, pool.map(_fetch_from, remote, remote.values())):
                if got is None:
                    log.warning("replica %s cannot be reached: its uploads are recomputed, and "
                                "replicas keep bodies in Redis for %.0f s", address, PEER_DOWN_TTL_S)
                    blobs.set(keys.peer_down(address), b"1", ttl=PEER_DOWN_TTL_S)
                    got = dict.fromkeys((piece for piece, _ in remote[address]), None)
                out.update(got)
    return out


def _cut(body: memoryview | None, span: Range) -> memoryview | None:
    if body is None or span is None:
        return body
    return body[span[0]:span[1]] if 0 <= span[0] <= span[1] <= body.nbytes else None


def _fetch_from(address: str, wanted: list[tuple[Piece, str]]
                ) -> dict[Piece, memoryview | None] | None:
    """The pieces one replica holds, over one kept-alive connection; None when it cannot be
    reached (refused, reset, silent past the timeout).

    A connection refused or reset is tried once more, for the pieces not yet read, before the
    replica counts as down: marking it down deletes every result it holds (their shards are
    recomputed), and a sliced step makes P fetches of each replica, so one blip would otherwise
    cost P times more often. A timeout is not retried: two would outlast the apply claim."""
    got: dict[Piece, memoryview | None] = {}
    for attempt in range(FETCH_ATTEMPTS):
        try:
            if not _fetch_into(got, address, [w for w in wanted if w[0] not in got]):
                return None  # some other service answers there: retrying will not change it
            return got
        except TimeoutError as exc:
            log.warning("peer fetch from %s timed out: %r", address, exc)
            return None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.warning("peer fetch from %s failed (attempt %d of %d): %r", address,
                        attempt + 1, FETCH_ATTEMPTS, exc)
            if attempt + 1 < FETCH_ATTEMPTS:
                time.sleep(FETCH_RETRY_PAUSE_S)
    return None


def _fetch_into(got: dict[Piece, memoryview | None], address: str,
                wanted: list[tuple[Piece, str]]) -> bool:
    """Read `wanted` from one replica into `got`, piece by piece (what was read before a
    failure stays read); False when the answer is not from the replica the key names."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=FETCH_TIMEOUT_S)
    try:
        for piece, path in wanted:
            conn.request("GET", path)
            resp = conn.getresponse()
            if resp.getheader(PEER_HEADER) != address:  # not the replica the key names
                log.warning("%s answered as %r: not the replica its key names", address,
                            resp.getheader(PEER_HEADER))
                return False
            if resp.status != 200:
                resp.read()
                got[piece] = None
                continue
            length = int(resp.getheader("Content-Length", "0"))
            if length == 0:  # (an empty range): read to the end, or the connection is stuck
                resp.read()
            buf = new_buffer(length)
            read = 0
            while read < length:
                n = resp.readinto(buf[read:])
                if not n:
                    raise ConnectionError("the replica closed the connection mid-body")
                read += n
            got[piece] = buf
        return True
    finally:
        conn.close()
