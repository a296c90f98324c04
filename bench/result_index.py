"""What finding a step's keys costs as the Redis keyspace grows: a SCAN by prefix vs the index.

    source scripts/services.sh && ensure_services
    .venv/bin/python bench/result_index.py [--redis-url redis://127.0.0.1:6379/10] \
        [--keyspace 20000,200000,1000000] [--shards 138]

Every applied step (and every reconcile pass of a running job) drops the keys of the steps
before it. Old: list the job's keys by a SCAN of the whole keyspace (`BlobStore.keys`), keep
those of earlier steps, delete them (scheduler.tasks.recovery.drop_step_keys until issue 45).
New: read them from the job's step index (`BlobStore.step_keys`, one ZRANGEBYSCORE) and delete
them. Also timed: the listing alone, the lookup an upload and a work answer make ("which of
this step's results are stored?": old, the step's grad keys by SCAN; new, gradstore.stored_nodes,
one which_exist over the tree's 2S - 1 keys), and what the index costs each write of a step's
key (SET, and ZADD in one MULTI/EXEC) against a plain SET. A step holds, per shard, a result and
its uploader record, plus one upload body per 8 shards, the covered counter, an apply claim and
the next step's state (kept). The keyspace is filled with unrelated per-device keys. Old and
new run alternately, call by call; medians. The database must be empty at the start (the bench
refuses otherwise) and is flushed at the end: never point it at a database in use.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotstate import keys  # noqa: E402
from hotstate.blobs import RedisBlobStore  # noqa: E402
from hotstate.gradstore import stored_nodes  # noqa: E402

JOB, STEP = "j", 7
FILL_CHUNK = 50_000  # keys per Lua call: Redis is held ~50 ms at a time, not for the whole fill
_FILL = "for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do " \
        "redis.call('SET', 'job:other' .. (i % 1000) .. ':lat:dev' .. i, '0.1') end return 0"


def fill(store: RedisBlobStore, have: int, want: int) -> None:
    """Unrelated keys `have`..`want` - 1 (other jobs' per-device keys)."""
    for lo in range(have, want, FILL_CHUNK):
        store._redis.eval(_FILL, 0, lo, min(lo + FILL_CHUNK, want) - 1)


def write_step(store: RedisBlobStore, shards: int) -> None:
    """A finished step's keys, as uploads, reconcile and the apply leave them."""
    for k in range(shards):
        store.set(keys.grad(JOB, STEP, k), b"ref")
        store.set(keys.uploader(JOB, STEP, k, 1), b"dev")
    for b in range(0, shards, 8):
        store.set(keys.upload_body(JOB, STEP, f"u{b}"), b"body")
    store.incr(keys.covered(JOB, STEP), shards)
    store.set(keys.apply_claim(JOB, STEP), b"1", ttl=60)
    store.set(keys.state(JOB, STEP + 1, "n"), b"state")


def drop_by_scan(store: RedisBlobStore) -> int:
    """The drop before the index (drop_step_keys as it was)."""
    stale = [k for k in store.keys(keys.job_prefix(JOB))
             if (step := keys.step_of_key(k)) is not None and step < STEP + 1]
    store.delete(*stale)
    return len(stale)


def drop_by_index(store: RedisBlobStore) -> int:
    stale = store.step_keys(JOB, 0, STEP + 1)
    store.delete(*stale)
    return len(stale)


def alternated(calls: list[Callable[[], object]], repeats: int,
               before: Callable[[], None] | None = None) -> list[float]:
    """Median milliseconds of each call, taken in turn (`before` each one, untimed)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for out, call in zip(times, calls):
            if before is not None:
                before()
            t = time.perf_counter()
            call()
            out.append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in times]


def measure(store: RedisBlobStore, shards: int, repeats: int) -> dict[str, list[float]]:
    prefix, wanted = keys.grad_prefix(JOB, STEP), keys.job_prefix(JOB)
    write_step(store, shards)
    dropped = drop_by_scan(store)
    write_step(store, shards)
    assert drop_by_index(store) == dropped, "both ways drop the same keys"
    drop = alternated([lambda: drop_by_scan(store), lambda: drop_by_index(store)], repeats,
                      before=lambda: write_step(store, shards))
    write_step(store, shards)  # the step's keys, there while the lookups are timed
    assert len(store.keys(prefix)) == len(stored_nodes(store, JOB, STEP, shards))
    out = {
        "drop": drop,
        "list": alternated([lambda: store.keys(wanted),
                            lambda: store.step_keys(JOB, 0, STEP + 1)], repeats),
        "results": alternated([lambda: store.keys(prefix),
                               lambda: stored_nodes(store, JOB, STEP, shards)], repeats),
        "write": alternated([lambda: store.set("bench:plain", b"ref"),
                             lambda: store.set(keys.grad(JOB, STEP, 0), b"ref")], repeats * 20),
    }
    drop_by_index(store)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/10")
    ap.add_argument("--keyspace", default="20000,200000,1000000")
    ap.add_argument("--shards", type=int, default=138)
    ap.add_argument("--scans", type=int, default=10_000_000,
                    help="keys scanned per way and measure: repeats = max(5, this / keyspace)")
    args = ap.parse_args()
    store = RedisBlobStore(args.redis_url)
    if store._redis.dbsize():
        sys.exit(f"{args.redis_url} is not empty: give the bench a database of its own")
    print(f"{'keyspace':>9} {'what':>8} {'old (SCAN)':>11} {'new (index)':>12} {'ratio':>7}")
    have = 0
    try:
        for keyspace in map(int, args.keyspace.split(",")):
            fill(store, have, keyspace)
            have = keyspace
            repeats = max(5, args.scans // keyspace)
            for what, (old, new) in measure(store, args.shards, repeats).items():
                if what == "write":  # no SCAN here: a plain SET vs SET + ZADD
                    print(f"{keyspace:>9,} {what:>8} {old:>8.3f} ms {new:>9.3f} ms "
                          f"{new / old:>6.2f}x cost")
                else:
                    print(f"{keyspace:>9,} {what:>8} {old:>8.3f} ms {new:>9.3f} ms "
                          f"{old / new:>7.1f}")
    finally:
        store.flush()


if __name__ == "__main__":
    main()
