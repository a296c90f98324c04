"""A model of one synchronous step, calibrated on measured runs, projected to a 138-phone fleet.

    .venv/bin/python bench/fleet_projection.py --measured runs.json [--svg docs/img/fleet_projection.svg]

`runs.json`: the JSON line `bench/scheduler_coordination.py --agents 4,8,16 --modes embedded`
prints last (its runs; gloo's are ignored). Without `--measured` the runs are made first.

A step, as Phalanx runs it today: every phone long-polls, downloads the weights (M bytes),
computes its k shards side by side, uploads one result per shard (k x M), and the replica
that receives the last upload reduces the results and updates the state in one thread.
Nothing overlaps. So, for N phones on R replicas:

    step = compute + download + upload + apply + latency
    download = max(M / phone_link, N M / (R server_link), cpu_per_byte N M / (R u))
    upload   = max(U M / phone_link, N U M / (R server_link), cpu_per_byte N U M / (R u))
    apply    = reduce_per_byte x (N U M) / slices + update_per_byte x M

with U the vectors a phone uploads (k today; 1 after issue 21 item 1's pre-reduce of aligned
shard ranges, and half the bytes again with bfloat16 uploads), u the cores one replica's data
plane uses (one Python process: 1.8, the issue's 16-core measurement), `slices` the parameter
vector's parts applied in parallel (issue 21 item 2; 1 today).

Calibrated here, on this machine (where the agents share the server's 2 cores, so the measured
wall is total CPU / 2 + latency): cpu_per_byte and the agents' CPU per phone are fitted to the
measured CPU of each process group; latency is what CPU does not explain. Each run's wall is then
predicted from a fit of the *other* runs (leave one out) and the error printed: the model is
trusted for the projection only if every error is within 25%. reduce_per_byte and
update_per_byte are timed here, with numpy, the way apply_step adds and updates.

Phone side (not measurable here; stated, so a lab can put its own): a Galaxy S10+ class phone
computes 4 shards side by side on its 4 big cores at 12 GFLOP/s each in numpy, on 1 GbE
(docs/benchmarks.md, "The seed papers' models at full size", says where these come from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.models import layer_infos, parameter_count  # noqa: E402

BENCH_PARAMS = 3_217_226  # bench/scheduler_coordination.py's vector (mobilenet_v1, 10 classes)
GBIT = 1e9 / 8
SHARDS_PER_PHONE = 4  # one per big core of an S10+ class phone
SERVER_CORES_PER_REPLICA = 1.8  # issue 21: 229 ms of server CPU per 125 ms step at 8 agents, 16 cores


@dataclass(frozen=True)
class Calibration:
    cpu_per_byte: float  # server CPU seconds per byte through the data plane (down or up)
    cpu_fixed: float  # server CPU seconds per step whatever the bytes
    agent_cpu: float  # CPU seconds per simulated agent per step (here only: phones bring their own)
    latency: float  # seconds per step that CPU does not explain (long-poll wake-ups, commits)
    reduce_per_byte: float  # float64 accumulate of a float32 vector, seconds per input byte
    update_per_byte: float  # SGD with momentum, seconds per parameter byte


@dataclass(frozen=True)
class Fleet:
    phones: int
    model_bytes: float  # M: float32 weights
    flops_per_sample: float
    micro_batch: int = 8  # samples per shard per step
    phone_gflops_per_core: float = 12.0
    phone_link: float = 1 * GBIT
    server_link: float = 25 * GBIT
    replicas: int = 1
    uploads_per_phone: float = 4.0  # U: vectors of M bytes each phone uploads a step
    slices: int = 1


def compute_s(f: Fleet) -> float:
    # k shards side by side, one core each (issue 20 item 7)
    return f.micro_batch * f.flops_per_sample / (f.phone_gflops_per_core * 1e9)


def step_s(f: Fleet, c: Calibration, cores: float = SERVER_CORES_PER_REPLICA) -> dict[str, float]:
    m, n, r = f.model_bytes, f.phones, f.replicas
    up = f.uploads_per_phone * m
    download = max(m / f.phone_link, n * m / (r * f.server_link),
                   c.cpu_per_byte * n * m / (r * cores))
    upload = max(up / f.phone_link, n * up / (r * f.server_link),
                 c.cpu_per_byte * n * up / (r * cores))
    apply = c.reduce_per_byte * n * up / f.slices + c.update_per_byte * m
    parts = {"compute": compute_s(f), "download": download, "upload": upload, "apply": apply,
             "latency": c.latency}
    parts["step"] = sum(parts.values())
    parts["efficiency"] = parts["compute"] / parts["step"]
    return parts


# -- calibration ------------------------------------------------------------------------------
def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def bytes_moved(agents: int) -> float:
    return 2 * agents * 4 * BENCH_PARAMS  # one vector down and one up per agent (k = 1)


def server_cpu(cpu: dict[str, float]) -> float:
    """Every server-side process's CPU a step: the API and workers (one "server" group in
    runs before the bench split them), Postgres and Redis."""
    return sum(v for g, v in cpu.items() if g != "agents")


def fit(runs: list[dict], here_cores: float, reduce_b: float, update_b: float) -> Calibration:
    agents = [float(r["agents"]) for r in runs]
    server = [server_cpu(r["cpu_s_per_step"]) for r in runs]
    fixed, per_byte = _line([bytes_moved(int(a)) for a in agents], server)
    _, per_agent = _line(agents, [r["cpu_s_per_step"]["agents"] for r in runs])
    latency = statistics.fmean(
        r["step_wall_s"] - _cpu_bound(r["agents"], fixed, per_byte, per_agent, here_cores)
        for r in runs)
    return Calibration(max(per_byte, 0.0), fixed, max(per_agent, 0.0), max(latency, 0.0),
                       reduce_b, update_b)


def _cpu_bound(agents: int, fixed: float, per_byte: float, per_agent: float, cores: float) -> float:
    return (fixed + per_byte * bytes_moved(agents) + per_agent * agents) / cores


def predict_here(agents: int, c: Calibration, here_cores: float) -> float:
    return _cpu_bound(agents, c.cpu_fixed, c.cpu_per_byte, c.agent_cpu, here_cores) + c.latency


def time_numpy(n: int = BENCH_PARAMS, repeats: int = 5) -> tuple[float, float]:
    """Seconds per byte of apply_step's two kinds of work, best of `repeats`."""
    g = np.ones(n, np.float32)
    acc = np.zeros(n, np.float64)
    p, v = np.ones(n, np.float32), np.zeros(n, np.float32)
    adds, updates = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(8):
            acc += g
        adds.append((time.perf_counter() - t0) / (8 * 4 * n))
        t0 = time.perf_counter()
        v64 = 0.9 * v.astype(np.float64) + acc / 8
        p[:] = p.astype(np.float64) - 0.01 * v64
        v[:] = v64
        updates.append((time.perf_counter() - t0) / (4 * n))
    return min(adds), min(updates)


