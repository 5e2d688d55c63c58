"""Shared by the tests that use the shipped Prometheus/Grafana files or a real
Prometheus server: the expressions those files hold, and a server to run.

Not a test module.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "exporters" / "prometheus"
DASHBOARD = ROOT / "exporters" / "grafana" / "fsdp-sentinel.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

#: What Grafana puts for the dashboard's variables when "All" is chosen, and
#: a rate window that holds several 1 s scrapes.
VARIABLES = {"$job": ".*", "$host": ".*", "$rank": ".*", "$__rate_interval": "15s"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def dashboard_exprs() -> dict[str, str]:
    """Every PromQL expression of the dashboard (panels, annotations,
    variables), named for messages, with the variables substituted."""
    dash = dashboard()
    out: dict[str, str] = {}
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out[f"panel {p['title']!r} {t['refId']}"] = substitute(t["expr"])
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out[f"annotation {a['name']!r}"] = substitute(a["expr"])
    for v in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.+), *\w+\)", v.get("definition", ""))
        if m:
            out[f"variable {v['name']}"] = substitute(m.group(1))
    return out


def rule_exprs() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("recording_rules.yml", "alert_rules.yml"):
        for group in yaml.safe_load((PROM_DIR / name).read_text())["groups"]:
            for rule in group["rules"]:
                out[rule.get("alert") or rule["record"]] = rule["expr"]
    return out


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def api(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.load(r)["data"]


@contextmanager
def prometheus_server(tmp: Path, target: str, *, rules: bool = False) -> Iterator[str]:
    """Debian's prometheus on a free loopback port scraping ``target`` every
    second with the shipped scrape settings (``honor_labels``) and, with
    ``rules``, the shipped recording and alert rules evaluated every second.
    Killed (and its data directory left to ``tmp``) on exit."""
    if not Path(PROMETHEUS).exists():
        raise AssertionError(f"{PROMETHEUS} missing: run scripts/setup.sh (Debian prometheus)")
    shipped = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (job,) = shipped["scrape_configs"]
    job = {**job, "static_configs": [{"targets": [target]}]}
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [job],
    }
    if rules:
        cfg["rule_files"] = [str(PROM_DIR / f) for f in shipped["rule_files"]]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/-/ready", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "prometheus did not start: " + (tmp / "prometheus.log").read_text()
                    ) from None
                time.sleep(0.2)
        yield base
    finally:
        proc.kill()
        proc.wait()
        log.close()
