"""The controller never logs a failed write and drops it: the write raises, its key comes back on the work
queue after its back-off, and the object ends written (a binding, a group's bindings, a GpuQuota's status,
the parts a full read looks at). A conflict reads the slice again before the next try.

The API server is played by a fake that refuses the writes it is told to (HTTP 500 or 409) and otherwise
answers as kube-apiserver does: the object written, a newer resourceVersion."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY

from mig_operator.core.books.quota import QUOTA_NAME
from mig_operator.core.placement.cluster import binding_from_status
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.names import GROUP_ANNOTATION, GROUP_SIZE_ANNOTATION
from mig_operator.kube.common.workqueue import WorkQueue
from mig_operator.kube.controller.binder import Binder, assemble
from mig_operator.kube.controller.observe import inventory, node_record
from mig_operator.kube.controller.quotas import quota_status_path

SLICES = "/apis/cdmo.io/v1alpha1/namespaces/ns/gpuslices"


def _retries(kind: str) -> float:
    return REGISTRY.get_sample_value("mig_operator_workqueue_retries_total",
                                     {"component": "controller", "kind": kind}) or 0.0


async def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in time")


class _Api:
    """Slices and GpuQuotas by path; ``refuse(path)`` answers the next write there with an error."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.refusals: dict[str, list[ApiError]] = {}
        self.calls: list[tuple[str, str]] = []
        self.version = 100

    def refuse(self, path: str, *errors: ApiError) -> None:
        self.refusals.setdefault(path, []).extend(errors)

    def _stored(self, path: str) -> str:
        return path.removesuffix("/status")

    async def get(self, path: str) -> dict:
        self.calls.append(("GET", path))
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        return self.objects[path]

    async def merge_patch(self, path: str, patch: dict) -> dict:
        self.calls.append(("MERGE", path))
        if self.refusals.get(path):
            raise self.refusals[path].pop(0)
        stored = self._stored(path)
        if stored not in self.objects:
            raise ApiError(404, "NotFound", path)
        body = self.objects[stored]
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != body["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        self.version += 1
        meta = {**body["metadata"], "resourceVersion": str(self.version)}
        if not path.endswith("/status") and "finalizers" in (patch.get("metadata") or {}):
            meta["finalizers"] = patch["metadata"]["finalizers"]
        body = {**body, "metadata": meta}
        if "status" in patch:
            body["status"] = patch["status"]
        self.objects[stored] = body
        return body

    def touch(self, path: str) -> None:
        """Another writer changed the object (a label): a newer resourceVersion."""
        self.version += 1
        body = self.objects[path]
        self.objects[path] = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}


class _Events:
    def post(self, obj: Any, kind: str, reason: str, message: str) -> None:
        pass

    def forget(self, uid: str) -> None:
        pass


def _slice(name: str, version: int, group: str | None = None) -> dict:
    annotations = {GROUP_ANNOTATION: group, GROUP_SIZE_ANNOTATION: "2"} if group else {}
    return {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": str(version),
                         "creationTimestamp": "2026-11-27T10:00:00Z", "annotations": annotations},
            "spec": {"memory": "4G"}}


def _binder(api: _Api) -> Binder:
    """The controller's parts on a node with an L4 (fractions) and room for several 4G slices."""
    binder = assemble(api, _Events(), resync_s=3600,  # type: ignore[arg-type]
                      queue=WorkQueue(base_delay_s=0.01, max_delay_s=0.05))
    binder._last_resync = time.monotonic()  # no full list here: the fake answers slice and quota writes only
    gpunode = {"metadata": {"name": "n1"}, "spec": {"nodeName": "n1"}, "status": {
        "gpus": [{"index": 0, "uuid": "GPU-l4", "memoryMiB": 23034}]}}
    binder.ledger.put_inventory(inventory(gpunode))
    binder.ledger.put_node("n1", node_record({"metadata": {"name": "n1", "labels": {}}}))
    return binder


def _bound(api: _Api, name: str) -> bool:
    body = api.objects[f"{SLICES}/{name}"]
    return binding_from_status(body["metadata"]["uid"], body.get("status")) is not None


