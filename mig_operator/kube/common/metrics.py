"""Prometheus metrics of the controller and the agents (prometheus-client), served over HTTP.

Names follow Prometheus conventions (``mig_operator_`` prefix, base units, ``_total`` counters).
Each process serves only the metrics of its part; ``serve`` starts the HTTP endpoint.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

SLICES = Gauge("mig_operator_slices", "GpuSlices the controller knows, by phase and mode", ["phase", "mode"])
BIND_SECONDS = Histogram(
    "mig_operator_bind_seconds", "From a slice event to its binding written (controller)", buckets=_LATENCY_BUCKETS
)
BINDS = Counter("mig_operator_binds_total", "Slices bound, by mode", ["mode"])
REALISE_SECONDS = Histogram(
    "mig_operator_realise_seconds", "From a bound slice's event to Ready written (agent), by action",
    ["action"], buckets=_LATENCY_BUCKETS,
)
NVML_SECONDS = Histogram(
    "mig_operator_nvml_call_seconds", "Latency of GPU backend calls, by call", ["call"], buckets=_LATENCY_BUCKETS
)
NVML_ERRORS = Counter(
    "mig_operator_nvml_errors_total", "Failed GPU backend calls, by call and NVML error", ["call", "error"]
)
INSTANCES = Gauge("mig_operator_instances", "MIG instances on a GPU, by state (in_use, idle)", ["node", "gpu", "state"])
GRANTED_BYTES = Gauge("mig_operator_granted_bytes", "Memory granted to slices on a GPU", ["node", "gpu"])
RECONCILE_ERRORS = Counter(
    "mig_operator_reconcile_errors_total", "Handler runs that ended in an error, by part and kind", ["part", "kind"]
)


def serve(address: str) -> None:
    """Serve /metrics on ``HOST:PORT`` (``:9090`` for every interface) in a background thread."""
    host, _, port = address.rpartition(":")
    start_http_server(int(port), addr=host or "0.0.0.0")
