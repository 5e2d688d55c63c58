"""The shipped Prometheus files: promtool checks them, runs their unit tests,
and every alert is documented the way an on-call engineer needs it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "exporters" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def load(name: str) -> Any:
    return yaml.safe_load((PROM / name).read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in load("alert_rules.yml")["groups"] for r in g["rules"]]


def promtool(*args: str) -> str:
    if not Path(PROMTOOL).exists():
        pytest.fail("promtool missing: run scripts/setup.sh (Debian package prometheus)")
    res = subprocess.run([PROMTOOL, *args], cwd=PROM, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


@pytest.mark.prometheus
def test_promtool_check_rules_and_config() -> None:
    out = promtool("check", "rules", "recording_rules.yml", "alert_rules.yml")
    assert out.count("SUCCESS") == 2
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


@pytest.mark.prometheus
def test_promtool_test_rules() -> None:
    assert "SUCCESS" in promtool("test", "rules", "rules_test.yml")


def test_every_alert_is_unit_tested_firing_and_silent() -> None:
    tests = load("rules_test.yml")["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} never tested firing"
        # ... and in the firing case a clean series of the same metric is present
        # but expected silent: exp_alerts lists exactly one alert.
        assert all(len(c["exp_alerts"]) <= 1 for c in mine), rule["alert"]


def test_every_alert_has_summary_description_and_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), re.M)
    }
    for rule in alert_rules():
        ann = rule["annotations"]
        assert ann["summary"].strip() and ann["description"].strip(), rule["alert"]
        page, _, anchor = ann["runbook"].partition("#")
        assert page == "docs/runbooks.md" and anchor in anchors, (rule["alert"], anchor)
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_scrape_config_keeps_the_training_jobs_label() -> None:
    (job,) = load("prometheus.yml")["scrape_configs"]
    assert job["job_name"] == "fsdp-sentinel" and job["honor_labels"] is True
    assert set(load("prometheus.yml")["rule_files"]) == {"recording_rules.yml", "alert_rules.yml"}
