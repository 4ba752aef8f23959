"""Idle pods evicted by their namespace's GpuQuota (kube/controller/idle_pods.py), against hand-made slices:
which pods are evicted and when, the eviction's body, the Events, a PodDisruptionBudget's refusal, and the
per-namespace gauges of idle and used memory. The API server is a fake that records the calls."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from mig_operator.core.books.ledger import Ledger
from mig_operator.core.requests.durations import SPEC_DURATION_PATTERN
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.names import GROUP_ANNOTATION, GROUP_SIZE_ANNOTATION
from mig_operator.kube.common.workqueue import Requeue, WorkQueue
from mig_operator.kube.controller.idle_pods import IdlePods, idle_pod_timeout
from mig_operator.kube.controller.observe import slice_record

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
GI = 2**30
HOUR = 3600.0
_VERSIONS = itertools.count(5)  # each slice body a newer version than the last


def _time(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _active(idle_since: datetime | None) -> dict:
    """An Active condition as the agent writes it: False since ``idle_since``, else True."""
    if idle_since is None:
        return {"type": "Active", "status": "True", "reason": "Running", "lastTransitionTime": _time(NOW),
                "message": "1 process using the slice"}
    return {"type": "Active", "status": "False", "reason": "NoProcess", "lastTransitionTime": _time(idle_since),
            "message": "no process"}


def _slice(name: str, pod: str | None, idle_since: datetime | None | str = "absent", *, namespace: str = "ns",
           granted: int = 4 * GI, used: int | None = None, group: str | None = None, size: int = 1,
           pod_uid: str | None = None, deleting: bool = False) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                            "resourceVersion": str(next(_VERSIONS)), "creationTimestamp": "2026-11-29T06:00:00Z"}
    if pod is not None:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": pod_uid or f"uid-{pod}"}]
    if group is not None:
        meta["annotations"] = {GROUP_ANNOTATION: group, GROUP_SIZE_ANNOTATION: str(size)}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T11:59:00Z"
    conditions = [{"type": "Ready", "status": "True", "reason": "Ready", "lastTransitionTime": "2026-11-29T06:00:00Z"}]
    if idle_since != "absent":
        assert not isinstance(idle_since, str)
        conditions.append(_active(idle_since))
    status: dict[str, Any] = {"phase": "Ready", "node": "n1", "gpu": 0, "mode": "fraction", "grantedBytes": granted,
                              "conditions": conditions}
    if used is not None:
        status["usage"] = {"memoryUsed": used, "memoryPeak": used, "processes": 0, "observedAt": _time(NOW)}
    return {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": meta, "spec": {"memory": "4Gi"},
            "status": status}


def _pod(name: str, namespace: str = "ns", uid: str | None = None, claims: tuple[str, ...] = (),
         **meta: Any) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}", **meta},
            "spec": {"resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]},
            "status": {"phase": "Running"}}


class _Api:
    """Pods by path; evictions recorded; ``refuse`` answers the next evictions with errors."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.evictions: list[tuple[str, dict]] = []
        self.refusals: list[ApiError] = []

    def add(self, pod: dict) -> None:
        self.pods[f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"] = pod

    async def get(self, path: str) -> dict:
        if path not in self.pods:
            raise ApiError(404, "NotFound", path)
        return self.pods[path]

    async def request(self, method: str, path: str, body: Any = None, retry: bool = True, **_: Any) -> dict:
        assert method == "POST" and path.endswith("/eviction") and not retry
        if self.refusals:
            raise self.refusals.pop(0)
        self.evictions.append((path, body))
        return {}


class _Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str, str, str]] = []

    def post(self, obj: Mapping, kind: str, reason: str, message: str) -> None:
        self.posted.append((obj["kind"], obj["metadata"]["name"], kind, reason, message))


