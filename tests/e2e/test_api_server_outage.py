"""kube-apiserver stopped and started again (as in every control-plane upgrade) while slices are made: the
controller (with its webhook) and the agent keep running through the refused connections and the 503s of
a starting API server, and resume on their own. Within 30 s of the API server answering again, every
slice made before and after the outage is Ready and an annotated pod made after it is ungated; it runs
within 30 s of the later of that return and a plain pod's start (kube-scheduler's and kwok's own
back-off after an outage is theirs, not the operator's).

The outages last 30 s and 120 s (MIG_OPERATOR_OUTAGES_S, comma-separated, changes them).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from cluster import REPO_ROOT
from harness import OperatorHarness, wait_until
from test_pods import create_pod, running

OUTAGES_S = [float(s) for s in os.environ.get("MIG_OPERATOR_OUTAGES_S", "30,120").split(",") if s.strip()]
BACK_WITHIN_S = 30.0
# kube-scheduler and kwok back-off on their own after an outage: a plain pod may wait this long.
PLANE_BACK_S = 180.0
SLICES_EACH_SIDE = 3


def _plane(operator: OperatorHarness, *args: str) -> None:
    """scripts/control-plane on the session's plane (its state dir holds the kubeconfig)."""
    env = {**os.environ, "MIG_OPERATOR_RUN": str(operator.cluster.kubeconfig.parent)}
    done = subprocess.run([str(REPO_ROOT / "scripts" / "control-plane"), *args], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, f"control-plane {' '.join(args)}: {done.stdout}\n{done.stderr}"


def _left(since: float) -> float:
    return max(1.0, BACK_WITHIN_S - (time.monotonic() - since))


def _not_ready(operator: OperatorHarness, ns: str, names: list[str]) -> list[str]:
    phases = {s["metadata"]["name"]: (s.get("status") or {}).get("phase") for s in operator.slices(ns)}
    return [f"{n}: {phases.get(n)}" for n in names if phases.get(n) != "Ready"]


@pytest.mark.parametrize("outage_s", OUTAGES_S, ids=lambda s: f"{s:g}s")
def test_the_operator_resumes_on_its_own_after_kube_apiserver_was_away(operator: OperatorHarness,
                                                                       outage_s: float) -> None:
    node = operator.add_node("h100-80gb", count=2)
    operator.start_operator(node, webhook=True)
    ns = operator.namespace()
    names = [f"before-{i}" for i in range(SLICES_EACH_SIDE)]
    for name in names:
        operator.create_slice(ns, name, {"memory": "5Gi"})
    operator.api_server_restarted = True
    _plane(operator, "stop", "kube-apiserver")
    try:
        time.sleep(outage_s)  # the outage itself: nothing to poll while the API server is away
    finally:
        _plane(operator, "start", "kube-apiserver")  # waits for /readyz
    back = time.monotonic()
    after = [f"after-{i}" for i in range(SLICES_EACH_SIDE)]
    for name in after:
        operator.create_slice(ns, name, {"memory": "5Gi"})
    operator.wait_webhook()
    pod: dict[str, Any] = create_pod(operator, ns, {"cdmo.io/gpu-memory": "5Gi"})
    # A plain pod beside it: how long kube-scheduler and kwok themselves take to come back, which no
    # operator can beat.
    plain: dict[str, Any] = create_pod(operator, ns, None)
    wait_until(lambda: not _not_ready(operator, ns, names + after), _left(back), lambda: (
        f"every slice Ready within {BACK_WITHIN_S:g} s of the API server's return: "
        f"{_not_ready(operator, ns, names + after)}\n{operator.logs()}"), interval=0.5)
    wait_until(lambda: not operator.core.read_namespaced_pod(pod["metadata"]["name"], ns).spec.scheduling_gates,
               _left(back), lambda: f"the annotated pod ungated\n{operator.logs()}", interval=0.5)
    running(operator, ns, plain["metadata"]["name"], timeout=PLANE_BACK_S)
    plain_running = time.monotonic()
    running(operator, ns, pod["metadata"]["name"], timeout=_left(max(back, plain_running)))
    for proc in operator.procs:
        assert proc.alive, f"{proc.name} ended during the outage:\n{proc.tail()}"
        text = proc.log.read_text(errors="replace")
        assert "has failed" not in text, f"{proc.name} let a watcher fail:\n{proc.tail()}"
