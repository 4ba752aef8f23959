"""How long kube-scheduler takes to bind a pod whose claim is already allocated, with and without a DRA
binding condition on the allocated device, by when the condition turns True.

    .venv/bin/python bench/binding_conditions.py [--tries 3] [--json out.json]

The local control plane (scripts/control-plane: kube-apiserver, kube-scheduler, kwok; started for this
run unless MIG_OPERATOR_RUN names a running one) and one kwok node. Each try makes a ResourceClaim of a
stand-in DeviceClass, allocates it as the operator's controller allocates a slice's claim (one device
of the node's pool, pinned to the node, reserved for nobody), and creates a pod that names it; the
time is from just before the pod's create call to the moment a read of the pod shows spec.nodeName
(polled every 20 ms). Cases:

- ``none``: the allocation carries no binding condition (the gate path's claim);
- ``true-before``: it carries one, set True before the pod is created;
- ``true-after-S``: it carries one, set True S seconds after the pod's create call.

Binding conditions are served from Kubernetes 1.36 (DRADeviceBindingConditions, beta); on an older
plane the API server drops them and every case measures as ``none``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_scale import Plane  # noqa: E402

GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER = "standin.example.com"
READY, FAILED = f"{DRIVER}/ready", f"{DRIVER}/failed"
NODE = "kwok-bindcond-0"
CASES = (("none", None), ("true-before", -1.0), ("true-after-0", 0.0), ("true-after-0.3", 0.3),
         ("true-after-1", 1.0))
GIVE_UP_S = 30.0


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Bench:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.ns = "bindcond-" + uuid.uuid4().hex[:6]

    def setup(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.ns}})
        node = {"metadata": {"name": NODE, "annotations": {"kwok.x-k8s.io/node": "fake"}},
                "status": {"allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110"},
                           "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"}}}
        self._create(lambda: self.core.create_node(node))
        self._create(lambda: self.custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "DeviceClass", "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}))
        deadline = time.monotonic() + 30
        while not any(c.type == "Ready" and c.status == "True"
                      for c in (self.core.read_node(NODE).status.conditions or [])):
            if time.monotonic() > deadline:
                raise RuntimeError(f"kwok never made node {NODE} Ready")
            time.sleep(0.2)

    @staticmethod
    def _create(call: Any) -> None:
        try:
            call()
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise

    def _set_ready(self, claim: str) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, "resourceclaims", claim, {
            "status": {"devices": [{"driver": DRIVER, "pool": NODE, "device": "d0", "conditions": [
                {"type": READY, "status": "True", "reason": "Ready", "message": "", "lastTransitionTime": _utc()}]}]}})

    def one(self, name: str, ready_after: float | None) -> float | None:
        """Seconds from the pod's create call to its binding; None when not bound within GIVE_UP_S."""
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, "resourceclaims", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}})
        result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "d0"}
        if ready_after is not None:
            result.update(bindingConditions=[READY], bindingFailureConditions=[FAILED])
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, "resourceclaims", name, {
            "status": {"allocation": {"devices": {"results": [result]}, "allocationTimestamp": _utc(),
                                      "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                                          {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}})
        pending = ready_after is not None
        if ready_after is not None and ready_after < 0:
            self._set_ready(name)
            pending = False
        started = time.monotonic()
        self.core.create_namespaced_pod(self.ns, {"metadata": {"name": name}, "spec": {
            "tolerations": [{"operator": "Exists"}], "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "c", "image": "standin", "resources": {"claims": [{"name": "gpu"}]}}]}})
        while (elapsed := time.monotonic() - started) < GIVE_UP_S:
            if pending and ready_after is not None and elapsed >= ready_after:
                self._set_ready(name)
                pending = False
            if self.core.read_namespaced_pod(name, self.ns).spec.node_name:
                return elapsed
            time.sleep(0.02)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.tries < 1:
        parser.error(f"--tries must be at least 1, not {args.tries} (e.g. --tries 3)")
    plane = Plane("scheduler,kwok")
    try:
        version = kubernetes.client.VersionApi(plane.api).get_code().git_version
        bench = Bench(plane.api)
        bench.setup()
        rows = []
        for try_no in range(args.tries):
            for case, ready_after in CASES:
                bound = bench.one(f"{case.replace('.', '-')}-{try_no}", ready_after)
                rows.append({"case": case, "try": try_no, "bound_after_s": bound})
                print(json.dumps(rows[-1]), flush=True)
        summary = {case: sorted(r["bound_after_s"] if r["bound_after_s"] is not None else float("inf")
                                for r in rows if r["case"] == case) for case, _ in CASES}
        report = {"when": _utc(), "kubernetes": version, "tries": args.tries, "rows": rows,
                  "bound_after_s_by_case": summary}
        print(json.dumps({"kubernetes": version, "bound_after_s_by_case": summary}, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        plane.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