def measure() -> list[dict]:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "scheduler_coordination.py"),
                          "--agents", "4,8,16", "--modes", "embedded", "--steps", "12",
                          "--gloo-max", "0"], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- projection -------------------------------------------------------------------------------
def model_facts(arch: str) -> tuple[float, float]:
    """(float32 weight bytes, forward + backward FLOPs per sample) at 3x224x224, 1000 classes."""
    shape = (3, 224, 224)
    macs = sum(i.macs for i in layer_infos(arch, shape, 1000)
               if i.type in ("conv2d", "depthwise_conv2d", "dense"))
    return 4.0 * parameter_count(arch, shape, 1000), 3 * 2.0 * macs


DESIGNS = {  # what a phone uploads a step (U, in vectors of M bytes) and the slices applied
    "today (k results)": lambda k: (float(k), 1),
    # one partial a phone, in the upload precision (engine.precision.node_precision: float32,
    # or bfloat16 for a bfloat16 job: half the bytes), the shards an aligned block of the tree
    "pre-reduced (21.1)": lambda k: (1.0, 1),
    "pre-reduced + bf16 + 8 slices": lambda k: (0.5, 8),
}


def project(c: Calibration, arch: str, phones: int, replicas: int, link_gbit: float,
            design: str, micro_batch: int = 8) -> dict[str, float]:
    m, flops = model_facts(arch)
    uploads, slices = DESIGNS[design](SHARDS_PER_PHONE)
    f = Fleet(phones=phones, model_bytes=m, flops_per_sample=flops, micro_batch=micro_batch,
              server_link=link_gbit * GBIT, replicas=replicas,
              uploads_per_phone=uploads, slices=slices)
    return step_s(f, c)


