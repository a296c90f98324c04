"""People see quarantines (issue 41): the /ui fleet marks a quarantined phone with its reason on
hover, and a job's report names the phones its audits caught lying, with the step."""

from __future__ import annotations

from pictures.fleet import fleet
from pictures.report import render

REASON = "its result for shards 2..3 of job-1 step 4 differs from the one two of three computed"


def test_the_fleet_page_marks_a_quarantined_phone_with_its_reason() -> None:
    phones = [{"id": "dev-1", "name": "liar", "state": "Cordoned", "quarantine_reason": REASON},
              {"id": "dev-2", "name": "honest", "state": "Ready", "quarantine_reason": None}]
    page = fleet(phones, [], 5)
    liar_row = page[page.index('data-device="dev-1"'):page.index('data-device="dev-2"')]
    assert f'title="{REASON}">quarantined</b>' in liar_row
    assert page.count(">quarantined</b>") == 1


def test_a_jobs_report_names_the_phones_caught_lying() -> None:
    job = {"id": "job-1", "name": "digits", "state": "Succeeded", "step": 10, "total_steps": 10,
           "spec": {}, "metrics": {}}
    events = [{"reason": "ResultMismatch", "kind": "Warning", "device_id": "dev-1",
               "message": "step 4, shards 2..3: ...", "data": {"step": 4}, "ts": None},
              {"reason": "Scheduled", "kind": "Normal", "message": "placed", "data": {}}]
    page = render(job, [], events, {"dev-1": "liar"})
    assert "<td>quarantined</td><td>liar (step 4)</td>" in page
    assert "<td>quarantined</td>" not in render(job, [], events[1:])
