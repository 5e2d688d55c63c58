"""A snapshot made safe to export, whatever reached the pipeline.

The strict decoder (``trace.decode`` / ``trace.bad_field``) refuses lone
surrogates, control characters, overlong strings and non-finite numbers
before they reach the pipeline, but the pipeline also computes: a span of
``end - start`` can overflow to ``inf``, a sum of bytes can outgrow a float,
a probe or a future record kind can bring a value the schema never saw.
Once such a value sat in the snapshot, every ``/metrics`` scrape (a label
that is not UTF-8, an int too large for a float) or ``/api/v1/snapshot``
(``inf`` is not JSON) answered 500 from then on. So the exporter checks
again, at the last step, with no trust in what came before:

- a string (label value, dict key) loses control characters and lone
  surrogates (each becomes U+FFFD) and is cut at :data:`MAX_LABEL_CHARS`;
- a float that is not finite becomes ``None`` where the field may be
  ``None`` (no sample is written), else ``0.0``; an int is held to what a
  64-bit counter holds;
- a dict keyed by label values (records by kind, bytes by op, errors by
  counter name...) keeps at most :data:`MAX_LABEL_VALUES` keys: the rest,
  added up, are written as ``other``, so no input can make the series
  grow without bound.

:func:`sanitize` returns the very snapshot it was given when nothing needed
a change (the usual case), so a clean scrape pays one walk and no copies.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, TypeVar

#: Characters a label value may not keep: C0 and C1 controls, DEL, lone surrogates.
_BAD_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

#: The longest label value written (the schema caps a host at 255 bytes; a
#: label value past this is noise to a dashboard and cost to Prometheus).
MAX_LABEL_CHARS = 128

#: Keys a label-keyed dict keeps; past it the rest are folded into ``other``.
MAX_LABEL_VALUES = 64

OTHER = "other"

_INT_MAX = (1 << 63) - 1

T = TypeVar("T")


def label(value: str) -> str:
    """``value`` as a label value that encodes as UTF-8 and has no controls."""
    if len(value) <= MAX_LABEL_CHARS and _BAD_CHARS.search(value) is None:
        return value
    return _BAD_CHARS.sub("\ufffd", value[:MAX_LABEL_CHARS])


def _number(value: float, optional: bool) -> float | None:
    if math.isfinite(value):
        return value
    return None if optional else 0.0


def _clean(value: Any, optional: bool = False) -> Any:
    kind = type(value)
    if kind is float:
        return _number(value, optional)
    if kind is int:
        return value if -_INT_MAX <= value <= _INT_MAX else max(-_INT_MAX, min(_INT_MAX, value))
    if kind is str:
        return label(value)
    if value is None or kind is bool:
        return value
    if kind is tuple or kind is list:
        if _plain_numbers(value):
            return value
        items = [_clean(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    if kind is dict:
        return _clean_dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _clean_view(value)
    return value


def _plain_numbers(values: Any) -> bool:
    """Whether every item is an int or float that needs no change (one pass
    in C: a NaN or an infinity makes the sum non-finite, an int past 64 bits
    fails the bounds)."""
    if not values:
        return True
    if not set(map(type, values)) <= _NUMBERS:
        return False
    try:
        return math.isfinite(sum(values)) and max(values) <= _INT_MAX and min(values) >= -_INT_MAX
    except OverflowError:
        return False


def _plain_dict(d: dict[Any, Any]) -> bool:
    if len(d) > MAX_LABEL_VALUES:
        return False
    keys = "".join(d) if set(map(type, d)) <= {str} else None
    if keys is None or _BAD_CHARS.search(keys) is not None:
        return False
    if max(map(len, d), default=0) > MAX_LABEL_CHARS:
        return False
    values = d.values()
    return _plain_numbers(values) or all(type(v) is tuple and _plain_numbers(v) for v in values)


_NUMBERS = {int, float}


def _clean_dict(d: dict[Any, Any]) -> dict[Any, Any]:
    if _plain_dict(d):
        return d
    items = [(_clean(k), _clean(v)) for k, v in d.items()]
    changed = any(a is not k or b is not v for (a, b), (k, v) in zip(items, d.items(), strict=True))
    if len(items) > MAX_LABEL_VALUES:
        return _fold(items)
    if not changed and len(set(k for k, _ in items)) == len(items):
        return d
    out: dict[Any, Any] = {}
    for k, v in items:  # two keys that became one after cleaning: added up
        out[k] = _add(out[k], v) if k in out else v
    return out


def _fold(items: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """The first ``MAX_LABEL_VALUES - 1`` keys by name kept, the rest added up
    as ``other`` (by name, so the kept set does not flip between scrapes)."""
    items.sort(key=lambda kv: str(kv[0]))
    out: dict[Any, Any] = {}
    for k, v in items:
        key = k if (k in out or len(out) < MAX_LABEL_VALUES - 1) and k != OTHER else OTHER
        out[key] = _add(out[key], v) if key in out else v
    return out


def _add(a: Any, b: Any) -> Any:
    if type(a) in (int, float) and type(b) in (int, float):
        return _clean(a + b)
    if type(a) is tuple and type(b) is tuple and len(a) == len(b):
        return tuple(_clean(x + y) for x, y in zip(a, b, strict=True))
    return a  # values that do not add up (a nested dict): the first kept


def _optional_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = tuple((f.name, f.default is None) for f in dataclasses.fields(cls))
    return found


_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _clean_view(view: T) -> T:
    changes = {}
    for name, optional in _optional_fields(type(view)):
        old = getattr(view, name)
        new = _clean(old, optional)
        if new is not old:
            changes[name] = new
    return dataclasses.replace(view, **changes) if changes else view  # type: ignore[type-var]


def sanitize(snap: T) -> T:
    """``snap`` (a :class:`~fsdp_sentinel.snapshot.Snapshot`) with every string,
    number and label-keyed dict made safe to export (see the module docstring);
    the same object when nothing needed a change."""
    return _clean_view(snap)


#: Ranks exported one by one. Past it (one daemon serving thousands of ranks,
#: or a flood of bogus ``rank`` records) every rank costs ~34 series and ~3 kB
#: of ``/metrics`` (4,096 ranks: 12 MB, 0.4 s a scrape), so the ranks with an
#: open verdict and then the lowest (by job, rank) are kept and the rest added
#: up as rank ``other``. A node daemon watches a node's few ranks: far below.
MAX_RANK_SERIES = 256

#: The ``rank`` (and ``peer_rank``) of the view that stands for the folded ranks.
FOLDED_RANK = -1


def fold_ranks(snap: Any, max_ranks: int = MAX_RANK_SERIES) -> tuple[Any, int]:
    """``snap`` with at most ``max_ranks`` rank views (the last one the folded
    ranks' sums, rank :data:`FOLDED_RANK`, job and host ``other``; their peer
    and NCCL views summed alike), and how many ranks were folded."""
    ranks = snap.ranks
    if len(ranks) <= max_ranks:
        return snap, 0
    by_need = sorted(ranks, key=lambda r: (r.state == "ok", r.job, r.rank))
    kept = sorted(by_need[: max_ranks - 1], key=lambda r: (r.job, r.rank))
    rest = by_need[max_ranks - 1 :]
    keep = {(r.job, r.rank) for r in kept}
    bare = {r.rank for r in kept}  # a bare pipeline's peer and NCCL views name no job

    def kept_view(job: str, rank: Any) -> bool:
        return (job, rank) in keep or (not job and rank in bare)

    folded = dataclasses.replace(
        rest[0],
        rank=FOLDED_RANK, host=OTHER, job=OTHER, pid=None, step=None, step_seconds=None,
        compute_seconds=None, wait_seconds=None, tx_rate=None, rx_rate=None, srtt_us=None,
        state="ok", cause=None, score=None, cost=None, scope=None, peer_rank=None,
        steps_total=sum(r.steps_total for r in rest),
        step_seconds_total=sum(r.step_seconds_total for r in rest),
        wait_seconds_total=sum(r.wait_seconds_total for r in rest),
        tx_bytes_total=sum(r.tx_bytes_total for r in rest),
        rx_bytes_total=sum(r.rx_bytes_total for r in rest),
        retrans_total=sum(r.retrans_total for r in rest),
        retrans_spurious_total=sum(r.retrans_spurious_total for r in rest),
        step_buckets=_sum_buckets(r.step_buckets for r in rest),
        coll_count_total=_sum_dicts(r.coll_count_total for r in rest),
        coll_bytes_total=_sum_dicts(r.coll_bytes_total for r in rest),
        coll_seconds_total=_sum_dicts(r.coll_seconds_total for r in rest),
        coll_wait_buckets=_sum_dicts(r.coll_wait_buckets for r in rest),
    )  # fmt: skip
    peers: list[Any] = []
    gone: list[Any] = []
    for p in snap.peers:
        (peers if kept_view(p.job, p.rank) else gone).append(p)
    if gone:
        peers.append(dataclasses.replace(
            gone[0], rank=FOLDED_RANK, peer_rank=FOLDED_RANK, job=OTHER, srtt_us=None,
            tx_bytes_total=sum(p.tx_bytes_total for p in gone),
            rx_bytes_total=sum(p.rx_bytes_total for p in gone),
            retrans_total=sum(p.retrans_total for p in gone),
            retrans_spurious_total=sum(p.retrans_spurious_total for p in gone),
        ))  # fmt: skip
    nccl = [n for n in snap.nccl if n.rank is None or kept_view(n.job, n.rank)]
    by_op: dict[str, Any] = {}
    for n in snap.nccl:
        if n.rank is not None and not kept_view(n.job, n.rank):
            old = by_op.get(n.op)
            by_op[n.op] = dataclasses.replace(
                n, rank=FOLDED_RANK, host=OTHER, job=OTHER,
                calls_total=n.calls_total + (old.calls_total if old else 0),
                bytes_total=n.bytes_total + (old.bytes_total if old else 0),
            )  # fmt: skip
    nccl.extend(by_op[op] for op in sorted(by_op))
    out = dataclasses.replace(snap, ranks=(*kept, folded), peers=tuple(peers), nccl=tuple(nccl))
    return out, len(rest)


def _sum_buckets(rows: Any) -> tuple[int, ...]:
    """Bucket counts added up (a rank without a histogram yet adds nothing)."""
    total: list[int] = []
    for row in rows:
        if not row:
            continue
        if not total:
            total = [0] * len(row)
        if len(row) == len(total):
            total = [a + b for a, b in zip(total, row, strict=True)]
    return tuple(total)


def _sum_dicts(dicts: Any) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if k not in out:
                out[k] = v
            elif type(v) is tuple:
                out[k] = _sum_buckets((out[k], v))
            else:
                out[k] = _add(out[k], v)
    return out
