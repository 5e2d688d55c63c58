#!/usr/bin/env python3
"""Which capabilities does fsdp-sentinel's daemon need on this node? Measured, not guessed.

Run as root. For each capability set it is given, it starts the real daemon
(`fsdp-sentinel run`, probes on, `--remediate apply`) under `setpriv` with
exactly that set, inside a throwaway network namespace, and checks:

- start:   the daemon logs "ready" (probes compiled, loaded and attached);
- flows:   a process that announces itself as a rank sends N bytes over TCP;
           the daemon's trace must hold flow records of that pid adding up to
           N (the oracle is the byte count the sender itself wrote);
- tc:      the remediator `--remediate apply` builds, driven by one network
           verdict under the same capabilities, puts its HTB tree and bpf
           classifier on the namespace's veth (checked with `tc -j`, run with
           full privileges), and rolls it back to exactly what was there;
- exit:    SIGTERM gives exit status 0.

    deploy/capcheck.py                        # the three: bpf,perfmon,net_admin
    deploy/capcheck.py --caps bpf,perfmon     # any set
    deploy/capcheck.py --table                # the three, then each one left out (markdown)

Nothing is left behind: the namespace, its veth and any tc state go with it.
Exit status 0 when every check of every set passed that was expected to
(with --table: the full set passes, each reduced set fails where it says).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

THREE = ("bpf", "perfmon", "net_admin")
DEV = "fss-capa"
PEER = "fss-capb"
ADDR = "198.18.254.1"
SENT = 2_000_000
READY_S = 90.0

# The "rank": announces its own pid (so a daemon that takes the pid from the
# socket's credentials sees the same one), then sends SENT bytes over TCP.
RANK = textwrap.dedent(
    """
    import json, os, socket, sys, threading, time
    sock_path = sys.argv[1]
    srv = socket.create_server(("127.0.0.1", 0)); port = srv.getsockname()[1]
    def sink():
        c, _ = srv.accept()
        while c.recv(1 << 16): pass
    threading.Thread(target=sink, daemon=True).start()
    rec = {"kind": "rank", "t": time.time(), "rank": 0, "world_size": 1, "host": "capcheck",
           "pid": os.getpid(), "addrs": ["127.0.0.1"], "job": "capcheck"}
    u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); u.sendto(json.dumps(rec).encode(), sock_path)
    time.sleep(1.5)  # the daemon registers the pid with the probes' filter
    c = socket.create_connection(("127.0.0.1", port)); c.sendall(b"x" * SENT_BYTES); c.close()
    time.sleep(2.5)  # stay alive over two polls: flows are read per interval
    print(os.getpid())
    """
).replace("SENT_BYTES", str(SENT))

# The remediator the daemon builds for --remediate apply, handed one network verdict.
REMEDIATE = textwrap.dedent(
    """
    import json, sys, time
    from fsdp_sentinel.remediate import DeviceRef, RemediateConfig, TcRemediator
    cfg = RemediateConfig(devices=(DeviceRef("capcheck", "DEVICE"),), rate_mbit=1000.0,
                          state_dir=sys.argv[1])
    rem = TcRemediator("apply", "capcheck", cfg)
    t = time.time()
    rem.observe({"kind": "netdev", "t": t, "dt": 1.0, "host": "capcheck", "dev": "DEVICE",
                 "tx_bytes": 10**7, "rx_bytes": 0})
    acts = rem.on_verdict({"kind": "verdict", "t": t, "step": 1, "rank": 0, "state": "flagged",
                           "cause": "network", "score": 3.0, "host": "capcheck",
                           "evidence": {"scope": "node"}})
    print(json.dumps(acts), flush=True)
    sys.stdin.readline()  # the caller looks at the device with tc
    print(json.dumps(rem.close()), flush=True)
    """
).replace("DEVICE", DEV)


# Another uid's rank mapping libibverbs (as a pod's non-root rank maps libnccl): what the
# library scan (uprobes for NCCL and verbs) finds of it under the capabilities.
OTHER_RANK = (
    "import ctypes, sys, time; ctypes.CDLL('libibverbs.so.1'); print(1, flush=True); time.sleep(60)"
)
SCAN = (
    "import sys; from fsdp_sentinel.probes.libscan import LibraryScanner; "
    "import os; found = LibraryScanner().scan([int(sys.argv[1])]); "
    # what _attach_specs does first: the uprobe goes on /proc/PID/root/<library>
    "print(sum(1 for _, path in found if os.path.exists(path)), len(found))"
)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def setpriv(caps: tuple[str, ...], user: str | None = None) -> list[str]:
    """Exactly ``caps``. For uid 0, root's implicit capabilities come from the bounding
    set, so a bounding set of ``caps`` (and nothing inheritable) leaves exactly those;
    another user gets them as ambient capabilities (what systemd's AmbientCapabilities=
    does)."""
    keep = "".join(f",+{c}" for c in caps)
    if user is None:
        return ["setpriv", "--bounding-set", f"-all{keep}", "--inh-caps", "-all", "--"]
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups",
            f"--inh-caps=-all{keep}", f"--ambient-caps=-all{keep}", f"--bounding-set=-all{keep}",
            "--"]  # fmt: skip


class Namespace:
    """A throwaway network namespace with a veth pair (both ends inside it)."""

    def __init__(self) -> None:
        self.name = f"fss-cap{os.getpid()}"

    def __enter__(self) -> Namespace:
        sh("ip", "netns", "add", self.name)
        try:
            ns = ("ip", "-n", self.name)
            sh(*ns, "link", "set", "lo", "up")
            sh(*ns, "link", "add", DEV, "type", "veth", "peer", "name", PEER)
            sh(*ns, "addr", "add", f"{ADDR}/30", "dev", DEV)
            sh(*ns, "link", "set", DEV, "up")
            sh(*ns, "link", "set", PEER, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        sh("ip", "netns", "delete", self.name, check=False)

    def enter(self) -> list[str]:
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding tracefs.
        return ["nsenter", f"--net=/run/netns/{self.name}", "--"]

    def tc_qdiscs(self) -> list[dict]:
        out = sh("ip", "netns", "exec", self.name, "tc", "-j", "qdisc", "show", "dev", DEV).stdout
        return json.loads(out or "[]")


def last_error(log: str) -> str:
    """The last error line of a log, without its time stamp and logger name."""
    lines = [ln for ln in log.splitlines() if " ERROR " in ln or "Error" in ln or "error" in ln]
    line = lines[-1] if lines else (log.strip().splitlines() or [""])[-1]
    return line.split(" ERROR ", 1)[-1].split(": ", 1)[-1][:200]


def python(caps: tuple[str, ...], user: str | None) -> list[str]:
    """This interpreter under ``caps`` (as ``user``). Another user may not be able to run
    a virtual environment's interpreter (here it lives under /root): then the system's
    python3 of the same version runs, with this environment's packages on its path."""
    if user is None:
        return [*setpriv(caps), sys.executable]
    exe = sys.executable
    if not os.access(os.path.realpath(exe), os.X_OK) or user != "root":
        exe = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    return [*setpriv(caps, user), exe]


