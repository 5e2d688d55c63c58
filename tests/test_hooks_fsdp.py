"""Hooks on real FSDP2 over gloo: 2 ranks via torchrun, every collective timed.

The byte oracle is computed here from the model's parameter shapes (FSDP2
pads each parameter's dim 0 to a multiple of the world size), independently
of the hooks that measure the collectives.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import textwrap
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.emit import SOCKET_ENV
from fsdp_sentinel.hostinfo import _ipv4_local, _ipv6_addrs, local_addrs
from fsdp_sentinel.trace import read_trace, validate
from fsdp_sentinel.trainer.launch import local_env, torchrun_argv

WORLD = 2
STEPS = 4
# Odd sizes so that FSDP pads: vocab 65 and seq-len 17 are not multiples of 2.
MODEL: dict[str, Any] = dict(layers=2, dim=32, heads=2, seq_len=17, vocab=65)


def run_torchrun(
    argv: list[str], timeout: float = 280, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, env=local_env(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def by_rank(paths: list[Path]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for p in paths:
        recs = [r for r in read_trace(p) if r["kind"] != "header"]
        ranks = {r["rank"] for r in recs if "rank" in r}
        assert len(ranks) == 1, (p, ranks)
        out[ranks.pop()] = recs
    return out


def padded_bytes(params: list[Any], world: int) -> int:
    """Bytes of the parameters once FSDP pads each dim 0 to a multiple of ``world``."""
    total = 0
    for p in params:
        dim0 = math.ceil(p.shape[0] / world) * world
        total += dim0 * math.prod(p.shape[1:]) * p.element_size()
    return total


# ----------------------------------------------------------------- the bundled trainer


@pytest.fixture(scope="module")
def trainer_trace(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("fssA-hooks")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    args += [f"--steps={STEPS}", "--batch=2", "--socket=off", f"--trace-out={d}/rank{{rank}}.jsonl"]
    run_torchrun(torchrun_argv(WORLD, args=args))
    return by_rank(sorted(d.glob("rank*.jsonl")))


@pytest.mark.torch
def test_rank_record_first(trainer_trace: dict[int, list[dict[str, Any]]]) -> None:
    assert sorted(trainer_trace) == list(range(WORLD))
    for rank, recs in trainer_trace.items():
        first = recs[0]
        assert first["kind"] == "rank"
        assert (first["rank"], first["world_size"]) == (rank, WORLD)
        assert first["addrs"] == local_addrs()
        assert isinstance(first["pid"], int) and first["host"]
    # one run id for the whole job, whatever the launcher set (docs/trace-format.md)
    jobs = {recs[0].get("job") for recs in trainer_trace.values()}
    assert len(jobs) == 1 and all(jobs), jobs


@pytest.mark.torch
def test_step_and_both_ops_every_step(trainer_trace: dict[int, list[dict[str, Any]]]) -> None:
    for recs in trainer_trace.values():
        steps = [r for r in recs if r["kind"] == "step"]
        assert [s["step"] for s in steps] == list(range(STEPS))
        ops = {(r["step"], r["op"]) for r in recs if r["kind"] == "coll"}
        for step in range(STEPS):
            assert (step, "all_gather") in ops and (step, "reduce_scatter") in ops


@pytest.mark.torch
def test_colls_lie_inside_their_step(trainer_trace: dict[int, list[dict[str, Any]]]) -> None:
    for recs in trainer_trace.values():
        span = {r["step"]: (r["start"], r["end"]) for r in recs if r["kind"] == "step"}
        for c in (r for r in recs if r["kind"] == "coll"):
            start, end = span[c["step"]]
            assert start <= c["issue"] <= c["end"] <= end, c
            assert c["group_size"] == WORLD


@pytest.mark.torch
def test_seq_matches_across_ranks(trainer_trace: dict[int, list[dict[str, Any]]]) -> None:
    views = []
    for recs in trainer_trace.values():
        colls = sorted((r for r in recs if r["kind"] == "coll"), key=lambda r: r["seq"])
        assert [c["seq"] for c in colls] == list(range(len(colls)))  # from 0, no gaps
        views.append([(c["seq"], c["step"], c["op"], c["bytes"]) for c in colls])
    assert all(v == views[0] for v in views)


@pytest.mark.torch
def test_bytes_match_the_model_and_reshard_policy(
    trainer_trace: dict[int, list[dict[str, Any]]],
) -> None:
    import torch

    from fsdp_sentinel.trainer.model import GPT, ModelConfig

    with torch.device("meta"):
        model = GPT(ModelConfig(**MODEL))
    blocks = [padded_bytes(list(b.parameters()), WORLD) for b in model.blocks]
    root = padded_bytes(
        [p for n, p in model.named_parameters() if not n.startswith("blocks.")], WORLD
    )
    unpadded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(blocks) + root > unpadded  # the odd sizes really pad
    # Blocks reshard after forward, so backward all-gathers them again; the root does not.
    want_ag = Counter([root, *blocks, *blocks])
    want_rs = Counter([root, *blocks])
    for recs in trainer_trace.values():
        per_step: dict[tuple[int, str], list[int]] = defaultdict(list)
        for c in (r for r in recs if r["kind"] == "coll"):
            per_step[(c["step"], c["op"])].append(c["bytes"])
        for step in range(STEPS):
            assert Counter(per_step[(step, "all_gather")]) == want_ag
            assert Counter(per_step[(step, "reduce_scatter")]) == want_rs
            assert sum(per_step[(step, "reduce_scatter")]) == root + sum(blocks)
            assert sum(per_step[(step, "all_gather")]) == 2 * sum(blocks) + root


# ----------------------------------------------------------------- any FSDP2 model, live socket

# A process group and a small FSDP2 model whose root owns parameters too (inp, out).
NET = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from fsdp_sentinel.hooks import instrument

    dist.init_process_group("gloo")
    class Net(nn.Module):  # the root owns parameters too (inp, out)
        def __init__(self):
            super().__init__()
            self.inp, self.body, self.out = nn.Linear(10, 33), nn.Linear(33, 33), nn.Linear(33, 7)

        def forward(self, x):
            return self.out(torch.relu(self.body(torch.relu(self.inp(x)))))

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.body)
    fully_shard(model)
    """
)