class _Setup:
    """The controller's idle part on its own ledger and queue (paused: each test runs reconcile itself), on
    an event loop of its own that each step runs on."""

    def __init__(self, timeout: str | None = "2h", quota: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.api = _Api()
        self.events = _Events()
        self.ledger = Ledger()
        self.queue = WorkQueue(base_delay_s=0.01, max_delay_s=0.05)
        self.queue.pause()  # the tests call reconcile themselves
        self.now = NOW
        self.idle = IdlePods(self.api, self.events, self.ledger, self.queue,  # type: ignore[arg-type]
                             clock=lambda: self.now)
        if quota:
            spec: dict[str, Any] = {"memory": "80Gi"}
            if timeout is not None:
                spec["idlePodTimeout"] = timeout
            self.quota({"metadata": {"name": "quota", "namespace": "ns", "generation": 1}, "spec": spec})

    def _on_loop(self, step: Callable[[], Any]) -> Any:
        async def call() -> Any:
            result = step()
            return await result if asyncio.iscoroutine(result) else result

        return self.loop.run_until_complete(call())

    def quota(self, body: dict, deleted: bool = False) -> None:
        if deleted:
            self.ledger.remove_quota(body)
        else:
            self.ledger.put_quota(body)
        self._on_loop(lambda: self.idle.quota_event(body, deleted))

    def put(self, body: dict) -> None:
        info = self.ledger.put_slice(slice_record(body))
        self._on_loop(lambda: self.idle.slice_event(info, body, False))

    def remove(self, body: dict) -> None:
        self.ledger.remove_slice(body["metadata"]["uid"])
        self._on_loop(lambda: self.idle.slice_event(None, body, True))

    def reconcile(self, pod: str, namespace: str = "ns") -> Requeue | None:
        return self._on_loop(lambda: self.idle.reconcile(namespace, pod))

    def taken(self, key: tuple[str, ...]) -> bool:
        """Whether ``key`` waited on the queue; it is taken off, as if it ran."""
        return self.queue._wanted.pop(key, None) is not None


def _evicted(setup: _Setup) -> list[str]:
    return [path.split("/")[-2] for path, _ in setup.api.evictions]


# ---- the quota's field -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [("2h", 7200.0), ("30m", 1800.0), ("1.5h", 5400.0), ("2s", 2.0),
                                               ("1d", 86400.0), ("500ms", 0.5)])
def test_the_timeout_is_read_in_seconds(text: str, seconds: float) -> None:
    assert idle_pod_timeout({"memory": "1Gi", "idlePodTimeout": text}) == (seconds, "")


def test_the_crd_takes_what_the_controller_reads() -> None:
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "gpuquota.yaml").read_text())
    field = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "idlePodTimeout"]
    assert field["type"] == "string" and field["maxLength"] == 32
    assert field["pattern"] == SPEC_DURATION_PATTERN


def test_no_field_means_no_timeout() -> None:
    assert idle_pod_timeout({"memory": "1Gi"}) == (None, "")
    assert idle_pod_timeout(None) == (None, "")


@pytest.mark.parametrize("value", ["1h30m", "2", "٢h", "h", "-2h", "0s", "2y", " 2h", "2H", 7200, True, ["2h"],
                                   "9" * 40 + "h", "366d"])
def test_a_value_the_crd_would_refuse_is_ignored_with_a_reason(value: object) -> None:
    timeout, why = idle_pod_timeout({"memory": "1Gi", "idlePodTimeout": value})
    assert timeout is None and "idlePodTimeout" in why and len(why) < 300


# ---- who is evicted, and when ------------------------------------------------------------------------------


def test_a_pod_idle_past_the_timeout_is_evicted_with_its_uid_as_precondition() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3)))
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    [(path, body)] = setup.api.evictions
    assert path == "/api/v1/namespaces/ns/pods/p1/eviction"
    assert body == {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p1", "namespace": "ns"},
                    "deleteOptions": {"preconditions": {"uid": "uid-p1"}}}
    reasons = {(kind, name, typ, reason) for kind, name, typ, reason, _ in setup.events.posted}
    assert reasons == {("Pod", "p1", "Normal", "IdleEvicted"), ("GpuSlice", "s1", "Normal", "IdleEvicted")}
    pod_message = next(m for k, _, _, _, m in setup.events.posted if k == "Pod")
    assert "s1" in pod_message and "3h" in pod_message and "2h" in pod_message


