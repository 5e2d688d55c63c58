"""Process groups in coll records: several model parts, several groups, one lineup each.

A pipeline-shaped job on real FSDP2 over gloo: 4 ranks on a (pp=2, dp=2)
mesh. The ranks of stage 0 hold two model parts (two FSDP roots, as an
interleaved schedule gives them), those of stage 1 one part, each sharded
over its stage's dp group; every rank also holds a part sharded over all four
ranks (a shared embedding, say). So ranks belong to two groups each, the dp
groups issue different numbers of collectives, and only a ``seq`` counted per
group names the world group's collectives alike on every rank. (No
activations cross between the stages: stage 0 never waits on stage 1 except
in the world group, which is what makes a lineup across groups visibly wrong.)
The oracle for the lineup is the delay this test puts on one rank of stage 1.
Last, a synthetic two-stage job through the whole pipeline, with and
without its ``group`` fields.
"""

from __future__ import annotations

import heapq
import textwrap
from collections import defaultdict
from typing import Any

import pytest
from test_hooks_fsdp import by_rank, json_objects, run_torchrun

from fsdp_sentinel.correlate import Correlator
from fsdp_sentinel.emit import DEFAULT_SOCKET, SOCKET_ENV, socket_from_env
from fsdp_sentinel.hooks import FROM_ENV, group_id, socket_for
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.synth import Scenario, SlowCompute, generate
from fsdp_sentinel.trace import TIME_FIELD
from fsdp_sentinel.trainer.launch import torchrun_argv

STEPS = 4
DELAY_STEP, DELAY_S = 2, 0.6

