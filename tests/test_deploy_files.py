"""The deploy/ files are checked here so that they cannot rot.

- Kubernetes manifests parse and pass the Kubernetes OpenAPI schema, strictly
  (kubernetes-validate, which ships the schemas); the pieces that must agree
  across files agree (socket directory, metrics port, labels, capabilities).
- Every daemon flag that a deploy file passes goes through the real
  ``fsdp-sentinel`` argparse parser, and the example Job's trainer flags
  through the trainer's.
- The systemd unit passes ``systemd-analyze verify`` with no warning.
- The Slurm scripts pass ``shellcheck``.
- The image installs the daemon's dependencies as pyproject.toml states them.

Each check is shown to fail on a broken copy, so a pass means something.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from fsdp_sentinel import cli
from fsdp_sentinel.daemon import DEFAULT_METRICS_ADDR
from fsdp_sentinel.emit import DEFAULT_SOCKET
from fsdp_sentinel.trainer.config import build_parser as trainer_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "fsdp-sentinel.service"
SLURM = sorted((DEPLOY / "slurm").glob("*.sh"))
K8S_VERSION = "1.30.0"  # the oldest release with every field the manifests use
THREE = {"BPF", "PERFMON", "NET_ADMIN"}
METRICS_PORT = int(DEFAULT_METRICS_ADDR.rsplit(":", 1)[1])


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict[str, Any]:
    found = [d for d in docs(name) if d["kind"] == kind]
    assert len(found) == 1, (name, kind)
    return found[0]


def pod_spec(name: str, kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(name, kind)["spec"]["template"]["spec"]
    return spec


def run_parser() -> argparse.ArgumentParser:
    """The ``fsdp-sentinel run`` subparser, exactly as the command line builds it."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run: argparse.ArgumentParser = sub.choices["run"]
    return run


def parse_run(argv: list[str]) -> argparse.Namespace:
    """Parse with the real parser; a flag it does not know fails the test (not exit 2)."""
    try:
        return run_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"fsdp-sentinel run rejects {argv}") from e


# --------------------------------------------------------------------------- Kubernetes

SCHEMA_CHECKED = ["namespace.yaml", "daemonset.yaml", "service.yaml", "training-job.yaml"]