def test_a_pod_not_yet_idle_long_enough_comes_back_when_it_will_have_been() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(minutes=90)))
    setup.api.add(_pod("p1"))
    again = setup.reconcile("p1")
    assert isinstance(again, Requeue) and again.after_s == pytest.approx(30 * 60, abs=0.5)
    assert setup.api.evictions == [] and setup.events.posted == []
    setup.now = NOW + timedelta(minutes=30)
    assert setup.reconcile("p1") is None
    assert _evicted(setup) == ["p1"]


def test_the_pods_idle_time_starts_when_its_last_slice_went_idle() -> None:
    setup = _Setup("2h")
    group = {"group": "p1", "size": 2}
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=5), **group))  # type: ignore[arg-type]
    setup.put(_slice("s2", "p1", NOW - timedelta(hours=1), **group))  # type: ignore[arg-type]
    setup.api.add(_pod("p1"))
    again = setup.reconcile("p1")
    assert isinstance(again, Requeue) and again.after_s == pytest.approx(HOUR, abs=0.5)
    assert setup.api.evictions == []


def test_a_pod_with_one_slice_in_use_is_kept() -> None:
    setup = _Setup("2h")
    group = {"group": "p1", "size": 2}
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=5), **group))  # type: ignore[arg-type]
    setup.put(_slice("s2", "p1", None, **group))  # type: ignore[arg-type]
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == []


def test_a_group_not_wholly_known_is_kept() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=5), group="p1", size=2))
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == []


def test_a_slice_without_an_active_condition_is_not_idle() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1"))
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == []


def test_another_slice_the_pod_names_in_use_keeps_it() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=5)))
    setup.put(_slice("notebook", None, None))  # made directly, in use
    setup.api.add(_pod("p1", claims=("s1", "notebook")))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == []
    setup.taken(("idle", "ns", "p1"))
    setup.put(_slice("notebook", None, NOW - timedelta(hours=2, minutes=30)))  # idle too, long enough
    assert setup.taken(("idle", "ns", "p1"))  # its change adds the key of the pod that names it
    assert setup.reconcile("p1") is None
    assert _evicted(setup) == ["p1"]
    slices_told = {name for kind, name, _, reason, _ in setup.events.posted if kind == "GpuSlice"}
    assert slices_told == {"s1", "notebook"}


@pytest.mark.parametrize("quota", ["none", "no field", "deleted"])
def test_no_quota_or_no_field_evicts_nothing(quota: str) -> None:
    setup = _Setup(timeout=None if quota == "no field" else "2h", quota=quota != "none")
    if quota == "deleted":
        setup.quota({"metadata": {"name": "quota", "namespace": "ns"}}, deleted=True)
    setup.put(_slice("s1", "p1", NOW - timedelta(days=3)))
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == [] and setup.events.posted == []


def test_another_namespaces_timeout_does_not_apply() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(days=3), namespace="other"))
    setup.api.add(_pod("p1", namespace="other"))
    assert setup.reconcile("p1", "other") is None
    assert setup.api.evictions == []


@pytest.mark.parametrize("pod", [
    _pod("p1", uid="uid-new"),  # made again under the name
    _pod("p1", deletionTimestamp="2026-11-29T11:00:00Z"),  # going already
    None,  # gone
])
def test_a_pod_made_again_going_or_gone_is_not_evicted(pod: dict | None) -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3)))
    if pod is not None:
        setup.api.add(pod)
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == [] and setup.events.posted == []


def test_a_pods_slices_being_deleted_are_left_to_go() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3), deleting=True))
    setup.api.add(_pod("p1"))
    assert setup.reconcile("p1") is None
    assert setup.api.evictions == []


# ---- the answers ----------------------------------------------------------------------------------------


def _refused_count() -> float:
    return REGISTRY.get_sample_value("mig_operator_idle_evictions_total", {"result": "refused"}) or 0.0