PIPELINE_WORKER = textwrap.dedent(
    f"""
    import json, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fsdp_sentinel.hooks import instrument

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    world = init_device_mesh("cpu", (4,))
    stage, rank = mesh.get_local_rank("pp"), dist.get_rank()
    torch.manual_seed(stage)
    shared = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    parts = [nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2 - stage)]
    for part, m in [(shared, world), *((p, mesh["dp"]) for p in parts)]:
        fully_shard(part[0], mesh=m)
        fully_shard(part, mesh=m)
    parts = [shared, *parts]
    inst = instrument(parts, socket_path=None, trace_out=sys.argv[1])  # one instance, all parts
    inst.attach(parts[-1])  # a part attached again is not wrapped twice
    pg = parts[-1]._get_fsdp_state()._fsdp_param_groups[0]
    inner = type(pg._all_gather_comm.inner).__name__
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    for step in range({STEPS}):
        with inst.step(step):
            x = torch.randn(4, 8)
            for part in parts:
                x = part(x)
            if rank == 3 and step == {DELAY_STEP}:
                time.sleep({DELAY_S})  # a straggler in stage 1 only
            x.square().mean().backward()
            opt.step()
            opt.zero_grad()
    inst.close()
    print(json.dumps({{"rank": rank, "modules": len(inst.modules), "inner": inner,
                      "errors": inst.errors}}))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def pipeline_trace(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("fssA-groups")
    script = d / "pipeline.py"
    script.write_text(PIPELINE_WORKER)
    out = run_torchrun(torchrun_argv(4, target=[str(script)], args=[f"{d}/p{{rank}}.jsonl"]))
    summaries = {s["rank"]: s for s in json_objects(out.stdout) if "modules" in s}
    # The shared part and, on stage 0, two parts (on stage 1 one) of two FSDP modules each.
    assert {r: (s["modules"], s["errors"]) for r, s in summaries.items()} == {
        0: (6, 0), 1: (6, 0), 2: (4, 0), 3: (4, 0),
    }  # fmt: skip
    assert {s["inner"] for s in summaries.values()} == {"DefaultAllGather"}
    return by_rank(sorted(d.glob("p*.jsonl")))


def colls(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if r["kind"] == "coll"]


@pytest.mark.torch
def test_each_group_numbers_its_own_collectives(
    pipeline_trace: dict[int, list[dict[str, Any]]],
) -> None:
    views: dict[str, dict[int, list[tuple[Any, ...]]]] = defaultdict(dict)
    for rank, recs in pipeline_trace.items():
        by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for c in colls(recs):
            by_group[c["group"]].append(c)
        dp = "0-1" if rank < 2 else "2-3"  # the dp group of the rank's stage
        assert sorted(by_group) == sorted([dp, "0-3"])
        for group, cs in by_group.items():
            assert {c["group_size"] for c in cs} == {4 if group == "0-3" else 2}
            assert [c["seq"] for c in cs] == list(range(len(cs)))  # from 0, no gaps
            views[group][rank] = [(c["seq"], c["step"], c["op"], c["bytes"]) for c in cs]
        # Per part and step: the root and its child all-gathered in forward, the
        # child again in backward, both reduce-scattered: 5.
        assert len(by_group["0-3"]) == STEPS * 5
        assert len(by_group[dp]) == STEPS * 5 * (2 if rank < 2 else 1)
    assert {g: sorted(v) for g, v in views.items()} == {
        "0-1": [0, 1], "2-3": [2, 3], "0-3": [0, 1, 2, 3],
    }  # fmt: skip
    for group, vs in views.items():  # one collective, one (group, seq), on every member
        assert all(v == next(iter(vs.values())) for v in vs.values()), group
    # A rank's running count alone would not do: the world group's collectives
    # come at different places in stage 0's and stage 1's issue order.
    place = {
        r: [i for i, c in enumerate(colls(recs)) if c["group"] == "0-3"]
        for r, recs in pipeline_trace.items()
    }
    assert place[0] == place[1] and place[2] == place[3] and place[0] != place[2]


def correlated(traces: dict[int, list[dict[str, Any]]]) -> Correlator:
    c = Correlator()
    for recs in traces.values():
        for r in recs:
            if r["kind"] == "coll":
                c.add_coll(r)
            elif r["kind"] == "step":
                c.add_step(r)
    return c


@pytest.mark.torch
def test_the_correlator_lines_collectives_up_per_group(
    pipeline_trace: dict[int, list[dict[str, Any]]],
) -> None:
    c = correlated(pipeline_trace)
    summaries = {step: c.step_summary(step, now=2e9).ranks for step in range(STEPS)}
    late = {rs.rank: rs.late_s for rs in summaries[DELAY_STEP]}
    # Rank 3 arrived late at its dp group's backward collectives (rank 2 waited
    # for it) and so, with rank 2, at the world group's; ranks 0 and 1 only
    # waited, in the world group.
    assert late[3] >= 0.6 * DELAY_S, late
    assert max(late[0], late[1]) < 0.25 * DELAY_S, late
    # Every collective of every rank found its group's other members.
    for ranks in summaries.values():
        assert len(ranks) == 4
        for rs in ranks:
            assert rs.matched == rs.n_coll > 0, rs


# ----------------------------------------------------------------- names and the socket (pure)


def test_group_names_are_short_and_the_same_on_every_member() -> None:
    assert group_id([0, 1, 2, 3]) == "0-3"
    assert group_id([1, 3, 5, 7]) == "1-7:2"
    assert group_id([5]) == "5"
    assert group_id(range(16384)) == "0-16383"
    odd = group_id([0, 1, 5])
    assert odd.startswith("h") and len(odd) == 13 and odd == group_id((0, 1, 5))
    assert group_id([0, 5, 1]) != odd  # group order is part of the name, as in c10d


def test_socket_precedence_argument_then_environment_then_default() -> None:
    assert socket_from_env({}) == DEFAULT_SOCKET
    assert socket_from_env({SOCKET_ENV: "/run/job/ingest.sock"}) == "/run/job/ingest.sock"
    assert socket_from_env({SOCKET_ENV: "off"}) is None
    assert socket_from_env({SOCKET_ENV: ""}) is None
    env = {SOCKET_ENV: "/from/env.sock"}
    assert socket_for(FROM_ENV, env) == "/from/env.sock"
    assert socket_for("/from/arg.sock", env) == "/from/arg.sock"  # the argument wins
    assert socket_for(None, env) is None  # no socket, whatever the launcher said


def test_an_unset_trainer_socket_flag_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_sentinel.trainer.config import parse_args

    monkeypatch.setenv(SOCKET_ENV, "/run/job/ingest.sock")
    assert parse_args([]).socket == "/run/job/ingest.sock"
    assert parse_args(["--socket", "/x.sock"]).socket == "/x.sock"
    assert parse_args(["--socket", "off"]).socket is None
    monkeypatch.delenv(SOCKET_ENV)
    assert parse_args([]).socket == DEFAULT_SOCKET


# ----------------------------------------------------------------- a synthetic two-stage job


def synthetic_stage(seed: int, faults: tuple[Any, ...], first: int) -> list[dict[str, Any]]:
    """A 2-rank synthetic job (hook records only) as ranks ``first``, ``first + 1``
    of a 4-rank one: one pipeline stage whose collectives are its group's."""
    recs, _ = generate(
        Scenario(ranks=2, steps=30, n_coll=6, probes=False, seed=seed, faults=faults)
    )
    out = []
    for rec in recs:
        if rec["kind"] not in ("rank", "step", "coll", "pending"):
            continue  # (connection records: the stages' made-up endpoints would clash)
        r = dict(rec)
        r["rank"] += first
        if r["kind"] == "rank":
            r.update(world_size=4, pid=r["pid"] + first, host=f"synth-h{r['rank']}")
        elif r["kind"] in ("coll", "pending"):
            r["group"] = f"{first}-{first + 1}"
        out.append(r)
    return out


def verdicts(recs: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    p = Pipeline()
    return [(v["rank"], v["state"], v["cause"]) for r in recs for v in p.feed(r)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_straggler_in_one_stage_is_found_only_when_groups_are_kept_apart(seed: int) -> None:
    # Two stages with the same shape, so their seq numbers coincide; rank 1
    # (stage 0) computes 2.5x slower from step 10 on.
    def when(r: dict[str, Any]) -> float:
        field = TIME_FIELD[r["kind"]]
        return float(r[field]) if field else 0.0

    job = list(
        heapq.merge(
            synthetic_stage(seed, (SlowCompute(1, 2.5, 10, 30),), 0),
            synthetic_stage(seed + 100, (), 2),
            key=when,
        )
    )
    assert {r["group"] for r in job if r["kind"] == "coll"} == {"0-1", "2-3"}
    assert verdicts(job) == [(1, "flagged", "compute")]
    # The same trace as older hooks wrote it (no group): each collective is
    # lined up with the other stage's of the same seq, and the straggler is missed.
    old = [{k: v for k, v in r.items() if k != "group"} for r in job]
    assert (1, "flagged", "compute") not in verdicts(old)