WORKER = NET + textwrap.dedent(
    """
    inst = instrument(model, trace_out=sys.argv[1])  # the socket: the launcher's (env)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with inst.step(step):
            if step == 1:
                model.unshard(async_op=True)  # an async all-gather: completion by callback
            loss = model(torch.randn(4, 10)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    inst.close()
    print(json.dumps({"rank": inst.rank, "sent": inst.sent, "dropped": inst.dropped,
                      "colls": inst.colls, "errors": inst.errors}), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A daemon stand-in: a thread that reads datagrams (a record a line) into a list."""
    path = str(tmp_path / "ingest.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.2)
    got: list[dict[str, Any]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                got.extend(json.loads(line) for line in s.recv(70_000).split(b"\n"))
            except TimeoutError:
                continue

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield path, got
    stop.set()
    t.join()
    s.close()


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object printed in ``text``: torchrun passes the ranks' stdout
    through as it comes, so two ranks' lines can land on one line."""
    dec = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = text.find("{")
    while i >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # a brace in a log line, not a summary
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = text.find("{", end)
    return out


@pytest.mark.torch
def test_any_fsdp2_model_to_the_socket_the_launcher_names(
    tmp_path: Path, listener: tuple[str, list[dict[str, Any]]]
) -> None:
    path, got = listener
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # The code names no socket; the launcher does, in the environment.
    env = {**os.environ, SOCKET_ENV: path}
    out = run_torchrun(
        torchrun_argv(WORLD, target=[str(script)], args=[f"{tmp_path}/w{{rank}}.jsonl"]), env=env
    )
    summaries = json_objects(out.stdout)
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    traces = by_rank(sorted(tmp_path.glob("w*.jsonl")))
    for s in summaries:
        recs = traces[s["rank"]]
        assert s["errors"] == 0
        # Per step: the root all-gathers once, the body twice (resharded after
        # forward); each reduce-scatters once. Three steps.
        ops = Counter(r["op"] for r in recs if r["kind"] == "coll")
        assert ops == {"all_gather": 9, "reduce_scatter": 6}
        assert s["colls"] == 15
        assert s["sent"] + s["dropped"] == len(recs)  # rank + steps + colls
        assert s["sent"] > 0
    # Everything the kernel accepted reached the listener, and matches the trace files.
    deadline = threading.Event()
    for _ in range(50):
        if len(got) >= sum(s["sent"] for s in summaries):
            break
        deadline.wait(0.1)
    assert len(got) == sum(s["sent"] for s in summaries)
    for rec in got:
        assert rec in traces[rec["rank"]]


# ----------------------------------------------------------------- addresses (pure)

FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     +-- 127.0.0.0/8 2 0 2
           |-- 127.0.0.1
              /32 host LOCAL
     |-- 198.18.0.0
        /24 link UNICAST
     |-- 198.18.0.5
        /24 link UNICAST
        /32 host LOCAL
     |-- 198.18.0.255
        /32 link BROADCAST
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 198.18.0.5
        /32 host LOCAL
     |-- 10.1.2.3
        /32 host LOCAL
"""

IF_INET6 = """\
00000000000000000000000000000001 01 80 10 80       lo
fe80000000000000000000fffe000001 02 40 20 80     eth0
20010db8000000000000000000000007 02 40 00 80     eth0
"""


def test_addresses_from_proc_net(tmp_path: Path) -> None:
    (tmp_path / "fib_trie").write_text(FIB_TRIE)
    (tmp_path / "if_inet6").write_text(IF_INET6)
    assert _ipv4_local(FIB_TRIE) == ["127.0.0.1", "198.18.0.5", "198.18.0.5", "10.1.2.3"]
    assert _ipv6_addrs(IF_INET6) == ["2001:db8::7"]  # lo and fe80:: are host/link scope
    assert local_addrs(tmp_path) == ["10.1.2.3", "198.18.0.5", "2001:db8::7"]


def test_addresses_match_ip_addr() -> None:
    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no ip command")
    want = set()
    for link in json.loads(out.stdout):
        for a in link.get("addr_info", []):
            if a.get("scope") == "global":
                want.add(a["local"])
    assert set(local_addrs()) == want


def test_missing_proc_files_give_no_addresses(tmp_path: Path) -> None:
    assert local_addrs(tmp_path) == []


# ----------------------------------------------------------------- hooks never break training


class BrokenEmitter:
    sent = dropped = 0

    def emit(self, rec: dict[str, Any]) -> None:
        raise RuntimeError("emitter exploded")

    def close(self) -> None:
        pass


class BadTensor:
    """Looks enough like a tensor for the wrapper, but fails when measured."""

    device = type("D", (), {"type": "cpu"})()

    def numel(self) -> int:
        raise RuntimeError("no size")


def test_hook_exceptions_are_counted_not_raised() -> None:
    from fsdp_sentinel.hooks import Instrumentation

    inst = Instrumentation(BrokenEmitter(), rank=0, world_size=2, host="h")  # type: ignore[arg-type]
    inst.announce()
    with inst.step(3) as span:
        span.loss = 1.0
    assert inst._issue("all_gather", BadTensor(), None) is None  # type: ignore[arg-type]
    assert inst.errors == 3
    assert isinstance(inst.first_error, RuntimeError)


def test_a_failing_step_body_still_raises_and_emits_nothing() -> None:
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.hooks import Instrumentation

    em = Emitter(None)
    inst = Instrumentation(em, rank=0, world_size=1, host="h")
    with pytest.raises(ZeroDivisionError), inst.step(0):
        1 / 0  # noqa: B018 - the training step's own error propagates
    assert (em.written, inst.errors) == (0, 0)


@pytest.mark.torch
def test_collective_runs_exactly_once_when_the_hook_fails() -> None:
    from fsdp_sentinel.hooks import Instrumentation, _wrap_comm

    inst = Instrumentation(BrokenEmitter(), rank=0, world_size=2, host="h")  # type: ignore[arg-type]
    calls: list[tuple[Any, ...]] = []

    def inner(*args: Any) -> str:
        calls.append(args)
        return "work"

    bad = BadTensor()
    for kind, extra in (("all_gather", ()), ("reduce_scatter", ("sum",))):
        comm = _wrap_comm(inst, kind, inner)
        assert comm(bad, bad, "group", *extra, True) == "work"
    assert len(calls) == 2
    assert inst.errors == 2


def test_cuda_watcher_stamps_in_order_off_thread(tmp_path: Path) -> None:
    # The watcher's logic with stand-in waits (there is no GPU here): records
    # are stamped after their wait returns, in issue order.
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.hooks import Instrumentation, _cuda_done_waiter, _CudaWatcher

    class FakeWork:  # an async Work that completes after three queries
        polls = 0

        def is_completed(self) -> bool:
            self.polls += 1
            return self.polls >= 3

    out = tmp_path / "w.jsonl"
    inst = Instrumentation(
        Emitter(None, str(out)), rank=0, world_size=2, host="h", owns_emitter=True
    )
    gate = threading.Event()
    watcher = _CudaWatcher(inst)
    watcher.put({"kind": "x", "seq": 0}, lambda: None if gate.wait() else None)
    watcher.put({"kind": "x", "seq": 1}, _cuda_done_waiter(FakeWork()))
    assert inst.colls == 0  # the first is still waiting
    gate.set()
    watcher.stop()
    inst.close()
    recs = list(read_trace(out))[1:]
    assert [r["seq"] for r in recs] == [0, 1]
    assert all(isinstance(r["end"], float) for r in recs)


# ----------------------------------------------------------------- pending records


class FakeTensor:
    """Enough of a CPU tensor for the hooks' record: 1 KiB."""

    device = type("D", (), {"type": "cpu"})()

    def numel(self) -> int:
        return 256

    def element_size(self) -> int:
        return 4


class FakeGroup:
    def size(self) -> int:
        return 2


def test_pending_records_come_from_the_sender_thread_while_a_collective_is_in_flight(
    tmp_path: Path,
) -> None:
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.hooks import Instrumentation

    threads: list[str] = []

    class Watching(Emitter):
        def emit(self, rec: dict[str, Any]) -> None:
            if rec["kind"] == "pending":
                threads.append(threading.current_thread().name)
            super().emit(rec)

    out = tmp_path / "p.jsonl"
    em = Watching(None, str(out), flush_interval=0.01)
    inst = Instrumentation(em, rank=3, world_size=4, host="h", pending_after_s=0.2,
                           pending_every_s=0.2, owns_emitter=True)  # fmt: skip
    quick = inst._issue("all_gather", FakeTensor(), FakeGroup())  # type: ignore[arg-type]
    assert quick is not None
    inst._issued(quick, None, FakeTensor())  # type: ignore[arg-type]  # synchronous: done
    with inst.step(7):
        rec = inst._issue("reduce_scatter", FakeTensor(), FakeGroup())  # type: ignore[arg-type]
        assert rec is not None
        threading.Event().wait(0.75)  # this thread "blocked in the collective"
        inst._complete(rec)
        threading.Event().wait(0.3)  # nothing pending any more
    inst.close()
    recs = [r for r in read_trace(out) if r["kind"] != "header"]
    pend = [r for r in recs if r["kind"] == "pending"]
    coll = next(r for r in recs if r["kind"] == "coll" and r["seq"] == rec["seq"])
    assert set(threads) == {"fsdp-sentinel-emit"}  # never the training thread
    assert 3 <= len(pend) <= 4  # at 0.2, 0.4, 0.6 (and maybe 0.75) s of 0.75 s in flight
    for p in pend:
        assert validate(p) is None
        assert (p["rank"], p["step"], p["seq"], p["op"], p["issue"]) == (
            3, 7, coll["seq"], "reduce_scatter", coll["issue"],
        )  # fmt: skip
        assert coll["issue"] + 0.2 <= p["t"] <= coll["end"] + 0.05
    gaps = [b["t"] - a["t"] for a, b in zip(pend, pend[1:], strict=False)]
    assert all(0.15 <= g <= 0.35 for g in gaps), gaps
    assert not [r for r in pend if r["seq"] == quick["seq"]]  # it never waited
    assert inst.pendings == len(pend) and em.ticker_errors == 0


def test_pending_records_keep_their_period_on_the_senders_tick_grid() -> None:
    # The sender ticks on a 0.25-s grid, each tick a little late (thread
    # wake-up). A record due at 2.0 is sent at the tick 2.001 even though the
    # previous one went out at 1.003: due a period after it was due, not
    # after the tick (which put it at 2.25 whenever a tick was less late
    # than the one before). A sender starved for seconds sends one, then
    # keeps its period from then.
    from fsdp_sentinel.hooks import Instrumentation

    class Ticks:
        def __init__(self) -> None:
            self.tick: Any = None
            self.recs: list[dict[str, Any]] = []

        def add_ticker(self, fn: Any) -> None:
            self.tick = fn

        def emit(self, rec: dict[str, Any]) -> None:
            self.recs.append(rec() if callable(rec) else rec)

    now = [0.0]
    em = Ticks()
    inst = Instrumentation(em, rank=0, world_size=2, host="h", clock=lambda: now[0])  # type: ignore[arg-type]
    rec = inst._issue("all_gather", FakeTensor(), FakeGroup())  # type: ignore[arg-type]
    assert rec is not None
    sent = []
    for t in (0.752, 1.003, 1.251, 1.502, 1.753, 2.001, 2.252, 3.004, 6.6, 6.85, 7.1, 7.35, 7.6):
        now[0] = t
        n = len(em.recs)
        em.tick()
        sent += [t] * (len(em.recs) - n)
    assert sent == [1.003, 2.001, 3.004, 6.6, 7.6]


@pytest.mark.torch
def test_a_rank_waiting_for_a_stalled_peer_reports_pending_and_the_stalled_one_does_not(
    tmp_path: Path,
) -> None:
    # Real FSDP2 over gloo: rank 1 sleeps 2.5 s in step 2 (between forward and
    # backward), so rank 0 blocks ~2.5 s in its next collective.
    args = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    args += ["--steps=4", "--batch=2", "--socket=off", f"--trace-out={tmp_path}/r{{rank}}.jsonl",
             "--delay-rank=1", "--delay-seconds=2.5", "--delay-steps=2:3"]  # fmt: skip
    run_torchrun(torchrun_argv(WORLD, args=args))
    traces = by_rank(sorted(tmp_path.glob("r*.jsonl")))
    assert not [r for r in traces[1] if r["kind"] == "pending"]  # asleep, nothing in flight
    pend = [r for r in traces[0] if r["kind"] == "pending"]
    assert 2 <= len(pend) <= 3, pend  # at ~1 s and ~2 s of ~2.5 s in flight
    colls = {r["seq"]: r for r in traces[0] if r["kind"] == "coll"}
    (seq,) = {p["seq"] for p in pend}
    c = colls[seq]  # the collective completed, and its record says how long it waited
    assert c["step"] == 2 and c["end"] - c["issue"] >= 2.0
    for p in pend:
        assert validate(p) is None
        assert (p["step"], p["op"], p["issue"]) == (c["step"], c["op"], c["issue"])
        assert c["issue"] + 1.0 <= p["t"] < c["end"]
    assert 0.9 <= pend[1]["t"] - pend[0]["t"] <= 1.2
    # The waiting rank's collectives went on in seq order with the stalled one's.
    assert sorted(colls) == sorted(r["seq"] for r in traces[1] if r["kind"] == "coll")


# ----------------------------------------------------------------- the user's own comms

COMMS_WORKER = NET + textwrap.dedent(
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather, DefaultReduceScatter,
    )

    class CountingAllGather(DefaultAllGather):  # a user's comm: notes every call it runs
        def __init__(self):
            self.calls = []

        def __call__(self, out, inp, group, async_op=False):
            self.calls.append(out.numel() * out.element_size())
            return super().__call__(out, inp, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __init__(self):
            self.calls = []

        def __call__(self, out, inp, group, op, async_op=False):
            self.calls.append(inp.numel() * inp.element_size())
            return super().__call__(out, inp, group, op, async_op)

    def comms(m):
        pg = m._get_fsdp_state()._fsdp_param_groups[0]
        ag, rs = pg._all_gather_comm, pg._reduce_scatter_comm
        return [type(c).__name__ for c in (ag, getattr(ag, "inner", ag), rs, getattr(rs, "inner", rs))]

    ag, rs = CountingAllGather(), CountingReduceScatter()
    model.body.set_custom_all_gather(ag)  # set before instrument()
    model.set_allocate_memory_from_process_group_for_comm(True)  # the same, FSDP's own kind
    inst = instrument(model, socket_path=None, trace_out=sys.argv[1])
    before = {"body": comms(model.body), "root": comms(model)}
    refused = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:  # set after instrument(): FSDP must accept them, and they must run
            model.body.set_custom_reduce_scatter(rs)
            try:
                model.set_allocate_memory_from_process_group_for_comm(False)
            except AssertionError as e:
                refused.append(str(e))
        with inst.step(step):
            model(torch.randn(4, 10)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    after = {"body": comms(model.body), "root": comms(model)}
    inst.detach()
    detached = {"body": comms(model.body), "root": comms(model)}
    inst.close()
    print(json.dumps({"rank": inst.rank, "ag": ag.calls, "rs": rs.calls, "before": before,
                      "after": after, "detached": detached, "refused": refused,
                      "rewrapped": inst.rewrapped, "errors": inst.errors}), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.torch
def test_a_comm_the_user_set_before_or_after_instrument_is_the_one_that_runs(
    tmp_path: Path,
) -> None:
    script = tmp_path / "comms.py"
    script.write_text(COMMS_WORKER)
    out = run_torchrun(
        torchrun_argv(WORLD, target=[str(script)], args=[f"{tmp_path}/c{{rank}}.jsonl"])
    )
    summaries = {s["rank"]: s for s in json_objects(out.stdout) if "ag" in s}
    assert sorted(summaries) == [0, 1]
    traces = by_rank(sorted(tmp_path.glob("c*.jsonl")))
    for rank, s in summaries.items():
        assert s["errors"] == 0 and s["refused"] == []
        # Wrapped, not replaced: the user's comm (and FSDP's ProcessGroup one)
        # sits inside the timed one, which FSDP sees as the class it wraps.
        assert s["before"] == {
            "body": ["TimedDefaultAllGather", "CountingAllGather",
                     "TimedDefaultReduceScatter", "DefaultReduceScatter"],
            "root": ["TimedProcessGroupAllocAllGather", "ProcessGroupAllocAllGather",
                     "TimedProcessGroupAllocReduceScatter", "ProcessGroupAllocReduceScatter"],
        }  # fmt: skip
        # Set after instrument(): accepted by FSDP, then wrapped at the next step.
        assert s["after"] == {
            "body": ["TimedDefaultAllGather", "CountingAllGather",
                     "TimedDefaultReduceScatter", "CountingReduceScatter"],
            "root": ["TimedDefaultAllGather", "DefaultAllGather",
                     "TimedDefaultReduceScatter", "DefaultReduceScatter"],
        }  # fmt: skip
        assert s["rewrapped"] == 3
        # detach() hands back what it wrapped, the user's comms included.
        assert s["detached"] == {
            "body": ["CountingAllGather", "CountingAllGather",
                     "CountingReduceScatter", "CountingReduceScatter"],
            "root": ["DefaultAllGather", "DefaultAllGather",
                     "DefaultReduceScatter", "DefaultReduceScatter"],
        }  # fmt: skip
        colls = [r for r in traces[rank] if r["kind"] == "coll"]
        # The body is all-gathered twice a step (forward, backward), every time by
        # the user's comm, and each of those calls has its timed record.
        (body_bytes,) = set(s["ag"])
        assert len(s["ag"]) == 2 * 4
        body_ag = [c for c in colls if c["op"] == "all_gather" and c["bytes"] == body_bytes]
        assert len(body_ag) == len(s["ag"])
        # The reduce-scatter set at step 2 ran in steps 2 and 3, and was timed.
        (rs_bytes,) = set(s["rs"])
        assert len(s["rs"]) == 2
        body_rs = [c for c in colls if c["op"] == "reduce_scatter" and c["bytes"] == rs_bytes]
        assert sorted(c["step"] for c in body_rs) == [0, 1, 2, 3]
        # Every collective still timed: the root's too, before and after its comm changed.
        assert Counter(c["op"] for c in colls) == {"all_gather": 12, "reduce_scatter": 8}
        assert {c["group"] for c in colls} == {"0-1"}
        assert sorted(c["seq"] for c in colls) == list(range(len(colls)))


@pytest.mark.torch
def test_fsdp_sees_the_timed_comm_as_the_class_it_wraps() -> None:
    # FSDP's own tests of a comm (FSDPParamGroup.set_symm_mem,
    # set_allocate_memory_from_process_group, _validate_reduce_scatter_max_input_buffers)
    # are isinstance checks; these are theirs, on the timed comms. The
    # symmetric-memory comms need NCCL to be built, so they are made without
    # their __init__ (a barrier), which the timed comm never runs either.
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from fsdp_sentinel.hooks import Instrumentation, _wrap_comm

    inst = Instrumentation(BrokenEmitter(), rank=0, world_size=2, host="h")  # type: ignore[arg-type]

    class Mine(AllGather):  # the user's own: FSDP refuses to replace it
        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any: ...
        def __call__(self, *args: Any) -> Any: ...

    symm_ag = fc.SymmMemAllGather.__new__(fc.SymmMemAllGather)
    symm_rs = fc.SymmMemReduceScatter.__new__(fc.SymmMemReduceScatter)
    may_symm_mem = (fc.DefaultAllGather, fc.SymmMemAllGather)
    may_pg_alloc = (fc.DefaultAllGather, fc.ProcessGroupAllocAllGather)
    for inner, symm, pg_alloc in [
        (fc.DefaultAllGather(), True, True),
        (symm_ag, True, False),
        (fc.ProcessGroupAllocAllGather.__new__(fc.ProcessGroupAllocAllGather), False, True),
        (Mine(), False, False),
    ]:
        timed = _wrap_comm(inst, "all_gather", inner)
        assert timed.inner is inner and isinstance(timed, AllGather)
        assert isinstance(timed, may_symm_mem) is isinstance(inner, may_symm_mem) is symm
        assert isinstance(timed, may_pg_alloc) is isinstance(inner, may_pg_alloc) is pg_alloc
    timed_rs = _wrap_comm(inst, "reduce_scatter", symm_rs)
    assert isinstance(timed_rs, ReduceScatter) and isinstance(timed_rs, fc.SymmMemReduceScatter)
    assert not isinstance(_wrap_comm(inst, "reduce_scatter", fc.DefaultReduceScatter()),
                          fc.SymmMemReduceScatter)  # fmt: skip
