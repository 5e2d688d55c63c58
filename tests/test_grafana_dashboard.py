"""The shipped Grafana dashboard and provisioning files: a schema test.

The dashboard is the classic JSON model (what file provisioning reads; every
Grafana since 7 imports it, Grafana 13 converts it to its V2 resource on
save). Its PromQL is parsed by promtool here; tests/test_observability_real.py
runs every expression against a real Prometheus scraping a real job.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_support import ROOT, dashboard, dashboard_exprs, rule_exprs

GRAFANA = ROOT / "exporters" / "grafana"
PANEL_TYPES = {"row", "timeseries", "heatmap", "state-timeline"}
SCHEMA_VERSION = 41  # Grafana 12's classic model; the newest classic version


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_top_level_schema() -> None:
    d = dashboard()
    assert d["schemaVersion"] == SCHEMA_VERSION
    assert d["uid"] == "fsdp-sentinel" and d["title"]
    assert isinstance(d["panels"], list) and d["templating"]["list"]
    for key in ("time", "refresh", "annotations", "editable", "tags"):
        assert key in d, key


def test_panels_are_well_formed_and_laid_out() -> None:
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard()["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0 and g["y"] >= 0, p["title"]
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["description"], p["title"]


def test_variables_job_host_rank_chain() -> None:
    by_name = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert by_name["datasource"]["type"] == "datasource"
    for name in ("job", "host", "rank"):
        v = by_name[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert v["definition"].startswith("label_values(") and v["definition"].endswith(
            f", {name})"
        )
    # host depends on job, rank on both: choosing a job narrows the others
    assert "$job" in by_name["host"]["definition"]
    assert {"$job", "$host"} <= set(re.findall(r"\$\w+", by_name["rank"]["definition"]))


def test_the_panels_the_issue_asks_for() -> None:
    def find(kind: str, pattern: str) -> list[dict]:
        return [p for p in panels() if p["type"] == kind
                and any(re.search(pattern, t["expr"]) for t in p["targets"])]  # fmt: skip

    heat = find("heatmap", r"fsdp_sentinel_step_duration_seconds_bucket")
    assert heat and heat[0]["repeat"] == "rank" and heat[0]["targets"][0]["format"] == "heatmap"
    assert find("timeseries", r"compute_seconds_total") == find("timeseries", r"wait_seconds_total")
    assert find("state-timeline", r"fsdp_sentinel_straggler\{.*\}\)$")
    timeline = find("state-timeline", r"fsdp_sentinel_straggler")[0]
    assert "cause" in timeline["targets"][0]["legendFormat"]
    assert find("timeseries", r"rate\(fsdp_sentinel_flow_bytes_total")
    assert find("timeseries", r"fsdp_sentinel_flow_srtt_seconds")
    assert find("timeseries", r"rate\(fsdp_sentinel_retransmits_total")
    assert find("timeseries", r"fsdp_sentinel_events_lost_total")
    notes = {a["name"]: a for a in dashboard()["annotations"]["list"]}
    assert "fsdp_sentinel_remediation_active" in notes["Remediation"]["expr"]


def test_rank_queries_filter_on_all_three_variables() -> None:
    rank_families = ("step_duration", "compute_seconds", "wait_seconds", "straggler",
                     "flow_", "retransmits", "nccl_", "collective_wait")  # fmt: skip
    for p in panels():
        for t in p["targets"]:
            for sel in re.findall(r"fsdp_sentinel_(\w+)\{([^}]*)\}", t["expr"]):
                if sel[0].startswith(rank_families):
                    for var in ("job", "host", "rank"):
                        assert f'{var}=~"${var}"' in sel[1], (p["title"], sel)


def test_every_metric_is_documented_or_recorded() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(fsdp_sentinel_\w+)`", doc))
    recorded = {n for n in rule_exprs() if ":" in n}
    for where, expr in dashboard_exprs().items():
        for name in re.findall(r"[\w:]*fsdp_sentinel_[\w:]+", expr):
            family = re.sub(r"_(bucket|count|sum)$", "", name)
            assert family in documented or name in recorded, (where, name)


@pytest.mark.prometheus
def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each expression (as a recording rule) without a server."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run scripts/setup.sh"
    rules = [{"record": f"dashboard:expr_{i}", "expr": e} for i, e in
             enumerate(dashboard_exprs().values())]  # fmt: skip
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout


def test_provisioning_files() -> None:
    ds = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "fsdp-sentinel.yml").read_text()
    )
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "fsdp-sentinel.yml").read_text()
    )
    (provider,) = prov["providers"]
    assert prov["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]
