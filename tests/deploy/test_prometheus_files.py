"""deploy/prometheus checked by the real promtool: the scrape config and the rules are valid,
and every alert fires on the condition it names and not on the healthy case (alerts_test.yml)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy.tools import DEPLOY, promtool

PROM_DIR = DEPLOY / "prometheus"


def test_promtool_accepts_the_scrape_config_and_the_rule_file_it_names() -> None:
    done = promtool("check", "config", "prometheus.yml", cwd=PROM_DIR)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout + done.stderr


def test_promtool_accepts_the_alert_rules() -> None:
    done = promtool("check", "rules", "alerts.yml", cwd=PROM_DIR)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_when_it_should_and_only_then() -> None:
    done = promtool("test", "rules", "alerts_test.yml", cwd=PROM_DIR)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tested = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())
    covered = {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"]
               if t["exp_alerts"]}
    assert names == covered, f"alerts without a firing test: {sorted(names - covered)}"
    assert {"PhalanxDeviceOverheating", "PhalanxJobStalled", "PhalanxSchedulerLoopNotRunning",
            "PhalanxManyDevicesNotReady", "PhalanxApplyStepFailing"} <= names


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    # the checks above can fail: promtool does not accept everything
    path = tmp_path / "broken_rules.yml"
    path.write_text("groups:\n  - name: x\n    rules:\n      - alert: Broken\n"
                    "        expr: max(phalanx_devices{state=\"Ready\"\n")
    done = promtool("check", "rules", str(path))
    assert done.returncode != 0


def test_every_alert_has_a_runbook_section_in_the_deploy_guide() -> None:
    import re

    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    guide = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    # GitHub's anchor for a heading: lowercased, spaces to dashes, punctuation dropped
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", guide, re.M)}
    for group in rules["groups"]:
        for rule in group["rules"]:
            url = rule["annotations"].get("runbook_url", "")
            assert url == f"docs/deploy.md#{rule['alert'].lower()}", rule["alert"]
            assert url.split("#")[1] in anchors, f"no runbook section for {rule['alert']}"
