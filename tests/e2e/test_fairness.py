"""No namespace starves another: while one namespace floods the controller with slices that stay
Pending (a profile no GPU here has), another namespace's single slice is Ready within twice its time
on the idle plane, measured in the same test first (the median of a few).

The flood's size is configurable: MIG_OPERATOR_FLOOD_SLICES (default 400).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import OperatorHarness, wait_until

FLOOD = int(os.environ.get("MIG_OPERATOR_FLOOD_SLICES", "400"))


def _time_to_ready(operator: OperatorHarness, namespace: str, name: str) -> float:
    """Seconds from just before the create call to the slice seen Ready (polled every 20 ms)."""
    started = time.monotonic()
    operator.create_slice(namespace, name, {"memory": "5Gi"})
    wait_until(lambda: ((operator.get_slice(namespace, name) or {}).get("status") or {}).get("phase") == "Ready",
               60, lambda: f"{namespace}/{name} Ready\n{operator.logs()}", interval=0.02)
    return time.monotonic() - started


def test_a_flood_in_one_namespace_delays_another_namespaces_slice_at_most_twice(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    operator.start_operator(node)
    quiet = operator.namespace()
    idle = [_time_to_ready(operator, quiet, f"idle-{i}") for i in range(3)]
    idle_s = statistics.median(idle)

    flood = operator.namespace()
    made = 0
    stop = threading.Event()

    def make(i: int) -> None:
        nonlocal made
        if not stop.is_set():
            # 7g.141gb is an H200 profile: no GPU here takes it, so each slice stays Pending (NoCapacity).
            operator.create_slice(flood, f"f{i:04d}", {"migProfile": "7g.141gb"})
            made += 1

    pool = ThreadPoolExecutor(4)
    try:
        futures = [pool.submit(make, i) for i in range(FLOOD)]
        wait_until(lambda: made >= FLOOD // 3, 120, "a third of the flood made")
        made_before = made
        during_s = _time_to_ready(operator, quiet, "during")
    finally:
        stop.set()
        for future in futures:
            future.result()
        pool.shutdown()
    assert made_before < FLOOD, "the flood was made before the other namespace's slice"
    assert any((s.get("status") or {}).get("phase") == "Pending" for s in operator.slices(flood))
    assert during_s <= 2 * idle_s, (f"Ready in {during_s:.2f} s during the flood, {idle_s:.2f} s idle ({idle}); "
                                    f"{made_before} of the flood made when it was asked for\n{operator.logs()}")
