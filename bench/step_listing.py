"""What asking "which of this step's results are stored?" costs as the keyspace grows.

    source scripts/services.sh && ensure_services
    .venv/bin/python bench/step_listing.py [--redis-url redis://127.0.0.1:6379/12] \
        [--keyspace 1000,5000,20000] [--shards 8,138] [--repeats 200]

Every upload and every work answer asks it (two calls a phone a step). Baseline: listing the
step's keys by prefix (`BlobStore.keys`: a SCAN over the whole keyspace, what the server did
until session 21). New: `gradstore.stored_nodes`, which asks the reduction tree's 2S - 1
possible keys in one round trip (`which_exist`, a Lua script), as an upload does; and a work
answer, which asks only the nodes over the device's shards (here one shard: log2(S) + 1 keys). The keyspace is filled with
per-device keys (the kind that grows with the fleet) and half the step's leaves are stored.
Both are timed alternately in the same loop, on real Redis and on the in-process store.
Flushes the Redis database it is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotstate import keys  # noqa: E402
from hotstate.blobs import BlobStore, MemoryBlobStore, RedisBlobStore  # noqa: E402
from hotstate.gradstore import stored_nodes  # noqa: E402


def fill(store: BlobStore, keyspace: int, shards: int) -> None:
    for i in range(keyspace):
        store.set(f"job:j:lat:dev{i}", b"0.1")
    for k in range(0, shards, 2):
        store.set(keys.grad("j", 7, k), b"ref")


def timed(fn, repeats: int) -> tuple[float, ...]:
    """Median milliseconds of each way, alternated call by call."""
    times: list[list[float]] = [[] for _ in fn]
    for _ in range(repeats):
        for out, call in zip(times, fn):
            t = time.perf_counter()
            call()
            out.append(time.perf_counter() - t)
    return tuple(statistics.median(t) * 1e3 for t in times)


def measure(store: BlobStore, shards: int, repeats: int) -> tuple[float, ...]:
    prefix = keys.grad_prefix("j", 7)
    assert len(store.keys(prefix)) == len(stored_nodes(store, "j", 7, shards))
    return timed((lambda: store.keys(prefix),
                  lambda: stored_nodes(store, "j", 7, shards),
                  lambda: stored_nodes(store, "j", 7, shards, over=[shards - 1])), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", default=os.environ.get("PHALANX_TEST_REDIS_URL",
                                                          "redis://127.0.0.1:6379/12"))
    ap.add_argument("--keyspace", default="1000,5000,20000")
    ap.add_argument("--shards", default="8,138")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"{'store':7} {'keys':>6} {'shards':>6} {'by prefix (SCAN)':>17} {'whole tree':>11} "
          f"{'ratio':>6} {'one path':>9} {'ratio':>6}")
    for keyspace in map(int, args.keyspace.split(",")):
        for shards in map(int, args.shards.split(",")):
            stores: list[tuple[str, BlobStore]] = [("memory", MemoryBlobStore())]
            redis_store = RedisBlobStore(args.redis_url)
            redis_store.flush()
            stores.append(("redis", redis_store))
            for name, store in stores:
                fill(store, keyspace, shards)
                old, new, path = measure(store, shards, args.repeats)
                print(f"{name:7} {keyspace:>6} {shards:>6} {old:>14.3f} ms {new:>8.3f} ms "
                      f"{old / new:>6.1f} {path:>6.3f} ms {old / path:>6.1f}")
            redis_store.flush()


if __name__ == "__main__":
    main()