def svg_chart(series: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """Efficiency against fleet size, one line per series: a plain SVG (no plotting library)."""
    w, h, left, bottom, legend = 900, 360, 50, 40, 260  # the legend right of the plot
    xs = [x for pts in series.values() for x, _ in pts]
    x0, x1 = min(xs), max(xs)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (w - left - legend - 20),
                h - bottom - y * (h - bottom - 30))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>']
    for y in (0, 0.25, 0.5, 0.75, 0.9, 1.0):
        a, b = px(x0, y), px(x1, y)
        dash = ' stroke-dasharray="4 3"' if y == 0.9 else ""
        parts.append(f'<line x1="{a[0]:.1f}" y1="{a[1]:.1f}" x2="{b[0]:.1f}" y2="{b[1]:.1f}" '
                     f'stroke="#ccc"{dash}/><text x="{left - 6}" y="{a[1] + 4:.1f}" '
                     f'text-anchor="end">{y:.0%}</text>')
    for x in sorted(set(xs)):
        a = px(x, 0)
        parts.append(f'<text x="{a[0]:.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>')
    parts.append(f'<text x="{(w - legend) / 2}" y="{h - 6}" text-anchor="middle">phones</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = colors[i % len(colors)]
        line = " ".join(f"{px(x, y)[0]:.1f},{px(x, y)[1]:.1f}" for x, y in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        key_x, key_y = w - legend + 4, 50 + 18 * i
        parts.append(f'<line x1="{key_x}" y1="{key_y - 4}" x2="{key_x + 16}" y2="{key_y - 4}" '
                     f'stroke="{color}" stroke-width="2"/><text x="{key_x + 22}" y="{key_y}">'
                     f'{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measured", type=Path, help="scheduler_coordination.py's JSON line")
    parser.add_argument("--here-cores", type=float, default=2.0)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--svg", type=Path)
    args = parser.parse_args()
    runs = json.loads(args.measured.read_text().strip().splitlines()[-1]) if args.measured else measure()
    runs = [r for r in runs if "step_wall_s" in r and r.get("mode", "embedded") == "embedded"]
    reduce_b, update_b = time_numpy()
    c = fit(runs, args.here_cores, reduce_b, update_b)
    print(f"calibration: {c}")
    print("agents  measured  predicted (fit without this run)  error")
    worst = 0.0
    for r in runs:
        others = [o for o in runs if o is not r]
        held_out = fit(others, args.here_cores, reduce_b, update_b) if len(others) >= 2 else c
        predicted = predict_here(r["agents"], held_out, args.here_cores)
        err = predicted / r["step_wall_s"] - 1
        worst = max(worst, abs(err))
        print(f"{r['agents']:>6}  {r['step_wall_s'] * 1000:6.0f} ms  {predicted * 1000:6.0f} ms"
              f"{'':26}{err:+.0%}")
    print(f"worst leave-one-out error {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} 25%)")
    print(f"\n138 phones, 4 shards each, micro-batch {args.micro_batch}, 1 GbE phones "
          f"(step s, efficiency = compute / step)")
    print(f"{'model':13} {'design':31} {'replicas':>8} {'10 GbE':>16} {'25 GbE':>16}")
    for arch in ("mobilenet_v1", "resnet50"):
        for design in DESIGNS:
            for replicas in (1, 2, 4, 6, 8):
                cells = []
                for link in (10, 25):
                    p = project(c, arch, 138, replicas, link, design, args.micro_batch)
                    cells.append(f"{p['step']:6.1f} s {p['efficiency']:5.0%}")
                print(f"{arch:13} {design:31} {replicas:>8} {cells[0]:>16} {cells[1]:>16}")
    fleet = [8, 16, 32, 64, 138, 276]
    if args.svg:
        series = {}
        best = list(DESIGNS)[-1]
        for design, replicas in [(d, r) for d in DESIGNS for r in (1, 4)] + [(best, 8)]:
            series[f"{design}, {replicas} replica(s)"] = [
                (n, project(c, "resnet50", n, replicas, 25, design, args.micro_batch)["efficiency"])
                for n in fleet]
        svg_chart(series, args.svg, f"resnet50 224x224, 4 shards x {args.micro_batch} per phone, "
                                    "25 GbE replicas: scaling efficiency")
        print(f"\nwrote {args.svg}")
    for replicas in (4, 8):
        print(f"\nresnet50, 25 GbE, {replicas} replicas: where a step goes (s)")
        for n in fleet:
            p = project(c, "resnet50", n, replicas, 25, "pre-reduced + bf16 + 8 slices",
                        args.micro_batch)
            print(f"{n:>4} phones: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()
                                                 if k not in ("step", "efficiency"))
                  + f"; step {p['step']:.2f}, efficiency {p['efficiency']:.0%}")


if __name__ == "__main__":
    main()
