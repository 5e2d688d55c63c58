"""The job's own c10d store as the node daemons' meeting place.

torchrun already runs a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for every
job; a node daemon joins it as one more client (``is_master=False``), found
from the ``store`` field of its ranks' ``rank`` records. Nothing new to
deploy, and the store lives exactly as long as the job.

Every key lives under ``fsdp-sentinel/<job>/`` (torch's own keys are never
touched). :class:`ClusterStore` names them and counts the bytes it moves:

=====================  =====================================================
``roster``             ``"<lowest rank>:<node>;"`` appended by each node once
``ranks/<node>``       the node's ``rank`` records (JSON), for a new leader
``w/<node>/<seq>``     one window (:mod:`~fsdp_sentinel.cluster.summary`),
                       deleted by the leader once read
``hb/<node>``          the node's newest window seq (its heartbeat)
``next/<node>``        the next seq the leader will read (a successor resumes)
``leader``             the node leading now (informational)
``v/n``, ``v/<i>``     verdict batches, numbered; ``v/<i>/acks`` counts the
                       nodes that read batch ``i``: the last live one deletes it
=====================  =====================================================

Every store failure surfaces as :class:`StoreUnreachable`, so the agent can
fall back to detecting within its node.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Protocol

import orjson

Record = dict[str, Any]


class StoreUnreachable(Exception):
    """The job's store refused, timed out or went away."""


class KVStore(Protocol):
    """The part of ``torch.distributed.Store`` this module uses."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def append(self, key: str, value: bytes) -> None: ...
    def delete_key(self, key: str) -> bool: ...


def tcp_store(address: str, timeout_s: float = 2.0) -> KVStore:
    """A client of the TCPStore at ``host:port`` (``[v6]:port``); StoreUnreachable if it is not there."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StoreUnreachable(f"not host:port: {address!r}")
    host = host.strip("[]")
    try:
        from torch.distributed import TCPStore

        return TCPStore(  # type: ignore[return-value]  # takes bytes or str values
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:  # torch raises RuntimeError / DistStoreError / its own timeouts
        raise StoreUnreachable(f"{address}: {e}") from e


class ClusterStore:
    """Named keys of one job in a store, and the bytes moved (``sent``, ``received``)."""

    def __init__(self, store: KVStore, job: str) -> None:
        self.store = store
        self.prefix = f"fsdp-sentinel/{job or 'default'}/"
        self.sent = 0
        self.received = 0

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # any store error means: not reachable now
            raise StoreUnreachable(str(e)) from e

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _set(self, key: str, value: bytes) -> None:
        self._call(self.store.set, self._k(key), value)
        self.sent += len(key) + len(value)

    def _get(self, key: str) -> bytes | None:
        if not self._call(self.store.check, [self._k(key)]):
            return None
        value: bytes = self._call(self.store.get, self._k(key))
        self.received += len(value)
        return value

    def _delete(self, key: str) -> None:
        self._call(self.store.delete_key, self._k(key))

    def _add(self, key: str, n: int) -> int:
        return int(self._call(self.store.add, self._k(key), n))

    # ------------------------------------------------------------ nodes

    def join(self, node: str, lowest_rank: int, rank_records: list[Record]) -> None:
        """Enter the roster (once) and publish the node's ``rank`` records."""
        entry = f"{lowest_rank}:{node};".encode()
        self._call(self.store.append, self._k("roster"), entry)
        self.sent += len(entry)
        self.set_ranks(node, rank_records)

    def set_ranks(self, node: str, rank_records: list[Record]) -> None:
        self._set(f"ranks/{node}", orjson.dumps(rank_records))

    def roster(self) -> list[tuple[int, str]]:
        """``(lowest rank, node)`` of every node that joined, once each."""
        raw = self._get("roster") or b""
        seen: dict[str, int] = {}
        for part in raw.decode(errors="replace").split(";"):
            rank, sep, node = part.partition(":")
            if sep and rank.lstrip("-").isdigit() and node:
                seen[node] = min(int(rank), seen.get(node, int(rank)))
        return sorted((r, n) for n, r in seen.items())

    def rank_records(self, node: str) -> list[Record]:
        raw = self._get(f"ranks/{node}")
        return list(orjson.loads(raw)) if raw else []

    def publish(self, node: str, seq: int, window: bytes) -> None:
        """One window, then the heartbeat that says it is there."""
        self._set(f"w/{node}/{seq}", window)
        self._set(f"hb/{node}", str(seq).encode())

    def heartbeats(self, nodes: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for node in nodes:
            raw = self._get(f"hb/{node}")
            if raw is not None and raw.isdigit():
                out[node] = int(raw)
        return out

    # ------------------------------------------------------------ leader

    def take_windows(self, node: str, upto: int) -> list[bytes]:
        """The windows of ``node`` from the leaders' cursor through ``upto``, each deleted
        once read (a seq missing, published while the store was away, is skipped)."""
        raw = self._get(f"next/{node}")
        start = int(raw) if raw is not None and raw.isdigit() else 0
        out: list[bytes] = []
        for seq in range(start, upto + 1):
            value = self._get(f"w/{node}/{seq}")
            if value is not None:
                out.append(value)
                self._delete(f"w/{node}/{seq}")
        if upto + 1 > start:
            self._set(f"next/{node}", str(upto + 1).encode())
        return out

    def set_leader(self, node: str) -> None:
        self._set("leader", node.encode())

    def leader(self) -> str | None:
        raw = self._get("leader")
        return raw.decode(errors="replace") if raw is not None else None

    def publish_verdicts(self, verdicts: list[Record]) -> int:
        """One batch of verdict records; returns its number."""
        i = self._add("v/n", 1)
        self._set(f"v/{i}", orjson.dumps(verdicts))
        return i

    def read_verdicts(self, after: int, live_nodes: int) -> tuple[int, list[Record]]:
        """Batches numbered past ``after``: ``(newest number read, their verdicts)``.
        Each batch is deleted by the ``live_nodes``-th node to read it. A number
        taken but not yet written (the leader is between its two calls) stops
        the read there, for the next one."""
        newest = self._add("v/n", 0)
        out: list[Record] = []
        for i in range(after + 1, newest + 1):
            raw = self._get(f"v/{i}")
            if raw is None:
                return i - 1, out
            out.extend(orjson.loads(raw))
            if self._add(f"v/{i}/acks", 1) >= live_nodes:
                self._delete(f"v/{i}")
                self._delete(f"v/{i}/acks")
        return newest, out
