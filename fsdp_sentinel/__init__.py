"""fsdp-sentinel: find the rank, NIC or link that holds an FSDP job back.

Layers, lowest first (a lower layer never imports a higher one):
``trace`` (format v1) -> ``emit``/``hooks``/``trainer`` and ``probes`` (sources
of records) -> ``correlate`` -> ``detect`` -> ``pipeline`` -> ``daemon``,
``exporters``, ``report``, ``live``, ``lab``, ``demo``, ``cli``.
See docs/architecture.md.
"""

__version__ = "0.1.0"