def test_a_binding_refused_by_the_api_server_is_retried_on_its_key_until_written() -> None:
    api = _Api()
    api.objects[f"{SLICES}/a"] = _slice("a", 7)
    api.refuse(f"{SLICES}/a/status", ApiError(500, "InternalError", "injected"), ApiError(500, "InternalError", "x"))
    before = _retries("slice")

    async def main() -> None:
        binder = _binder(api)
        await binder.slice_event(api.objects[f"{SLICES}/a"], deleted=False)
        await _until(lambda: _bound(api, "a"))
        await _until(lambda: binder.ledger.slices["uid-a"].binding is not None)

    asyncio.run(main())
    assert api.calls.count(("MERGE", f"{SLICES}/a/status")) == 3
    assert _retries("slice") - before == 2


def test_a_binding_refused_as_a_conflict_reads_the_slice_again_and_is_written_on_the_newer_version() -> None:
    api = _Api()
    api.objects[f"{SLICES}/a"] = _slice("a", 7)
    before = _retries("slice")

    async def main() -> None:
        binder = _binder(api)
        api.touch(f"{SLICES}/a")  # changed after the controller saw it: its write names version 7
        await binder.slice_event(_slice("a", 7), deleted=False)
        await _until(lambda: _bound(api, "a"))

    asyncio.run(main())
    merges = [i for i, call in enumerate(api.calls) if call == ("MERGE", f"{SLICES}/a/status")]
    read = api.calls.index(("GET", f"{SLICES}/a"))
    assert len(merges) == 2 and merges[0] < read < merges[1]  # refused (409), read again, written
    assert _retries("slice") - before == 1


def test_a_groups_member_whose_binding_fails_is_bound_when_the_key_comes_back() -> None:
    """Two slices of one group: the second member's write is refused (500). The rest is written, the key
    raises and comes back after its back-off, and binds the member left, on the same node."""
    api = _Api()
    api.objects[f"{SLICES}/g-0"] = _slice("g-0", 7, group="g")
    api.objects[f"{SLICES}/g-1"] = _slice("g-1", 8, group="g")
    api.refuse(f"{SLICES}/g-1/status", ApiError(500, "InternalError", "injected"))
    before = _retries("slice")

    async def main() -> None:
        binder = _binder(api)
        await binder.slice_event(api.objects[f"{SLICES}/g-0"], deleted=False)
        await binder.slice_event(api.objects[f"{SLICES}/g-1"], deleted=False)
        await _until(lambda: _bound(api, "g-0") and _bound(api, "g-1"))

    asyncio.run(main())
    assert _retries("slice") - before == 1
    nodes = {api.objects[f"{SLICES}/g-{i}"]["status"]["node"] for i in (0, 1)}
    assert nodes == {"n1"}


def test_a_quota_status_write_that_fails_is_retried_on_its_key_until_written() -> None:
    api = _Api()
    path = quota_status_path("ns")
    quota = {"metadata": {"namespace": "ns", "name": QUOTA_NAME, "generation": 3, "resourceVersion": "5"},
             "spec": {"memory": "40Gi"}}
    api.objects[path.removesuffix("/status")] = quota
    api.refuse(path, ApiError(500, "InternalError", "injected"), ApiError(503, "ServiceUnavailable", "injected"))
    before = _retries("quota-status")

    async def main() -> None:
        binder = _binder(api)
        binder.quotas.interval_s = 0.0
        binder.quota_event(quota, deleted=False)
        await _until(lambda: "status" in api.objects[path.removesuffix("/status")])

    asyncio.run(main())
    # Written out by hand: no slice held, none waiting, the generation seen.
    assert api.objects[path.removesuffix("/status")]["status"] == {
        "used": {"memory": "0", "slices": 0, "wholeGpus": 0}, "heldWhole": [], "waiting": 0, "observedGeneration": 3}
    assert api.calls.count(("MERGE", path)) == 3
    assert _retries("quota-status") - before == 2