@pytest.mark.parametrize("name", SCHEMA_CHECKED)
def test_manifest_passes_the_kubernetes_schema_strictly(name: str) -> None:
    for doc in docs(name):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    ds = copy.deepcopy(one("daemonset.yaml", "DaemonSet"))
    ds["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
    ds = copy.deepcopy(one("daemonset.yaml", "DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "18965"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_kustomization_lists_files_that_exist_and_every_manifest_is_in_use() -> None:
    kust = docs("kustomization.yaml")[0]
    assert kust["kind"] == "Kustomization"
    assert set(kust) <= {"apiVersion", "kind", "resources", "images", "namespace", "labels"}
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    images = {i["name"] for i in kust["images"]}
    assert images == {
        c["image"].split(":")[0] for c in pod_spec("daemonset.yaml", "DaemonSet")["containers"]
    }
    # The rest are applied on their own, and the kustomization's comment says how.
    for extra in sorted({p.name for p in K8S.glob("*.yaml")} - set(kust["resources"])):
        if extra != "kustomization.yaml":
            assert (
                f"kubectl apply -f deploy/kubernetes/{extra}"
                in (K8S / "kustomization.yaml").read_text()
            )


def test_daemonset_has_the_three_capabilities_and_is_not_privileged() -> None:
    spec = pod_spec("daemonset.yaml", "DaemonSet")
    assert spec["hostNetwork"] is True and spec["hostPID"] is True
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == THREE


def test_daemonset_mounts_what_the_probes_and_bcc_read() -> None:
    spec = pod_spec("daemonset.yaml", "DaemonSet")
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    for path in (
        "/sys/kernel/tracing",
        "/sys/fs/bpf",
        "/sys/kernel/btf",
        "/lib/modules",
        "/usr/src",
    ):
        assert host[mounts[path]] == path, path  # the host's own, at the same place


def test_daemon_args_parse_with_the_real_parser_and_match_the_other_files() -> None:
    spec = pod_spec("daemonset.yaml", "DaemonSet")
    (c,) = spec["containers"]
    assert c["command"] == ["fsdp-sentinel", "run"]
    env = {e["name"]: "198.51.100.7" for e in c.get("env", [])}  # Kubernetes' $(VAR) expansion
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    ns = parse_run(args)
    assert ns.metrics_addr == ("198.51.100.7", METRICS_PORT)
    assert c["ports"][0]["containerPort"] == METRICS_PORT
    sock_dir = str(Path(ns.socket).parent)
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert host[mounts[sock_dir]] == sock_dir


def test_service_and_servicemonitor_point_at_the_daemons_metrics_port() -> None:
    svc = one("service.yaml", "Service")
    ds = one("daemonset.yaml", "DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"  # every node's endpoint, not one
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    names = {
        p["name"]: p["containerPort"]
        for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert names[port["targetPort"]] == METRICS_PORT
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
    sm = one("servicemonitor.yaml", "ServiceMonitor")  # a CRD: no schema ships; cross-checked here
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == port["name"] and ep["path"] == "/metrics"
    assert ep["honorLabels"] is True  # docs/metrics.md: the run id is the `job` label


def test_training_job_mounts_the_socket_and_sets_the_env() -> None:
    spec = pod_spec("training-job.yaml", "Job")
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    sock = env["FSDP_SENTINEL_SOCKET"]["value"]
    assert sock == DEFAULT_SOCKET
    assert env["FSDP_SENTINEL_JOB"]["valueFrom"]["fieldRef"]["fieldPath"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    daemon = parse_run([a for a in pod_spec("daemonset.yaml", "DaemonSet")["containers"][0]["args"]
                        if not a.startswith("--metrics-addr")])  # fmt: skip
    assert host[mounts[str(Path(sock).parent)]] == str(Path(daemon.socket).parent)
    assert "hostPID" not in spec  # the credential path: docs/deploy.md
    # torchrun ... -m fsdp_sentinel.trainer ARGS: the trainer's own parser takes ARGS.
    args = c["args"]
    assert c["command"] == ["torchrun"] and args[args.index("-m") + 1] == "fsdp_sentinel.trainer"
    trainer_parser().parse_args(args[args.index("-m") + 2 :])


# --------------------------------------------------------------------------- systemd


def exec_start(unit_text: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", unit_text)
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("ExecStart=")]
    return shlex.split(line.split("=", 1)[1])


def verify(unit_text: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of the unit, its ExecStart pointed at this
    environment's real ``fsdp-sentinel`` (verify checks that it exists)."""
    exe = shutil.which("fsdp-sentinel", path=str(Path(sys.executable).parent))
    assert exe, "fsdp-sentinel is not installed beside this interpreter"
    unit = tmp / UNIT.name
    unit.write_text(unit_text.replace("/opt/fsdp-sentinel/bin/fsdp-sentinel", exe))
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: run `make setup` (it installs systemd)")
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)


def test_systemd_unit_verifies_without_a_warning(tmp_path: Path) -> None:
    res = verify(UNIT.read_text(), tmp_path)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


def test_systemd_verify_catches_a_misspelt_directive(tmp_path: Path) -> None:
    res = verify(UNIT.read_text().replace("ProtectClock=", "ProtectClok="), tmp_path)
    assert "Unknown key" in res.stderr


def test_systemd_unit_runs_as_its_user_with_exactly_the_measured_capabilities() -> None:
    text = UNIT.read_text()
    keys = dict(ln.split("=", 1) for ln in text.splitlines() if re.match(r"^[A-Za-z]+=", ln))
    assert keys["User"] == "fsdp-sentinel"
    want = {f"CAP_{c}" for c in THREE} | {"CAP_DAC_READ_SEARCH"}  # docs/deploy.md's table
    assert set(keys["AmbientCapabilities"].split()) == want
    assert set(keys["CapabilityBoundingSet"].split()) == want
    assert keys["NoNewPrivileges"] == "yes" and keys["ProtectSystem"] == "strict"
    ns = parse_run(exec_start(text)[2:])
    assert ns.socket.startswith(f"/run/{keys['RuntimeDirectory']}/")


# --------------------------------------------------------------------------- Slurm


def shellcheck(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is missing: run `make setup` (it installs Debian's shellcheck)")
    return subprocess.run(["shellcheck", "-x", *map(str, paths)], capture_output=True, text=True,
                          cwd=DEPLOY / "slurm")  # fmt: skip


def test_slurm_scripts_pass_shellcheck() -> None:
    assert {p.name for p in SLURM} == {"prolog.sh", "epilog.sh", "task-prolog.sh"}
    res = shellcheck(SLURM)
    assert res.returncode == 0, res.stdout


def test_shellcheck_catches_an_unquoted_variable(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\ndir=$1\nrm -rf $dir/x\n")
    assert shellcheck([bad]).returncode != 0


def test_slurm_prolog_flags_exist_in_the_real_parser() -> None:
    text = (DEPLOY / "slurm" / "prolog.sh").read_text()
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", text)) - {"--bounding-set", "--inh-caps"}
    assert {"--socket", "--remediate", "--trace-out", "--metrics-addr"} <= flags
    known = {s for a in run_parser()._actions for s in a.option_strings}
    assert flags <= known, flags - known
    env = dict(
        re.findall(
            r"^(FSDP_SENTINEL_\w+)=(.*)$",
            (DEPLOY / "slurm" / "fsdp-sentinel.env").read_text(),
            re.M,
        )
    )
    parse_run(["--socket", "/run/x/ingest.sock", "--remediate", env["FSDP_SENTINEL_REMEDIATE"],
               "--metrics-addr", env["FSDP_SENTINEL_METRICS_ADDR"]])  # fmt: skip


# --------------------------------------------------------------------------- image


def test_image_installs_the_daemons_dependencies_as_pyproject_states_them() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    want = {d for d in deps if not d.startswith("torch")}
    text = (DEPLOY / "image" / "Dockerfile").read_text()
    daemon_stage = text.split("AS trainer")[0]
    got = set(re.findall(r'"([A-Za-z][\w.-]*[<>=!~][^"]*)"', daemon_stage))
    assert got == want
    assert "--no-deps" in daemon_stage  # so pip does not pull torch in through the package
    assert text.splitlines()[0].startswith("#") and "FROM debian:12" in text


def test_readme_links_the_deploy_guide() -> None:
    assert "(docs/deploy.md)" in (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "deploy.md").is_file()
