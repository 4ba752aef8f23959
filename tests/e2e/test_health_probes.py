"""The parts' health probes against a real API server, as the kubelet asks them (``--health-address``):
each part answers /healthz from its start, and /readyz once it can work: the agent once it has adopted
its GPUs' instances, the controller once its first full read is done, the webhook once it serves."""

from __future__ import annotations

import socket

from harness import wait_until
from probe_http import probe_get


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_every_part_is_live_and_becomes_ready_once_it_can_work(operator) -> None:
    node = operator.add_node("h100-80gb")
    ports = {"agent": _free_port(), "controller": _free_port(), "webhook": _free_port()}
    operator.agent(node, None, "--health-address", f"127.0.0.1:{ports['agent']}")
    operator.controller(None, "--health-address", f"127.0.0.1:{ports['controller']}")
    operator.webhook(None, "--health-address", f"127.0.0.1:{ports['webhook']}")
    for part, port in ports.items():
        wait_until(lambda port=port: probe_get(port, "/readyz") == (200, "ok"), 60,
                   lambda part=part, port=port: f"{part} ready: {probe_get(port, '/readyz')}\n{operator.logs()}")
        assert probe_get(port, "/healthz") == (200, "ok"), (part, operator.logs())
    # Ready means working: the agent's GpuNode is published and a slice is bound and made Ready.
    operator.wait_gpunode(node)
    namespace = operator.namespace()
    operator.create_slice(namespace, "probe", {"memory": "10G"})
    operator.wait_phase(namespace, "probe", "Ready", 60)
