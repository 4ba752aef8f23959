"""Prometheus metrics of the controller and the agents (prometheus-client), served over HTTP.

Names follow Prometheus conventions (``mig_operator_`` prefix, base units, ``_total`` counters).
Each process serves only the metrics of its part; ``serve`` starts the HTTP endpoint, which answers only
callers the API server says may ``get`` the non-resource URL ``/metrics`` (``metrics_auth``).
"""

from __future__ import annotations

import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from .client import load_configuration
from .listen import listen
from .metrics_auth import ApiReviewer, Gate, Reviewer, authorized

# How long, and how much, a closing connection is read on (``_MetricsServer.shutdown_request``).
LINGER_S = 2.0
LINGER_BYTES = 16 << 20
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
SLOTS = Gauge("mig_operator_slots", "Memory slots of a MIG GPU, by state (in_use, idle, free) and GPU model",
              ["node", "gpu", "model", "state"])
# 1 while NVIDIA's device plugin also advertises the node's GPUs and no admin marked it as shared
# (the GpuNode's DevicePluginConflict condition is True): the controller places no new slice there.
DEVICE_PLUGIN_CONFLICT = Gauge("mig_operator_device_plugin_conflict",
                               "1 while a device plugin also hands out the node's GPUs (no new slices there)",
                               ["node"])
# 0 while a GPU's GpuNode condition Healthy is False (a critical Xid, or the GPU lost): no new slice there.
GPU_HEALTHY = Gauge("mig_operator_gpu_healthy", "1 while a GPU is healthy, 0 after a critical Xid or once it is lost",
                    ["node", "gpu"])
NODES_WANTED = Gauge("mig_operator_autoscaling_nodes_wanted",
                     "New nodes of each autoscaling pool the waiting slices need (asked of the node autoscaler)",
                     ["pool"])
PENDING_SLICES = Gauge("mig_operator_pending_slices", "Pending GpuSlices, by reason (NoCapacity, QuotaExceeded, ...)",
                       ["reason"])
QUOTA_USED_BYTES = Gauge("mig_operator_quota_used_bytes",
                         "GPU memory a namespace's slices are charged (a fraction GPU held alone: its whole memory)",
                         ["namespace"])
QUOTA_WHOLE_GPUS = Gauge("mig_operator_quota_whole_gpus",
                         "Fraction GPUs a namespace holds alone, each charged its whole memory", ["namespace"])
QUOTA_HARD_BYTES = Gauge("mig_operator_quota_hard_bytes", "A namespace's GpuQuota spec.memory", ["namespace"])
QUOTA_USED_SLICES = Gauge("mig_operator_quota_used_slices", "Slices a namespace holds", ["namespace"])
QUOTA_WAITING_SLICES = Gauge("mig_operator_quota_waiting_slices", "A namespace's slices Pending for its quota",
                             ["namespace"])
# From the slices' status.usage and Active condition, written by their agents (controller).
IDLE_SLICES = Gauge("mig_operator_idle_slices", "A namespace's Ready slices with condition Active=False (idle)",
                    ["namespace"])
IDLE_MEMORY_BYTES = Gauge("mig_operator_idle_memory_bytes", "GPU memory granted to a namespace's idle slices",
                          ["namespace"])
USED_MEMORY_BYTES = Gauge("mig_operator_used_memory_bytes",
                          "GPU memory a namespace's slices use, as their agents measured it (status.usage.memoryUsed)",
                          ["namespace"])
IDLE_EVICTIONS = Counter("mig_operator_idle_evictions_total",
                         "Pods evicted because every slice of theirs was idle past the GpuQuota's idlePodTimeout, "
                         "and evictions a PodDisruptionBudget refused, by result (evicted, refused)", ["result"])
WORKQUEUE_RETRIES = Counter(
    "mig_operator_workqueue_retries_total", "Work queue keys tried again after their work failed, by part and kind",
    ["component", "kind"],
)
WORKQUEUE_DEPTH = Gauge("mig_operator_workqueue_depth", "Work queue keys due and waiting for a worker, by part",
                        ["component"])
LOOP_RESTARTS = Counter(
    "mig_operator_loop_restarts_total", "Long-lived loops started again after an unexpected error, by part and loop",
    ["component", "loop"],
)
EVENTS_DROPPED = Counter(
    "mig_operator_events_dropped_total", "Kubernetes Events not posted because too many waited, by component",
    ["component"],
)
WATCH_EVENTS = Counter(
    "mig_operator_watch_events_total", "Watch events a part took in, by resource (plural)", ["resource"]
)
# One series per Ready slice on the agent's node, removed when the slice goes (kube/agent/usage.py); ``pod``:
# the pod its ResourceClaim is reserved for, "" while none is.
SLICE_MEMORY_USED = Gauge("mig_operator_slice_memory_used_bytes", "GPU memory a Ready slice's processes use now",
                          ["namespace", "slice", "pod"])
SLICE_MEMORY_PEAK = Gauge("mig_operator_slice_memory_peak_bytes",
                          "The most GPU memory a Ready slice's processes used since it became Ready",
                          ["namespace", "slice", "pod"])
SLICE_PROCESSES = Gauge("mig_operator_slice_processes", "Processes using a Ready slice now",
                        ["namespace", "slice", "pod"])
RECONCILE_ERRORS = Counter(
    "mig_operator_reconcile_errors_total", "Handler runs that ended in an error, by part and kind", ["part", "kind"]
)


class _QuietHandler(WSGIRequestHandler):
    # A caller that connects and then says nothing holds a thread only this long.
    timeout = 30

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """A scrape every few seconds is not worth a line each."""


class _MetricsServer(ThreadingWSGIServer):
    """Serves on a socket bound beforehand (``listen``), so it neither binds nor shares a port itself."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.getsockname()[:2], _QuietHandler, bind_and_activate=False)
        self.socket.close()  # the one the base class made; ours is already bound and listening
        self.socket = sock
        self.address_family = sock.family
        self.server_address = sock.getsockname()[:2]
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def shutdown_request(self, request: socket.socket) -> None:
        """Close after reading, for a moment, what the caller still sends: a caller refused before its
        request was read whole (a header over the 64 KiB a line may hold: 431) then gets the refusal,
        not a reset of a connection closed with its bytes unread."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(LINGER_S)
            drained, deadline = 0, time.monotonic() + LINGER_S
            while drained < LINGER_BYTES and time.monotonic() < deadline:
                chunk = request.recv(1 << 16)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:  # the caller went away first: nothing is left to read
            pass
        self.close_request(request)


def bind(address: str) -> socket.socket:
    """The metrics socket, bound and listening; a port in use or an address not of this host raises
    ListenError (one line at start, before kopf runs)."""
    return listen("--metrics-address", address, ":9090")


def serve(where: str | socket.socket, kubeconfig: str | None,
          reviewer: Reviewer | None = None) -> ThreadingWSGIServer:
    """Serve /metrics on a socket from ``bind`` (or on ``HOST:PORT``, ``:9090`` for every interface) in a
    background thread, to callers the API server (reached with ``kubeconfig``'s credentials, as the part's
    own calls are) allows; ``reviewer`` asks it instead (tests)."""
    gate = Gate(reviewer if reviewer is not None else ApiReviewer(load_configuration(kubeconfig)))
    sock = bind(where) if isinstance(where, str) else where
    server = _MetricsServer(sock)
    server.set_app(authorized(make_wsgi_app(), gate))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
