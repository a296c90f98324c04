"""Placement time for a 138-device gang in fleets of 1,000 and 10,000 devices.

    .venv/bin/python bench/scheduler_placement.py [--repeats 7]

The pure policy (filter, score, pick, shard balance) on frozen device views, as the placement
pass runs it. Target: < 100 ms at 10,000 devices, growing no worse than linearly.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from scheduler.policy.placement import place_gang
from scheduler.policy.types import DeviceView, PlacementRequest


def fleet(n: int, seed: int = 0) -> list[DeviceView]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(DeviceView(
            id=f"dev-{i:06d}",
            state="NotReady" if rng.random() < 0.05 else "Ready",
            cordoned=rng.random() < 0.02,
            labels={"rack": rng.choice("abcd")},
            battery_pct=rng.uniform(5, 100), charging=rng.random() < 0.7,
            temp_c=rng.uniform(25, 50), cpu_cores=8,
            speeds={"mobilenet_v1": rng.uniform(20, 80)} if rng.random() < 0.8 else {},
            job_id="job-other" if rng.random() < 0.1 else None,
        ))
    return out


def time_placement(n: int, repeats: int) -> dict[str, float]:
    devices = fleet(n)
    req = PlacementRequest(job_id="job-gang", arch="mobilenet_v1", shards=552, min_devices=138,
                           max_devices=138)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = place_gang(req, devices)
        times.append(time.perf_counter() - t0)
        assert plan.admitted and len(plan.devices) == 138
    return {"fleet": n, "median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = [time_placement(n, args.repeats) for n in (1_000, 10_000)]
    for row in rows:
        print(f"fleet {row['fleet']:>6}: place 138-device gang {row['median_ms']:.1f} ms "
              f"(min {row['min_ms']:.1f})")
    growth = rows[1]["median_ms"] / rows[0]["median_ms"]
    print(f"10x fleet -> {growth:.1f}x time (linear would be 10x)")
    print(json.dumps({"placement": rows, "growth_10x": growth}))


if __name__ == "__main__":
    main()