def test_a_disruption_budgets_refusal_raises_and_is_told_once() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3)))
    setup.api.add(_pod("p1"))
    budget = "Cannot evict pod as it would violate the pod's disruption budget."
    setup.api.refusals = [ApiError(429, "TooManyRequests", budget), ApiError(429, "TooManyRequests", budget)]
    before = _refused_count()
    for _ in range(2):
        with pytest.raises(ApiError):  # the key comes back after its back-off
            setup.reconcile("p1")
    [(kind, name, typ, reason, message)] = setup.events.posted
    assert (kind, name, typ, reason) == ("Pod", "p1", "Warning", "IdleEvictionRefused")
    assert budget in message
    assert _refused_count() == before + 1
    assert setup.reconcile("p1") is None  # the budget allows it now
    assert _evicted(setup) == ["p1"]


@pytest.mark.parametrize("status", [404, 409])
def test_a_pod_gone_or_replaced_at_the_eviction_is_done(status: int) -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3)))
    setup.api.add(_pod("p1"))
    setup.api.refusals = [ApiError(status, "x", "gone")]
    assert setup.reconcile("p1") is None
    assert setup.events.posted == []


def test_another_failure_raises() -> None:
    setup = _Setup("2h")
    setup.put(_slice("s1", "p1", NOW - timedelta(hours=3)))
    setup.api.add(_pod("p1"))
    setup.api.refusals = [ApiError(500, "InternalError", "etcd")]
    with pytest.raises(ApiError):
        setup.reconcile("p1")
    assert setup.events.posted == []


# ---- which events add a pod's key --------------------------------------------------------------------------


def test_a_slices_active_condition_change_and_a_quota_change_add_the_pods_key() -> None:
    setup = _Setup(timeout=None)
    key = ("idle", "ns", "p1")
    setup.put(_slice("s1", "p1", None))
    assert setup.taken(key)
    setup.put(_slice("s1", "p1", None, used=GI))  # usage changed, the condition did not
    assert not setup.taken(key)
    setup.put(_slice("s1", "p1", NOW))  # Active turned False
    assert setup.taken(key)
    setup.quota({"metadata": {"name": "quota", "namespace": "ns", "generation": 2},
                 "spec": {"memory": "80Gi", "idlePodTimeout": "1h"}})
    assert setup.taken(key)
    setup.quota({"metadata": {"name": "quota", "namespace": "ns", "generation": 3},
                 "spec": {"memory": "90Gi", "idlePodTimeout": "1h"}})  # the timeout did not change
    assert not setup.taken(key)
    setup.quota({"metadata": {"name": "quota", "namespace": "other", "generation": 1},
                 "spec": {"memory": "80Gi", "idlePodTimeout": "1h"}})
    assert not setup.taken(key)
    setup.put(_slice("direct", None, NOW))  # made directly: no pod of its own
    assert not [k for k in setup.queue._wanted if k[0] == "idle"]


# ---- the gauges ---------------------------------------------------------------------------------------------


def _gauge(name: str, namespace: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": namespace})


def test_the_gauges_count_idle_slices_their_memory_and_what_slices_use_per_namespace() -> None:
    setup = _Setup()
    setup.put(_slice("a", "p1", NOW - timedelta(hours=1), namespace="g-one", granted=4 * GI, used=GI))
    setup.put(_slice("b", "p2", None, namespace="g-one", granted=8 * GI, used=3 * GI))
    setup.put(_slice("c", None, NOW, namespace="g-one", granted=2 * GI))
    setup.put(_slice("d", "p3", None, namespace="g-two", granted=GI, used=GI // 2))
    setup.idle.publish()
    assert _gauge("mig_operator_idle_slices", "g-one") == 2  # a and c
    assert _gauge("mig_operator_idle_memory_bytes", "g-one") == 6 * GI
    assert _gauge("mig_operator_used_memory_bytes", "g-one") == 4 * GI
    assert _gauge("mig_operator_idle_slices", "g-two") == 0
    assert _gauge("mig_operator_idle_memory_bytes", "g-two") == 0
    assert _gauge("mig_operator_used_memory_bytes", "g-two") == GI // 2
    setup.remove(_slice("d", "p3", namespace="g-two"))
    setup.idle.publish()
    assert _gauge("mig_operator_used_memory_bytes", "g-two") is None  # the namespace has no slice left
    assert _gauge("mig_operator_idle_slices", "g-two") is None
    assert _gauge("mig_operator_idle_slices", "g-one") == 2
