# %% [markdown]
# # A tour of the Python SDK (`phalanx.client`)
#
# Notebook-style: each `# %%` cell runs on its own in Jupyter or VS Code, or run the whole file:
#
#     PHALANX_SERVER=http://HOST:8000 PHALANX_TOKEN=phx-usr-... python examples/sdk_tour.py
#
# (`phalanx login` saves the same two; any user or admin token works.) The tour reads the fleet,
# asks for a job's plan, submits the job, follows it, and writes its report. With `--no-wait` it
# cancels the job right after submitting it (what the test suite runs: tests/cli/test_sdk_tour.py).

# %%
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from phalanx.client import PhalanxClient, PhalanxError
from phalanx.report import write as write_report

client = PhalanxClient(os.environ["PHALANX_SERVER"], os.environ["PHALANX_TOKEN"])
print("server:", client.health())

# %% [markdown]
# ## The fleet and the datasets

# %%
for device in client.devices():
    telemetry = device.get("latest_telemetry") or {}
    print(f"{device['name']:<20} {device['state']:<10} battery {telemetry.get('battery_pct')} "
          f"cpu {telemetry.get('cpu_temp_c')} C  labels {device.get('labels')}")
print("datasets:", [d["name"] for d in client.datasets()])

# %% [markdown]
# ## A job's plan before it runs: what it costs a phone, and where it could run

# %%
spec = {
    "name": "sdk-tour",
    "model": {"layers": [{"type": "conv2d", "out_channels": 8}, {"type": "relu"},
                         {"type": "global_avgpool"}, {"type": "dense", "units": 10}]},
    "dataset": "digits", "global_batch_size": 64, "shards": 4, "epochs": 1,
    "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.01},
}
planned = client.submit_job(spec, dry_run=True)
plan = planned["plan"]
print(f"{plan['parameters']:,} parameters, {plan['flops_per_sample'] / 1e6:.2f} MFLOP per sample, "
      f"{plan['memory_per_device_bytes'] / 2**20:.0f} MiB per phone, "
      f"{planned['total_steps']} steps; {planned['placement']['eligible']} device(s) could run it now")

# %% [markdown]
# ## Submit, follow, and draw it

# %%
job = client.submit_job(spec)
print("submitted", job["id"], job["state"])
if "--no-wait" in sys.argv:
    print("cancelled:", client.cancel_job(job["id"])["state"])
    sys.exit(0)
while job["state"] not in ("Succeeded", "Failed", "Cancelled"):
    time.sleep(2)
    job = client.job(job["id"])
    print(f"step {job['step']}/{job['total_steps']} {job['state']} "
          f"loss {job['metrics'].get('train_loss')}")
curve = client.job_curve(job["id"])
print(f"{len(curve)} steps recorded; final metrics {job['metrics']}")
print("report:", write_report(client, job["id"], Path("sdk-tour-report.html")))
try:
    Path("sdk-tour-weights.npz").write_bytes(client.checkpoint(job["id"]))
except PhalanxError as exc:  # a failed or cancelled job may have none
    print("no checkpoint:", exc)
