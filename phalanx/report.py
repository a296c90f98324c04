"""`phalanx jobs report`: a job's page (pictures.report) from what the API answers."""

from __future__ import annotations

from pathlib import Path

from phalanx.client import PhalanxClient
from pictures.report import render


def write(client: PhalanxClient, job_id: str, path: Path,
          names: dict[str, str] | None = None) -> Path:
    """Fetch the job, its curve and its events, and write its page to `path`."""
    job = client.job(job_id)
    page = render(job, client.job_curve(job_id), client.job_events(job_id), names)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