def test_a_full_read_whose_part_fails_looks_at_the_other_parts_and_comes_back_after_its_back_off() -> None:
    class _Lists(_Api):
        async def list_at(self, path: str, *_: Any, **__: Any) -> tuple[list, int]:
            return [], 10

        async def list(self, path: str, *_: Any, **__: Any) -> list:
            return []

    api = _Lists()
    seen: list[str] = []
    before = _retries("resync")

    async def main() -> None:
        binder = _binder(api)

        async def pods_resync() -> None:
            seen.append("pods")
            if seen.count("pods") == 1:
                raise ApiError(500, "InternalError", "injected")

        async def quotas_resync() -> None:
            seen.append("quotas")

        binder.pods.resync = pods_resync  # type: ignore[method-assign]
        binder.quotas.resync = quotas_resync  # type: ignore[method-assign]
        binder.queue.add("resync", binder.resync)
        await _until(lambda: seen.count("pods") == 2 and not binder.queue.pending("resync"))

    asyncio.run(main())
    assert seen == ["quotas", "pods", "quotas", "pods"]  # the quota part is looked at whatever the pods say
    assert _retries("resync") - before == 1


def test_the_periodic_pass_lists_nothing_and_looks_at_every_pod_the_books_hold_again() -> None:
    """The watches are the books' one feed: the pass every ``--resync`` reads nothing from the API server and
    adds the key of every gated pod the books hold (its slices made, or made again where it may go now)."""
    from mig_operator.kube.common.names import POD_SLICE_LABEL, SCHEDULING_GATE
    from mig_operator.kube.controller.observe import pod_record

    class _NoLists(_Api):
        async def list_at(self, path: str, *_: Any, **__: Any) -> tuple[list, int]:
            raise AssertionError(f"the periodic pass listed {path}")

        async def list(self, path: str, *_: Any, **__: Any) -> list:
            raise AssertionError(f"the periodic pass listed {path}")

    api = _NoLists()

    def pod(name: str, gated: bool) -> dict:
        return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": "5",
                             "labels": {POD_SLICE_LABEL: f"{name}-gs"},
                             "annotations": {"cdmo.io/gpu-memory": "4G"}},
                "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}] if gated else [],
                         "containers": [{"name": "main", "image": "busybox"}]},
                "status": {"phase": "Pending"}}

    async def main() -> None:
        binder = _binder(api)
        for name, gated in (("waits", True), ("ungated", False)):
            binder.ledger.put_pod("team", f"{name}-gs", pod_record(pod(name, gated)))
        added: list[Any] = []
        real_add = binder.queue.add
        binder.queue.add = lambda key, work, after_s=0.0: (added.append(key), real_add(key, work, after_s))[1]
        await binder.revisit()
        assert ("pod", "team", "waits-gs") in added
        assert ("pod", "team", "ungated-gs") not in added

    asyncio.run(main())


def test_a_full_read_drops_the_pods_its_list_lacks_but_keeps_those_newer_than_the_list() -> None:
    """A watch that lists again reports no DELETED for a pod that started Running (left the watch) or went
    meanwhile: the full read's list is what the books hold of pods not Running, except a pod seen at a
    version newer than the list's (made or changed while it was read)."""
    from mig_operator.kube.common.names import POD_SLICE_LABEL
    from mig_operator.kube.controller.observe import pod_record

    def pod(name: str, version: int) -> dict:
        return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": str(version),
                             "labels": {POD_SLICE_LABEL: f"{name}-gs"}, "annotations": {"cdmo.io/gpu-memory": "4G"}},
                "spec": {"containers": [{"name": "main", "image": "busybox"}]}, "status": {"phase": "Pending"}}

    class _Pods(_Api):
        async def list_at(self, path: str, *_: Any, **__: Any) -> tuple[list, int]:
            return ([pod("listed", 40)] if path == "/api/v1/pods" else []), 50

    api = _Pods()

    async def main() -> set[tuple[str, str]]:
        binder = _binder(api)
        for name, version in (("listed", 40), ("running", 30), ("newer", 60)):
            binder.ledger.put_pod("team", f"{name}-gs", pod_record(pod(name, version)))
        await binder.pods.resync()
        return {key for key, _ in binder.ledger.pods_held()}

    assert asyncio.run(main()) == {("team", "listed-gs"), ("team", "newer-gs")}
