"""Our writer of the text (0.0.4 / 1.0.0) and OpenMetrics 1.0 expositions.

prometheus-client's ``generate_latest`` formats each sample with several
``format`` calls and, for OpenMetrics without ``escaping=allow-utf-8`` (what
Prometheus 2.x sends), escapes every sample name one character at a time:
12 µs a sample, 70 ms for a 64-rank job. Our families need none of that: every
name is ``[a-zA-Z_][a-zA-Z0-9_]*`` and label values are plain words. So this
writer checks each family once (names, types, no timestamps, exemplars or
native histograms) and writes its samples with one join; anything it does not
handle, a family or a whole escaping scheme, goes to prometheus-client's own
encoder. Its output is prometheus-client's byte for byte
(``tests/test_exporter_encode.py`` checks it over many snapshots).

:func:`fast_encoder` maps the encoder ``choose_encoder`` picked from ``Accept``
to ours, so negotiation stays prometheus-client's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from functools import partial
from operator import itemgetter

from prometheus_client import exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Names prometheus-client writes unchanged under both escapings we handle
#: (no ``:``: its OpenMetrics writer turns one into ``_`` in sample names).
_PLAIN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

#: The escapings under which a plain name is written as it is.
_ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)

#: Types written the same way by both formats, with their text-format name.
_TEXT_TYPE = {
    "counter": "counter",
    "gauge": "gauge",
    "histogram": "histogram",
    "summary": "summary",
    "unknown": "untyped",
}

#: Sample suffixes the text writer moves into families of their own.
_MOVED_SUFFIXES = ("_created", "_gsum", "_gcount")

Encoder = Callable[[Collector], bytes]


def _plain(name: str) -> bool:
    return _PLAIN.fullmatch(name) is not None


def _plain_label(name: str) -> bool:
    return _plain(name) and not name.startswith("__")


class _One:
    """A collector of one family, to hand it to prometheus-client's writer."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self._metric]


class _Values:
    """``floatToGoString`` with a memo: a scrape repeats few distinct values."""

    def __init__(self) -> None:
        self.memo: dict[float, str] = {}

    def __call__(self, v: float) -> str:
        s = self.memo.get(v)
        if s is None:
            if v == 0:  # 0.0 and -0.0 are one key but two strings
                return "-0.0" if math.copysign(1.0, v) < 0 else "0.0"
            s = floatToGoString(v)
            if v == v:  # NaN is never found again; don't store it
                self.memo[v] = s
        return s


class _LabelWriter:
    """Writes a sample line for one key set, its labels sorted by name as
    prometheus-client sorts them.

    Key sets are few (one per family, plus ``le`` for buckets), so the sort and
    the name check are done once a key set; a sample then costs one
    ``itemgetter`` and one ``format``. ``{:s}`` refuses a label value that is
    not a string (prometheus-client fails on one too: we hand it such a family).
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        ordered = sorted(keys)
        self.pairs = len(ordered)
        labels = ",".join(k + '="{:s}"' for k in ordered)
        # name{k1="v1",k2="v2"} value
        self.line = ("{}{{" + labels + "}} {}\n").format
        get = itemgetter(*ordered)
        self.values: Callable[[dict[str, str]], tuple[str, ...]] = (
            get if len(ordered) > 1 else lambda labels: (get(labels),)
        )


#: Key set -> its writer (key sets with a name that is not plain: none).
_WRITERS: dict[tuple[str, ...], _LabelWriter] = {}
_MAX_WRITERS = 4096


def _writer(keys: tuple[str, ...]) -> _LabelWriter | None:
    if not all(_plain_label(k) for k in keys):
        return None
    if len(_WRITERS) >= _MAX_WRITERS:  # bound it if labels ever vary without end
        _WRITERS.clear()
    w = _WRITERS[keys] = _LabelWriter(keys)
    return w


def _samples(metric: Metric, value_str: _Values) -> str | None:
    """The family's sample lines, or None where prometheus-client must write them."""
    lines = []
    names: set[str] = set()
    pairs = 0
    writers = _WRITERS
    known = value_str.memo
    try:
        for name, labels, value, ts, exemplar, native in metric.samples:
            if ts is not None or exemplar is not None or native is not None or value is None:
                return None
            names.add(name)
            v = known.get(value) or value_str(value)
            if labels:
                keys = tuple(labels)
                w = writers.get(keys) or _writer(keys)
                if w is None:
                    return None
                pairs += w.pairs
                lines.append(w.line(name, *w.values(labels), v))
            else:
                lines.append(name + " " + v + "\n")
    except (TypeError, ValueError):  # a value or label we don't write; theirs will say
        return None
    moved = {metric.name + s for s in _MOVED_SUFFIXES}
    if not all(_plain(n) and n not in moved for n in names):
        return None
    body = "".join(lines)
    # Label values needing escapes (\, newline, ") show as extra characters.
    if "\\" in body or body.count("\n") != len(lines) or body.count('"') != 2 * pairs:
        return None
    return body


