"""One runner (engine.runner) computes every shard: the phone's compute worker, the fleet
simulator and the reference trainer give the same bytes for the same shard, because all three
go through it (invariant 1 by construction, not by three copies kept alike)."""

from __future__ import annotations

from pathlib import Path

import pytest
from threadpoolctl import threadpool_limits

from agent.runtime import worker
from engine import runner
from engine.data import load_dataset
from engine.sampler import shard_indices
from engine.step import initial_state
from phalanx.sim import compute as sim
from phalanx.train_local import run_reference
from tests.support.arrays import npz_bytes
from wire.assignment import Assignment
from wire.messages import decode_results, encode_weights

SPEC = {"name": "cnn", "model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 64,
        "shards": 8, "epochs": 1, "seed": 5, "optimizer": {"lr": 0.05}}
SHARD, STEP = 3, 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(step, shard) of every gradient computed through the runner."""
    seen: list[tuple[int, int]] = []
    inner = runner._compute_shard

    def counting(model, params, buffers, xb, yb, spec, step, shard, backend="numpy"):
        seen.append((step, shard))
        return inner(model, params, buffers, xb, yb, spec, step, shard, backend)

    monkeypatch.setattr(runner, "_compute_shard", counting)
    return seen


def test_the_worker_the_simulator_and_the_reference_give_the_same_shard_bytes(
        tmp_path: Path, calls: list[tuple[int, int]]) -> None:
    data = load_dataset("digits")
    job = runner.job_model(SPEC, len(data.y_train), data.input_shape, data.num_classes)
    state = initial_state(job.model, job.spec)
    idx = shard_indices(len(data.y_train), job.spec.shards, job.spec.seed)[SHARD]
    npz = npz_bytes(x=data.x_train[idx], y=data.y_train[idx])

    with threadpool_limits(limits=1, user_api="blas"):  # as every phone and the reference run
        # the reference trainer's way: the shard straight from the dataset
        reference = runner.shard_gradient(job, state.params, state.buffers, data.x_train[idx],
                                          data.y_train[idx], STEP, SHARD)
        # the phone's compute worker: weights and shard from files, results encoded to a file
        weights, shard_file = tmp_path / "w.bin", tmp_path / "s.npz"
        weights.write_bytes(encode_weights("job-x", STEP, state.params, state.buffers))
        shard_file.write_bytes(npz)
        request = {"op": "step", "job_id": "job-x", "step": STEP, "spec": SPEC,
                   "n_train": len(data.y_train), "input_shape": list(data.input_shape),
                   "num_classes": data.num_classes, "weights_path": str(weights),
                   "shards": {str(SHARD): str(shard_file)}, "out_path": str(tmp_path / "r.bin")}
        worker.handle(worker.Engine("numpy"), request)
        phone = decode_results((tmp_path / "r.bin").read_bytes())[0]
        # the simulator: the shard as the server serves it, the model from the assignment
        built = sim.ENGINE.model(Assignment(
            job_id="job-x", step=STEP, shards=[SHARD], spec=SPEC, n_params=job.model.n_params,
            n_buffers=job.model.n_buffers, n_stats=job.model.n_stats, total_steps=1,
            n_train=len(data.y_train), input_shape=list(data.input_shape),
            num_classes=data.num_classes))
        simulated = sim._compute(built, state.params, state.buffers,
                                 {SHARD: runner.shard_arrays(npz)}, STEP)[0]
    assert calls == [(STEP, SHARD)] * 3  # each of the three went through the runner
    for other in (phone, simulated):
        assert other.shard == SHARD and other.count == reference.count
        assert other.grad_sum.tobytes() == reference.grad_sum.tobytes()
        assert other.stats.tobytes() == reference.stats.tobytes()
        assert other.loss_sum == reference.loss_sum and other.correct == reference.correct


def test_the_reference_trainer_computes_every_shard_of_every_step_through_the_runner(
        calls: list[tuple[int, int]]) -> None:
    spec = {**SPEC, "model": {"arch": "logreg"}, "shards": 4, "global_batch_size": 256}
    metrics = run_reference(spec, None, progress=False)
    assert calls == [(t, k) for t in range(metrics["steps"]) for k in range(4)]
    assert metrics["params_sha256"] and metrics["val_accuracy"] is not None
