"""A small control plane for the work-loop tests, speaking docs/contracts.md over real HTTP.

The scheduler's step-protocol routes are built in parallel; until they land these tests need
something that hands out work, serves weights and shard data and applies steps. It uses the real
engine (`agent.nn`, `agent.wire`), so what the agent uploads is checked by the real decoder.
Tests for enrollment, leases and revocation run against the real `phalanx server` instead.
"""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from agent.nn.data import dataset_info, load_dataset
from agent.nn.models import build_model
from agent.nn.sampler import shard_indices, total_steps
from agent.nn.spec import TrainSpec
from agent.nn.step import apply_step, initial_state
from agent.wire import decode_results, encode_weights

TOKEN = "dev-token"
JOB_SPEC = {"name": "digits-logreg", "model": {"arch": "logreg"}, "dataset": "digits",
            "global_batch_size": 64, "shards": 4, "epochs": 2, "seed": 0,
            "optimizer": {"lr": 0.1}, "placement": {"max_temp_c": 45, "min_battery": 20}}


class StepServer:
    def __init__(self, spec: dict[str, Any] | None = None, device_id: str = "dev-1") -> None:
        self.spec_json = dict(spec or JOB_SPEC)
        info = dataset_info(self.spec_json["dataset"])
        self.info = info
        self.spec = TrainSpec.from_job_spec(self.spec_json, n_train=info.n_train)
        self.model = build_model(self.spec.arch, info.input_shape, info.num_classes,
                                 {k: v for k, v in self.spec_json["model"].items() if k != "arch"})
        self.state = initial_state(self.model, self.spec)
        self.total = total_steps(info.n_train, self.spec.shards, self.spec.global_batch_size,
                                 self.spec.epochs)
        data = load_dataset(self.spec_json["dataset"])
        idx = shard_indices(info.n_train, self.spec.shards, self.spec.seed)
        self.shard_blobs = {k: _npz(data.x_train[i], data.y_train[i]) for k, i in enumerate(idx)}
        self.device_id, self.job_id = device_id, "job-test"
        self.lock = threading.Lock()
        self.pending: dict[int, Any] = {}
        self.uploads: list[tuple[int, int]] = []  # (step, shard) in arrival order, duplicates too
        self.duplicates = 0
        self.heartbeats: list[dict[str, Any]] = []
        self.fail_heartbeats = 0  # answer 503 to this many heartbeats
        self.revoked = False
        self.job_active = True
        self.losses: list[float] = []
        self.max_steps = self.total
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> StepServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()

    def assignment(self) -> dict[str, Any] | None:
        with self.lock:
            if not self.job_active or self.state.step >= self.max_steps:
                return None
            todo = [k for k in range(self.spec.shards) if k not in self.pending]
            return {"job_id": self.job_id, "step": self.state.step, "shards": todo,
                    "spec": self.spec_json, "n_params": self.model.n_params,
                    "n_buffers": self.model.n_buffers, "n_stats": self.model.n_stats,
                    "total_steps": self.total, "n_train": self.info.n_train,
                    "input_shape": list(self.info.input_shape),
                    "num_classes": self.info.num_classes}

    def upload(self, step: int, body: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if step != self.state.step:
                return 409, {"detail": f"job is at step {self.state.step}, not {step}"}
            results = decode_results(body, expect_job=self.job_id, expect_step=step,
                                     n_params=self.model.n_params, n_stats=self.model.n_stats)
            accepted, dups = [], []
            for r in results:
                self.uploads.append((step, r.shard))
                if r.shard in self.pending:
                    dups.append(r.shard)
                    self.duplicates += 1
                else:
                    self.pending[r.shard] = r
                    accepted.append(r.shard)
            if len(self.pending) == self.spec.shards:
                self.state, metrics = apply_step(self.model, self.spec, self.state,
                                                 list(self.pending.values()))
                self.losses.append(metrics.train_loss)
                self.pending = {}
            return 200, {"accepted": accepted, "duplicates": dups}

    def wait_for(self, predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, body: Any, ctype: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if server.revoked or self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._reply(401, {"detail": "invalid or revoked token"})
                    return False
                return True

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                if not self._authorized():
                    return
                if parts[-1] == "work":
                    wait = float(urllib.parse.parse_qs(url.query).get("wait", ["0"])[0])
                    deadline = time.monotonic() + min(wait, 0.5)
                    a = server.assignment()
                    while a is None and time.monotonic() < deadline:
                        time.sleep(0.02)
                        a = server.assignment()
                    self._reply(200, {"assignment": a})
                elif parts[-1] == "weights":
                    step = int(urllib.parse.parse_qs(url.query)["step"][0])
                    with server.lock:
                        st = server.state
                    if step != st.step:
                        self._reply(409, {"detail": f"job is at step {st.step}, not {step}"})
                    else:
                        self._reply(200, encode_weights(server.job_id, st.step, st.params,
                                                        st.buffers), "application/octet-stream")
                elif parts[-1] == "data":
                    self._reply(200, server.shard_blobs[int(parts[-2])], "application/octet-stream")
                else:
                    self._reply(404, {"detail": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                parts = self.path.strip("/").split("/")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._authorized():
                    return
                if parts[-1] == "heartbeat":
                    if server.fail_heartbeats > 0:
                        server.fail_heartbeats -= 1
                        self._reply(503, {"detail": "restarting"})
                        return
                    server.heartbeats.append(json.loads(body))
                    self._reply(200, {"device_id": server.device_id, "state": "Ready",
                                      "lease": {"renewed_at": time.time(), "grace_s": 40},
                                      "heartbeat_interval_s": 0.1, "commands": []})
                elif parts[-1] == "gradients":
                    status, reply = server.upload(int(parts[-2]), body)
                    self._reply(status, reply)
                else:
                    self._reply(404, {"detail": "not found"})

        return Handler


def _npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x.astype(np.float32), y=y.astype(np.int64))
    return buf.getvalue()