def child_env() -> dict[str, str]:
    paths = [os.environ.get("PYTHONPATH", ""), *sysconfig_paths()]
    return {**os.environ, "PYTHONPATH": ":".join(p for p in paths if p)}


def sysconfig_paths() -> list[str]:
    import sysconfig

    return [sysconfig.get_paths()["purelib"], str(Path(__file__).resolve().parent.parent)]


def run_daemon(
    ns: Namespace, caps: tuple[str, ...], work: Path, user: str | None, remediate: str
) -> dict:
    """The real daemon under ``caps``: did it start, count the rank's bytes, exit 0?"""
    sock, trace = work / "ingest.sock", work / "trace.jsonl"
    cmd = [*ns.enter(), *python(caps, user), "-m", "fsdp_sentinel", "run",
           "--socket", str(sock), "--trace-out", str(trace), "--metrics-addr", "127.0.0.1:0",
           "--interval", "0.5", "--remediate", remediate, "--remediate-dev", DEV,
           "--remediate-rate-mbit", "1000"]  # fmt: skip
    errlog = work / "daemon.log"
    with errlog.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=child_env())
    out: dict = {"start": False, "flows": None, "exit": None, "why": ""}
    try:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline and proc.poll() is None:
            if " ready (pid " in errlog.read_text():
                out["start"] = True
                break
            time.sleep(0.2)
        if out["start"]:
            rank = subprocess.run([*ns.enter(), sys.executable, "-c", RANK, str(sock)],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            pid = int(rank.stdout.split()[-1])
            proc.send_signal(signal.SIGTERM)
            out["exit"] = proc.wait(timeout=30)
            counted = 0
            for line in trace.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("kind") == "flow" and rec.get("pid") == pid:
                    counted += rec["tx_bytes"]
            out["flows"] = counted
        else:
            out["exit"] = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = errlog.read_text()
    out["why"] = "" if out["start"] and out["exit"] == 0 else last_error(log)
    out["warnings"] = [ln.split(": ", 1)[-1][:160] for ln in log.splitlines() if " WARNING " in ln]
    return out


def run_remediator(ns: Namespace, caps: tuple[str, ...], work: Path, user: str | None) -> dict:
    """The apply-mode remediator under ``caps``: tree in place (tc -j), rolled back exactly."""
    before = ns.tc_qdiscs()
    state = work / "state"
    state.mkdir()
    give(state, user)
    proc = subprocess.Popen([*ns.enter(), *python(caps, user), "-c", REMEDIATE, str(state)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    out: dict = {"tc": False, "rollback": False, "why": ""}
    try:
        assert proc.stdin is not None and proc.stdout is not None
        first = proc.stdout.readline()
        applied = json.loads(first) if first else []
        states = [a.get("state") for a in applied]
        kinds = {q.get("handle"): q.get("kind") for q in ns.tc_qdiscs()}
        out["tc"] = states == ["applied"] and kinds.get("5eb:") == "htb"
        if not out["tc"]:
            out["why"] = "; ".join(a.get("why", "") for a in applied) or "no action"
        done = []
        if proc.poll() is None:
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died: its stderr says why
                pass
            second = proc.stdout.readline()
            done = json.loads(second) if second else []
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["rollback"] = ns.tc_qdiscs() == before and (
        not out["tc"] or [a.get("state") for a in done] == ["rolled_back"]
    )
    if proc.returncode and not out["why"]:
        out["why"] = last_error(proc.stderr.read() if proc.stderr else "")
    return out


def give(path: Path, user: str | None) -> None:
    if user is not None:
        import pwd

        pw = pwd.getpwnam(user)
        os.chown(path, pw.pw_uid, pw.pw_gid)


def run_scan(caps: tuple[str, ...], user: str | None) -> dict:
    """The library scan of a rank of another uid (nobody), against a full-root scan."""
    other = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                              "--inh-caps=-all", "--bounding-set=-all", "/usr/bin/python3", "-c",
                              OTHER_RANK], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert other.stdout is not None
        other.stdout.readline()
        pid = str(other.pid)
        full = subprocess.run([sys.executable, "-c", SCAN, pid], capture_output=True, text=True,
                              env=child_env())  # fmt: skip
        got = subprocess.run([*python(caps, user), "-c", SCAN, pid], capture_output=True,
                             text=True, env=child_env())  # fmt: skip
    finally:
        other.kill()
        other.wait()

    def reached(out: str) -> str:  # "attachable found" -> "attachable/found"
        return "/".join(out.split()) or "error"

    return {"scan": reached(got.stdout), "scan_root": reached(full.stdout)}


def check(caps: tuple[str, ...], user: str | None = None, remediate: str = "apply") -> dict:
    with Namespace() as ns, tempfile.TemporaryDirectory(prefix="fss-capcheck-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        for sub in ("d", "r"):
            (work / sub).mkdir()
            give(work / sub, user)
        result = {"caps": list(caps), "user": user or "root",
                  **run_daemon(ns, caps, work / "d", user, remediate)}  # fmt: skip
        rem = run_remediator(ns, caps, work / "r", user)
        result.update(tc=rem["tc"], rollback=rem["rollback"], tc_why=rem["why"])
        result.update(run_scan(caps, user))
        result["flows_ok"] = result["flows"] is not None and abs(result["flows"] - SENT) <= 1500
        result["ok"] = bool(
            result["start"] and result["flows_ok"] and result["exit"] == 0 and rem["tc"]
        )
        return result


def table(rows: list[dict]) -> str:
    def mark(ok: bool) -> str:
        return "yes" if ok else "**no**"

    out = ["| user | capabilities | daemon starts | rank's bytes counted | tc tree applied | "
           "uprobe libraries of another uid's rank (attachable/found) | what fails |",
           "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        flows = "—" if r["flows"] is None else f"{r['flows']:,} of {SENT:,}"
        why = "; ".join(w for w in (r["why"], r["tc_why"]) if w) or "nothing"
        out.append(f"| {r['user']} | {' '.join('CAP_' + c.upper() for c in r['caps']) or '(none)'}"
                   f" | {mark(r['start'])} | {flows} | {mark(r['tc'])} | {r['scan']} "
                   f"(root: {r['scan_root']}) | {why} |")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caps", default=",".join(THREE), help="comma-separated capability names")
    p.add_argument("--table", action="store_true",
                   help="the three, then each left out in turn, as a markdown table")  # fmt: skip
    p.add_argument(
        "--user",
        help="run as this user with the capabilities ambient "
        "(systemd's User= with AmbientCapabilities=); default uid 0",
    )
    p.add_argument("--remediate", default="apply", choices=("off", "dry-run", "apply"),
                   help="the daemon's --remediate (default apply)")  # fmt: skip
    p.add_argument("--extra", default="", help="capabilities added to every set (--table)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("capcheck: run as root (it makes a network namespace)", file=sys.stderr)
        return 2
    extra = tuple(c for c in args.extra.split(",") if c)
    sets = [THREE] + [tuple(c for c in THREE if c != drop) for drop in THREE] if args.table \
        else [tuple(c for c in args.caps.split(",") if c)]  # fmt: skip
    rows = []
    for caps in sets:
        r = check(caps + extra, args.user, args.remediate)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.table:
        print(table(rows))
        return 0 if rows[0]["ok"] and not any(r["ok"] for r in rows[1:]) else 1
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
