"""Exporters: Prometheus metrics, Grafana dashboards, alert rules."""
