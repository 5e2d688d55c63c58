"""The remediator the daemon drives: verdicts and records in, tc changes and ``action`` records out.

It needs nothing but the verdicts, the local records and its own devices
(cluster mode hands each node's remediator the leader's verdicts; a verdict
for a host whose device is not in its list is explained and left alone):

- ``observe(rec)``: every record the pipeline gets (only ``rank``,
  ``netdev``, ``flow`` and ``conn`` matter: who shares the link, and the
  job's flows for the classifier's map);
- ``on_verdict(v)``: for a ``network`` verdict, adds the contention figures
  and the decision to ``v["evidence"]`` (``foreign_tx_share``,
  ``remediation``), then acts when the policy says so;
- ``tick()``: once per poll: the map follows the job's flows, and the
  hysteresis counts clean windows and undoes;
- ``close()``: undoes everything still in place.

Modes: ``dry-run`` logs and records the exact tc operations (``dry_run``
actions) and changes nothing; ``apply`` makes them (``applied``, later
``rolled_back``; ``failed`` with the errno name when netlink refuses, after
undoing whatever part went in).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_sentinel.remediate import netlink, statefile
from fsdp_sentinel.remediate.config import DeviceRef, RemediateConfig
from fsdp_sentinel.remediate.contention import ContentionTracker
from fsdp_sentinel.remediate.plan import (
    JOB_MINOR,
    OTHER_MINOR,
    Plan,
    Refused,
    handle,
    plan,
)
from fsdp_sentinel.remediate.policy import Hysteresis, assess

log = logging.getLogger("fsdp_sentinel.remediate")

Record = dict[str, Any]
MODES = ("dry-run", "apply")
PROG_NAME = "fss_classify"


@dataclass
class _Device:
    ref: DeviceRef
    hyst: Hysteresis
    plan: Plan | None = None  # the tree in place (or, dry-run, the one printed)
    window_end: float = 0.0
    flows: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class TcRemediator:
    """See the module docstring. ``classifier_factory(job_classid, other_classid)`` is
    injected (a real bcc load by default); ``clock`` stamps the action records."""

    def __init__(
        self,
        mode: str,
        host: str,
        config: RemediateConfig,
        *,
        classifier_factory: Callable[[int, int], Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"remediation mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.host = host
        self.cfg = config
        self._clock = clock
        self.tracker = ContentionTracker(window_s=config.window_s)
        self.devices = {d.host: _Device(d, Hysteresis(config.clean_windows,
                                                      config.min_foreign_share))
                        for d in config.devices}  # fmt: skip
        self.pending: list[Record] = self.restore_leftovers() if mode == "apply" else []
        self.classifier: Any = None
        if mode == "apply" and self.devices:
            # Compiled now, not at the verdict: the rule must be in place within a second.
            if classifier_factory is None:
                from fsdp_sentinel.remediate.classifier import Classifier

                classifier_factory = Classifier
            major = config.htb_major
            self.classifier = classifier_factory(handle(major, JOB_MINOR),
                                                 handle(major, OTHER_MINOR))  # fmt: skip

    # ------------------------------------------------------------ records

    def _action(self, dev: DeviceRef, what: str, state: str, **extra: Any) -> Record:
        rec: Record = {"kind": "action", "t": self._clock(), "host": dev.host, "dev": dev.ifname,
                       "what": what, "state": state}  # fmt: skip
        if dev.netns:
            rec["netns"] = dev.netns
        rec.update({k: v for k, v in extra.items() if v is not None})
        return rec

    # ------------------------------------------------------------ start

    def restore_leftovers(self) -> list[Record]:
        """Undo what a crashed earlier run left (state files of dead pids); its actions."""
        out: list[Record] = []
        try:
            entries = statefile.load_all(self.cfg.state_dir)
        except ValueError as e:
            log.error("%s; left alone", e)
            return out
        for saved in entries:
            if statefile.pid_alive(saved.pid):
                log.warning("%s belongs to running pid %d: left alone", saved.path, saved.pid)
                continue
            ops = [o.tc(saved.device.ifname) for o in saved.undo]
            try:
                self._undo(saved.device, saved.undo, saved.major)
            except netlink.TcError as e:
                if e.code in netlink.GONE and "look up" in e.what:
                    statefile.remove(self.cfg.state_dir, saved.device)  # the device is gone
                    continue
                out.append(self._action(saved.device, "restore", "failed", errno=e.errno_name,
                                        why=str(e), ops=ops))  # fmt: skip
                continue
            statefile.remove(self.cfg.state_dir, saved.device)
            log.warning("restored %s, left changed by pid %d", saved.device.key, saved.pid)
            out.append(self._action(saved.device, "restore", "rolled_back", ops=ops,
                                    why=f"left by pid {saved.pid}, which is gone"))  # fmt: skip
        return out

    # ------------------------------------------------------------ seams

    def observe(self, rec: Record) -> None:
        self.tracker.observe(rec)

    def on_verdict(self, verdict: Record) -> list[Record]:
        out, self.pending = self.pending, []
        if verdict.get("cause") != "network":
            return out
        host = verdict.get("host")
        d = self.devices.get(host) if isinstance(host, str) else None
        contention = self.tracker.contention(host, d.ref.ifname) if d and host else None
        flagged = verdict.get("state") == "flagged"
        if flagged:
            a = assess(verdict, contention, d is not None, self.cfg)
            ev = verdict.setdefault("evidence", {})
            if isinstance(ev, dict):
                if contention is not None:
                    ev.update(contention.evidence())
                ev["remediation"] = a.evidence()
            act = a.act
        else:
            act = False
        if d is not None and d.hyst.on_verdict(int(verdict["rank"]), flagged, act):
            out.extend(self._install(d, verdict))
        return out

    def tick(self) -> list[Record]:
        out, self.pending = self.pending, []
        now = self.tracker.now
        for d in self.devices.values():
            if d.plan is None:
                continue
            self._sync_flows(d)
            if now < d.window_end:
                continue
            d.window_end = now + self.cfg.window_s
            c = self.tracker.contention(d.ref.host, d.ref.ifname)
            if d.hyst.on_window(c):
                out.extend(self._remove(d, f"clean for {self.cfg.clean_windows} windows"))
        return out

    def close(self) -> list[Record]:
        out, self.pending = self.pending, []
        for d in self.devices.values():
            if d.plan is not None:
                d.hyst.reset()
                out.extend(self._remove(d, "the daemon is stopping"))
        if self.classifier is not None:
            self.classifier.close()
            self.classifier = None
        return out

    def views(self) -> list[tuple[str, str, bool]]:
        """(host, dev, active) per managed device, for the snapshot."""
        return [(d.ref.host, d.ref.ifname, d.plan is not None and self.mode == "apply")
                for d in self.devices.values()]  # fmt: skip

    # ------------------------------------------------------------ tc

    def _sync_flows(self, d: _Device) -> None:
        if self.classifier is None or self.mode != "apply":
            return
        # One map for every device (4-tuples do not collide): the union of all hosts' flows.
        flows = [f for x in self.devices.values() if x.plan is not None
                 for f in self.tracker.flows(x.ref.host)]  # fmt: skip
        self.classifier.set_flows(flows)
        d.flows = len(self.tracker.flows(d.ref.host))

    def _install(self, d: _Device, verdict: Record) -> list[Record]:
        ref, major = d.ref, self.cfg.htb_major
        ctx = {"rank": verdict.get("rank"), "step": verdict.get("step")}
        started = time.monotonic()
        try:
            with netlink.opened(ref) as ipr:
                idx = netlink.index_of(ipr, ref)
                found = netlink.inspect(ipr, idx, major)
                rate = self.cfg.rate_mbit * 1e6 if self.cfg.rate_mbit else None
                rate = rate or netlink.link_rate_bits(found, ref)
                if rate is None:
                    d.hyst.reset()
                    return [
                        self._action(
                            ref,
                            "prioritise",
                            "failed",
                            **ctx,
                            why="link rate unknown: give --remediate-rate-mbit",
                        )
                    ]
                p = plan(found, rate, major=major, job_share=self.cfg.job_share,
                         prog_name=PROG_NAME)  # fmt: skip
                ops = [o.tc(ref.ifname) for o in p.ops]
                info = {"where": p.where, "rate_mbit": round(rate / 1e6, 1), "ops": ops}
                if self.mode == "dry-run":
                    for line in ops:
                        log.warning("dry-run: %s%s", f"ip netns exec {ref.netns} " if ref.netns
                                    else "", line)  # fmt: skip
                    d.plan = p
                    return [self._action(ref, "prioritise", "dry_run", **ctx, **info)]
                statefile.save(self.cfg.state_dir, ref, major, p.undo,
                               {"root": found.root_kind, "where": p.where})  # fmt: skip
                d.plan = p
                self._sync_flows(d)
                done = 0
                try:
                    for op in p.ops:
                        netlink.run_op(ipr, idx, op, ref.key, fd=self.classifier.fd)
                        done += 1
                except netlink.TcError:
                    if done:
                        self._undo(ref, p.undo, major)
                    statefile.remove(self.cfg.state_dir, ref)
                    d.plan = None
                    raise
        except Refused as e:
            d.hyst.reset()
            return [self._action(ref, "prioritise", "failed", **ctx, why=str(e))]
        except netlink.TcError as e:
            d.hyst.reset()
            d.plan = None
            log.error("remediation on %s failed: %s", ref.key, e)
            return [self._action(ref, "prioritise", "failed", **ctx, errno=e.errno_name,
                                 why=str(e))]  # fmt: skip
        info["apply_s"] = round(time.monotonic() - started, 4)
        info["flows"] = d.flows
        log.warning("prioritised the job's flows on %s (%s)", ref.key, p.where)
        return [self._action(ref, "prioritise", "applied", **ctx, **info)]

    def _undo(self, ref: DeviceRef, undo: tuple[Any, ...], major: int) -> None:
        with netlink.opened(ref) as ipr:
            idx = netlink.index_of(ipr, ref)
            if not netlink.inspect(ipr, idx, major).ours:
                log.warning("our tree is no longer on %s: nothing to undo there", ref.key)
                return
            for op in undo:
                netlink.run_op(ipr, idx, op, ref.key)

    def _remove(self, d: _Device, why: str) -> list[Record]:
        p, ref = d.plan, d.ref
        d.plan = None
        if p is None:
            return []
        ops = [o.tc(ref.ifname) for o in p.undo]
        if self.mode == "dry-run":
            return [self._action(ref, "restore", "dry_run", ops=ops, why=why)]
        try:
            self._undo(ref, p.undo, self.cfg.htb_major)
        except netlink.TcError as e:
            log.error("restoring %s failed: %s (state file kept)", ref.key, e)
            return [self._action(ref, "restore", "failed", errno=e.errno_name, why=str(e),
                                 ops=ops)]  # fmt: skip
        statefile.remove(self.cfg.state_dir, ref)
        log.warning("restored %s (%s)", ref.key, why)
        return [self._action(ref, "restore", "rolled_back", ops=ops, why=why)]