def _families(
    registry: Collector,
    header: Callable[[Metric], str | None],
    theirs: Callable[[Metric], str],
) -> list[str]:
    out = []
    value_str = _Values()
    for metric in registry.collect():
        head = header(metric) if _plain(metric.name) else None
        body = _samples(metric, value_str) if head is not None else None
        if head is None or body is None:
            out.append(theirs(metric))
        else:
            out.append(head)
            out.append(body)
    return out


def _text_header(metric: Metric) -> str | None:
    mtype = _TEXT_TYPE.get(metric.type)
    if mtype is None:
        return None
    name = metric.name + "_total" if metric.type == "counter" else metric.name
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n"


def _openmetrics_header(metric: Metric) -> str | None:
    if metric.type not in _TEXT_TYPE:
        return None
    name = metric.name
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    head = f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n"
    return head + f"# UNIT {name} {metric.unit}\n" if metric.unit else head


def encode_text(registry: Collector, escaping: str = openmetrics.UNDERSCORES) -> bytes:
    """What ``prometheus_client.generate_latest(registry, escaping)`` returns."""
    if escaping not in _ESCAPINGS:
        return exposition.generate_latest(registry, escaping)

    def theirs(metric: Metric) -> str:
        return exposition.generate_latest(_One(metric), escaping).decode("utf-8")

    return "".join(_families(registry, _text_header, theirs)).encode("utf-8")


def encode_openmetrics(
    registry: Collector, escaping: str = openmetrics.UNDERSCORES, version: str = "1.0.0"
) -> bytes:
    """What prometheus-client's ``openmetrics.exposition.generate_latest`` returns."""
    if escaping not in _ESCAPINGS:
        return openmetrics.generate_latest(registry, escaping, version)  # type: ignore[no-any-return]

    def theirs(metric: Metric) -> str:
        text: str = openmetrics.generate_latest(_One(metric), escaping, version).decode("utf-8")
        return text.removesuffix("# EOF\n")

    return ("".join(_families(registry, _openmetrics_header, theirs)) + "# EOF\n").encode("utf-8")


def fast_encoder(encoder: Encoder) -> Encoder:
    """Ours in place of the encoder ``exposition.choose_encoder`` returned, when
    it is one of prometheus-client's two writers; anything else unchanged."""
    if encoder is exposition.generate_latest:
        return encode_text
    if isinstance(encoder, partial) and not encoder.args:
        if set(encoder.keywords) <= {"escaping"} and encoder.func is exposition.generate_latest:
            return partial(encode_text, **encoder.keywords)
        if set(encoder.keywords) <= {"escaping", "version"} and (
            encoder.func is openmetrics.generate_latest
        ):
            return partial(encode_openmetrics, **encoder.keywords)
    return encoder
