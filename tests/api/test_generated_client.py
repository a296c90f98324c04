"""Users generate clients from the OpenAPI document: openapi-python-client (the tool they
use) makes one without a warning, with a function for every operation, and that client
talks to a live server: a typed call lists jobs and submits one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.api.test_jobs import SPEC
from tests.support.server import LiveServer


def snake(operation_id: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in operation_id)


def test_a_generated_client_has_every_operation_and_works(live_server: LiveServer,
                                                          tmp_path: Path) -> None:
    document = httpx.get(f"{live_server.url}/openapi.json", timeout=30).json()
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    tools = str(Path(sys.executable).parent)  # the generator formats its output with ruff
    made = subprocess.run(
        [os.path.join(tools, "openapi-python-client"), "generate", "--path", "openapi.json",
         "--meta", "none", "--output-path", "phalanx_api", "--fail-on-warning"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": f"{tools}:{os.environ.get('PATH', '')}"})
    assert made.returncode == 0, made.stdout + made.stderr
    wanted = {snake(op["operationId"]) for ops in document["paths"].values()
              for op in ops.values()}
    generated = {p.stem for p in (tmp_path / "phalanx_api" / "api").rglob("*.py")
                 if p.stem != "__init__"}
    assert generated == wanted and "send_heartbeat" in generated
    script = f"""
from phalanx_api import AuthenticatedClient
from phalanx_api.api.jobs import list_jobs, submit_job
from phalanx_api.models import JobCreate
client = AuthenticatedClient(base_url={live_server.url!r}, token={live_server.admin_token!r})
job = submit_job.sync(client=client, body=JobCreate.from_dict({SPEC!r}))
page = list_jobs.sync(client=client)
print(job.id, job.state, [j.id for j in page.items])
"""
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    job_id, state, listed = ran.stdout.split(" ", 2)
    assert state == "Pending" and job_id in listed
