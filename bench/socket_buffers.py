"""CPU cost of the step's loopback transfers by kernel socket buffer size.

    .venv/bin/python bench/socket_buffers.py [--streams 8] [--mb 12.9] [--rounds 20]
        [--sizes 0,65536,262144,524288,1048576] [--repeats 5]

Set up as the control plane and its agents are: a "server" process listening with the buffer
size set on its listening socket (as `api.steps.bulk_listener` does) and a "client" process whose
connections set it right after connecting (as the agent's `agent.transport` does). `--streams`
connections each carry `--mb` MB per round, `--rounds` times, each round ended by a one-byte
answer: first client -> server (a step's uploads), then server -> client (its weights answers).
Reported per size: the median over `--repeats` (sizes interleaved: this machine's speed drifts)
of both processes' CPU per round (user + system, getrusage) and the wall time, and the ratio to
size 0, the kernel's autotuning, measured in the same run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wire.sockopts import set_socket_buffers  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def move(conns: list[socket.socket], sending: bool, nbytes: int, rounds: int) -> float:
    """Every connection carries `nbytes` per round, this side sending or receiving; returns
    this process's CPU seconds per round."""
    data = np.ones(nbytes, np.uint8)

    def run(conn: socket.socket) -> None:
        view = memoryview(np.empty(nbytes, np.uint8))
        for _ in range(rounds):
            if sending:
                conn.sendall(data)
                conn.recv(1)
            else:
                got = 0
                while got < nbytes:
                    got += conn.recv_into(view[got:], nbytes - got, socket.MSG_WAITALL)
                conn.sendall(b"k")

    threads = [threading.Thread(target=run, args=(c,)) for c in conns]
    before = cpu_s()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (cpu_s() - before) / rounds


def server(size: int, n: int, nbytes: int, rounds: int, ports: Any, out: Any,
           after_accept: bool) -> None:
    listener = socket.socket()
    if not after_accept:
        set_socket_buffers(listener, size)  # before listen(): accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    listener.listen(n)
    ports.put(listener.getsockname()[1])
    conns = [listener.accept()[0] for _ in range(n)]
    if after_accept:
        for conn in conns:
            set_socket_buffers(conn, size)
    out.put((move(conns, False, nbytes, rounds), move(conns, True, nbytes, rounds)))


def one_size(size: int, n: int, nbytes: int, rounds: int, after_accept: bool) -> dict[str, float]:
    ports, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=server, args=(size, n, nbytes, rounds, ports, out, after_accept))
    proc.start()
    port = ports.get(timeout=30)
    conns = []
    for _ in range(n):
        conn = socket.create_connection(("127.0.0.1", port))
        set_socket_buffers(conn, size)  # after connecting, as the agent does
        conns.append(conn)
    started = time.perf_counter()
    up_client = move(conns, True, nbytes, rounds)
    up_wall = (time.perf_counter() - started) / rounds
    started = time.perf_counter()
    down_client = move(conns, False, nbytes, rounds)
    down_wall = (time.perf_counter() - started) / rounds
    up_server, down_server = out.get(timeout=120)
    proc.join()
    for conn in conns:
        conn.close()
    return {"up_cpu": (up_client + up_server) * 1e3, "down_cpu": (down_client + down_server) * 1e3,
            "up_wall": up_wall * 1e3, "down_wall": down_wall * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--mb", type=float, default=12.9)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sizes", default="0,65536,262144,524288,1048576")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-after-accept", action="store_true",
                        help="the server sets the sizes on each accepted connection instead")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if 0 not in sizes:
        sizes.insert(0, 0)
    nbytes = int(args.mb * 1e6)
    results: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
    for _ in range(args.repeats):
        for size in sizes:
            results[size].append(one_size(size, args.streams, nbytes, args.rounds,
                                          args.server_after_accept))

    def median(size: int, key: str) -> float:
        return statistics.median(r[key] for r in results[size])

    def both(size: int) -> float:
        return statistics.median(r["up_cpu"] + r["down_cpu"] for r in results[size])

    print(f"{args.streams} connections x {args.mb} MB each way, CPU of both ends per round "
          f"(median of {args.repeats}):")
    for size in sizes:
        label = "autotuning" if size == 0 else f"{size // 1024} KiB"
        print(f"{label:>11}: up {median(size, 'up_cpu'):5.1f} ms (wall {median(size, 'up_wall'):5.1f}),"
              f" down {median(size, 'down_cpu'):5.1f} ms (wall {median(size, 'down_wall'):5.1f}),"
              f" {both(size) / both(0):.2f}x autotuning's CPU", flush=True)


if __name__ == "__main__":
    main()
