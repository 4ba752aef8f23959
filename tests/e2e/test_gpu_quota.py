"""GpuQuota end to end: a real kube-apiserver with the CRD's CEL rules, the controller and simulated
agents as processes. Expected grants come from the catalog's numbers (an H200 1g.18gb holds 16384 MiB),
not from the code under test."""

from __future__ import annotations

import time
from typing import Any

import kubernetes
import pytest
import yaml
from harness import GROUP, VERSION, OperatorHarness, wait_until
from kubernetes.client.rest import ApiException
from tenants import forbidden, grant, impersonating, user_roles

from mig_operator.core.placement.tenancy import SHARING_LABEL, SHARING_VALUE

MIB = 2**20
GIB = 2**30
QUOTAS = "gpuquotas"
H200_1G = 16384 * MIB  # what a 1g.18gb grants (catalog), e.g. for a 10G request
BOUND = ("Bound", "Creating", "Ready")


def verdict(op: OperatorHarness, ns: str, name: str, text: str) -> dict:
    """The slice's status once the controller judged it by the quota as it is now (the message names
    ``text``), or once it no longer waits: the check that follows is made once."""
    def judged() -> dict | None:
        st = (op.get_slice(ns, name) or {}).get("status") or {}
        return st if text in st.get("message", "") or st.get("phase") != "Pending" else None

    return wait_until(judged, 30, lambda: f"{ns}/{name} judged by the quota ({text!r}): {op.get_slice(ns, name)}"
                      f"\n{op.logs()}")


def put_quota(op: OperatorHarness, ns: str, memory: str, slices: int | None = None, name: str = "quota") -> dict:
    spec: dict[str, Any] = {"memory": memory}
    if slices is not None:
        spec["slices"] = slices
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": name}, "spec": spec}
    try:
        return op.custom.create_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, body)
    except ApiException as exc:
        if exc.status != 409:
            raise
    return op.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, name,
                                                    {"spec": {"memory": memory, "slices": slices}})


def quota_status(op: OperatorHarness, ns: str) -> dict:
    return op.custom.get_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota").get("status") or {}


def wait_quota_status(op: OperatorHarness, ns: str, memory: int, slices: int, waiting: int, whole: int = 0) -> dict:
    wanted = {"memory": str(memory), "slices": slices, "wholeGpus": whole}
    return wait_until(
        lambda: (st := quota_status(op, ns)).get("used") == wanted and st.get("waiting") == waiting and st,
        20, lambda: f"GpuQuota {ns}/quota status used={wanted} waiting={waiting}: {quota_status(op, ns)}\n{op.logs()}")


def phase(op: OperatorHarness, ns: str, name: str) -> str | None:
    return ((op.get_slice(ns, name) or {}).get("status") or {}).get("phase")


def wait_quota_crd(op: OperatorHarness) -> None:
    wait_until(lambda: op.cluster.kubectl("get", "gq", "-A", check=False).returncode == 0, 60, "gpuquotas to be served")


@pytest.mark.compat
def test_one_quota_per_namespace_and_its_spec_is_checked_at_admission(operator: OperatorHarness) -> None:
    wait_quota_crd(operator)
    ns = operator.namespace()
    put_quota(operator, ns, "40Gi", 4)
    second = yaml.safe_dump({"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuQuota",
                             "metadata": {"name": "team-b", "namespace": ns}, "spec": {"memory": "8Gi"}})
    refused = operator.cluster.kubectl("apply", "-f", "-", input=second, check=False)
    assert refused.returncode != 0
    assert "GpuQuota name 'team-b' is not allowed" in refused.stderr and "'quota'" in refused.stderr
    for memory, words in (("40X", "unknown unit"), ("0", "greater than zero"), ("1.5", "whole number of bytes")):
        bad = yaml.safe_dump({"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuQuota",
                              "metadata": {"name": "quota", "namespace": ns}, "spec": {"memory": memory}})
        answer = operator.cluster.kubectl("apply", "-f", "-", input=bad, check=False)
        assert answer.returncode != 0, answer.stdout
        assert f"memory '{memory}'" in answer.stderr and words in answer.stderr, answer.stderr
    negative = yaml.safe_dump({"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuQuota",
                               "metadata": {"name": "quota", "namespace": ns}, "spec": {"memory": "8Gi", "slices": -1}})
    assert operator.cluster.kubectl("apply", "-f", "-", input=negative, check=False).returncode != 0
    # The one that exists is unchanged, and kubectl shows used and hard side by side.
    shown = operator.cluster.kubectl("get", "gq", "-n", ns).stdout.splitlines()
    assert shown[0].split()[:7] == ["NAME", "MEMORY-USED", "MEMORY-HARD", "SLICES-USED", "SLICES-HARD", "WHOLE-GPUS",
                                    "WAITING"]
    assert shown[1].split()[0] == "quota" and "40Gi" in shown[1].split() and "4" in shown[1].split()


def test_direct_slices_refused_at_the_quota_bound_on_release_raise_and_lower(operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node)
    wait_quota_crd(operator)
    ns = operator.namespace()
    put_quota(operator, ns, "32Gi")  # exactly two 1g.18gb grants
    for name in ("s1", "s2"):
        operator.create_slice(ns, name, {"memory": "10G"})  # granted 1g.18gb: counts 16384 MiB, not 10G
        assert operator.wait_phase(ns, name, "Ready")["status"]["grantedBytes"] == H200_1G
    operator.create_slice(ns, "s3", {"memory": "10G"})
    st = operator.wait_phase(ns, "s3", "Pending", reason="QuotaExceeded")["status"]
    assert f"GpuQuota {ns}/quota" in st["message"]
    assert "holds 32Gi of its 32Gi" in st["message"] and "would add 16Gi" in st["message"], st["message"]
    wait_quota_status(operator, ns, 2 * H200_1G, 2, 1)
    shown = operator.cluster.kubectl("get", "gq", "-n", ns, "--no-headers").stdout.split()
    assert shown[1:4] == [str(2 * H200_1G), "32Gi", "2"], shown

    # Release: s3 is bound as soon as s1 is gone, no restart.
    operator.delete_slice(ns, "s1")
    operator.wait_phase(ns, "s3", "Ready")
    wait_quota_status(operator, ns, 2 * H200_1G, 2, 0)

    # Raise: a waiting slice binds when the quota grows, to the byte.
    operator.create_slice(ns, "s4", {"memory": "10G"})
    operator.wait_phase(ns, "s4", "Pending", reason="QuotaExceeded")
    put_quota(operator, ns, f"{3 * H200_1G - 1}")  # one byte short of a third grant: still waits
    st = verdict(operator, ns, "s4", f"of its {3 * H200_1G - 1} GPU memory")
    assert (st.get("phase"), st.get("reason")) == ("Pending", "QuotaExceeded"), st
    put_quota(operator, ns, f"{3 * H200_1G}")
    operator.wait_phase(ns, "s4", "Ready")
    wait_quota_status(operator, ns, 3 * H200_1G, 3, 0)

    # Lower below what is held: nothing is taken away, new slices wait.
    put_quota(operator, ns, "16Gi")
    operator.create_slice(ns, "s5", {"memory": "10G"})
    st = operator.wait_phase(ns, "s5", "Pending", reason="QuotaExceeded")["status"]
    assert "holds 48Gi of its 16Gi" in st["message"], st["message"]
    assert [phase(operator, ns, n) for n in ("s2", "s3", "s4")] == ["Ready"] * 3
    final = wait_quota_status(operator, ns, 3 * H200_1G, 3, 1)
    quota = operator.custom.get_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota")
    assert final["observedGeneration"] == quota["metadata"]["generation"]

    # The slice count limit, and another namespace without a quota is not limited by this one.
    put_quota(operator, ns, "1Ti", slices=3)
    st = verdict(operator, ns, "s5", "3 of its 3 slices")
    assert (st.get("phase"), st.get("reason")) == ("Pending", "QuotaExceeded"), st
    other = operator.namespace()
    operator.create_slice(other, "free", {"memory": "10G"})
    operator.wait_phase(other, "free", "Ready")
    operator.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota")
    operator.wait_phase(ns, "s5", "Ready")  # no quota: no limit


def test_a_pod_refused_by_the_quota_gets_an_event_naming_it_and_runs_once_room_frees(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node, webhook=True)
    wait_quota_crd(operator)
    ns = operator.namespace()
    put_quota(operator, ns, "16Gi")
    toleration = {"key": "kwok.x-k8s.io/node", "operator": "Exists"}

    def pod(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "annotations": {"cdmo.io/gpu-memory": "10G"}},
                "spec": {"tolerations": [toleration], "containers": [{"name": "main", "image": "busybox"}]}}

    def running(name: str) -> Any:
        return wait_until(lambda: (p := operator.core.read_namespaced_pod(name, ns)).status.phase == "Running" and p,
                          60, lambda: f"pod {name} Running\n{operator.logs()}")

    operator.core.create_namespaced_pod(ns, pod("first"))
    running("first")
    operator.core.create_namespaced_pod(ns, pod("second"))

    def quota_event() -> Any:
        events = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=second").items
        return [e for e in events if e.reason == "QuotaExceeded" and f"GpuQuota {ns}/quota" in e.message]

    wait_until(quota_event, 30, lambda: f"a QuotaExceeded Event on pod second\n{operator.logs()}")
    second = operator.core.read_namespaced_pod("second", ns)
    assert [g.name for g in second.spec.scheduling_gates or []] == ["cdmo.io/gpu-slice"]
    operator.core.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    running("second")


def test_fair_order_b_gets_its_10_before_a_gets_its_41st(operator: OperatorHarness) -> None:
    # Room for 40: ten L4s (no MIG), four 0.25 fractions each, shared across namespaces (the order is
    # what is tested here, not the tenancy of a fraction GPU: test_placement_rules.py has that).
    node = operator.add_node("l4-24gb", count=10, labelled=False, labels={SHARING_LABEL: SHARING_VALUE})
    operator.start_operator(node)
    team_a, team_b = operator.namespace(), operator.namespace()
    a_names = [f"a-{i:03d}" for i in range(100)]
    for name in a_names:
        operator.create_slice(team_a, name, {"fraction": 0.25})

    def bound(ns: str) -> list[str]:
        return sorted(s["metadata"]["name"] for s in operator.slices(ns)
                      if (s.get("status") or {}).get("phase") in BOUND)

    wait_until(lambda: len(bound(team_a)) == 40, 90, lambda: f"40 of A's slices bound: {len(bound(team_a))}")
    b_names = [f"b-{i:02d}" for i in range(10)]
    for name in b_names:
        operator.create_slice(team_b, name, {"fraction": 0.25})
    for name in b_names:
        operator.wait_phase(team_b, name, "Pending", reason="NoCapacity")
    held_by_a = bound(team_a)
    assert len(held_by_a) == 40
    # Ten of A's slices finish: their room goes to B, which holds nothing, not to A's 41st.
    for name in held_by_a[:10]:
        operator.delete_slice(team_a, name)
    wait_until(lambda: len(bound(team_b)) == 10, 60,
               lambda: f"B's 10 bound: B {bound(team_b)}, A {len(bound(team_a))}\n{operator.logs()}")
    assert len(bound(team_a)) == 30, "no slice of A was bound before B's ten"
    # Then A's next (its oldest waiting) gets the next room.
    operator.delete_slice(team_b, b_names[0])
    wait_until(lambda: len(bound(team_a)) == 31, 60, lambda: f"A's 41st bound: {len(bound(team_a))}")
    waiting_a = sorted(set(a_names) - set(held_by_a))
    assert waiting_a[0] in bound(team_a), "A's oldest waiting slice went first"
    # The metrics' view of the line: every slice Pending says why.
    left = [s for s in operator.slices(team_a) if (s.get("status") or {}).get("phase") == "Pending"]
    assert len(left) == 59 and all(s["status"].get("reason") for s in left)


H200_2G = 33280 * MIB  # 2g.35gb (catalog)


def held_namespace(op: OperatorHarness) -> str:
    """A namespace holding two 1g.18gb (32Gi) of its 64Gi quota, whose 2g.35gb (32.5Gi more: past the
    quota) waits, with a 10G (16Gi more: it would fit) made after it."""
    node = op.add_node("h200-141gb")
    op.start_operator(node)
    wait_quota_crd(op)
    ns = op.namespace()
    put_quota(op, ns, "64Gi")
    for name in ("s1", "s2"):
        op.create_slice(ns, name, {"memory": "10G"})
        op.wait_phase(ns, name, "Ready")
    op.create_slice(ns, "big", {"migProfile": "2g.35gb"})
    op.wait_phase(ns, "big", "Pending", reason="QuotaExceeded")
    op.create_slice(ns, "small", {"memory": "10G"})
    st = op.wait_phase(ns, "small", "Pending", reason="QuotaExceeded")["status"]
    assert f"waits behind {ns}/big" in st["message"], st["message"]
    return ns


def test_a_large_waiting_request_gets_the_room_its_namespace_frees_first(operator: OperatorHarness) -> None:
    ns = held_namespace(operator)  # the verdict that could have let the small one through: "waits behind"
    assert phase(operator, ns, "small") == "Pending", "the smaller, younger slice waits behind the large one"
    operator.delete_slice(ns, "s1")  # 16Gi held now: room for the large one (32.5Gi), which goes first
    operator.wait_phase(ns, "big", "Ready")
    st = operator.wait_phase(ns, "small", "Pending", reason="QuotaExceeded")["status"]
    # 16Gi + 32.5Gi held: the small one's 16Gi would make 64.5Gi, past 64Gi.
    held = f"{16384 + 33280}Mi"
    wait_until(lambda: f"holds {held} of its 64Gi" in ((operator.get_slice(ns, "small") or {}).get("status") or {})
               .get("message", ""), 20, lambda: f"small's own refusal: {operator.get_slice(ns, 'small')['status']}")
    wait_quota_status(operator, ns, H200_1G + H200_2G, 2, 1)
    assert st["reason"] == "QuotaExceeded"


def test_the_hold_ends_sixty_seconds_after_the_large_request_began_waiting(operator: OperatorHarness) -> None:
    ns = held_namespace(operator)
    big = operator.get_slice(ns, "big")
    began = time.mktime(time.strptime(big["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    small = operator.wait_phase(ns, "small", "Ready", timeout=90)["status"]
    bound = time.mktime(time.strptime(small["phaseTimes"]["Bound"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    # The hold's bound: 60 s of the large slice's waiting (the creation time has whole seconds), then
    # the small one is served around it, within a pass.
    assert began + 59 <= bound <= began + 75, (big["metadata"]["creationTimestamp"], small["phaseTimes"])
    assert phase(operator, ns, "big") == "Pending"
    wait_quota_status(operator, ns, 3 * H200_1G, 3, 1)


def test_deleting_the_waiting_slice_serves_those_behind_it_at_once(operator: OperatorHarness) -> None:
    ns = held_namespace(operator)
    big = operator.get_slice(ns, "big")
    began = time.mktime(time.strptime(big["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    operator.delete_slice(ns, "big")
    small = operator.wait_phase(ns, "small", "Ready", timeout=45)["status"]
    bound = time.mktime(time.strptime(small["phaseTimes"]["Bound"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    # Not at the hold's end (60 s after big began waiting): when big went.
    assert bound < began + 59, (big["metadata"]["creationTimestamp"], small["phaseTimes"])
    wait_quota_status(operator, ns, 3 * H200_1G, 3, 0)


def test_quota_metrics_follow_use_hard_and_waiting(operator: OperatorHarness) -> None:
    from test_metrics import free_port, scrape, value

    node = operator.add_node("h200-141gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    port = free_port()
    operator.controller(None, "--metrics-address", f"127.0.0.1:{port}")
    wait_quota_crd(operator)
    limited, free = operator.namespace(), operator.namespace()
    put_quota(operator, limited, "32Gi")
    for name in ("m1", "m2", "m3"):
        operator.create_slice(limited, name, {"memory": "10G"})
    operator.create_slice(free, "f1", {"migProfile": "2g.35gb"})
    operator.wait_phase(limited, "m3", "Pending", reason="QuotaExceeded")
    operator.wait_phase(free, "f1", "Ready")
    expected = {
        ("mig_operator_quota_used_bytes", limited): 2 * H200_1G,
        ("mig_operator_quota_hard_bytes", limited): 32 * GIB,
        ("mig_operator_quota_used_slices", limited): 2,
        ("mig_operator_quota_waiting_slices", limited): 1,
        ("mig_operator_quota_used_bytes", free): H200_2G,
        ("mig_operator_quota_used_slices", free): 1,
        ("mig_operator_quota_hard_bytes", free): None,  # no quota: no hard, no waiting
        ("mig_operator_quota_waiting_slices", free): None,
    }
    seen: list[dict] = [{}]

    def matches() -> bool:
        samples = scrape(port)[1]
        seen[0] = {key: value(samples, key[0], namespace=key[1]) for key in expected}
        seen[0]["pending"] = value(samples, "mig_operator_pending_slices", reason="QuotaExceeded")
        return seen[0] == {**expected, "pending": 1}

    wait_until(matches, 20, lambda: f"quota metrics {expected}: {seen[0]}\n{operator.logs()}")
    operator.delete_slice(limited, "m1")
    operator.wait_phase(limited, "m3", "Ready")
    expected[("mig_operator_quota_waiting_slices", limited)] = 0

    def released() -> bool:
        samples = scrape(port)[1]
        seen[0] = {key: value(samples, key[0], namespace=key[1]) for key in expected}
        return seen[0] == expected and not value(samples, "mig_operator_pending_slices", reason="QuotaExceeded")

    wait_until(released, 20, lambda: f"quota metrics after a release {expected}: {seen[0]}")


def test_view_edit_and_admin_read_quotas_and_only_cluster_admin_writes_them(operator: OperatorHarness) -> None:
    """Each user, holding only the built-in role in the namespace, tries the writes: the quota and any
    slice's status are refused by RBAC, the editor's GpuSlice is made."""
    wait_quota_crd(operator)
    ns = operator.namespace()
    put_quota(operator, ns, "40Gi")
    operator.create_slice(ns, "theirs", {"memory": "1Gi"})
    user_roles(operator.cluster)
    apis = {}
    for user, role in {"viewer": "view", "editor": "edit", "owner": "admin"}.items():
        grant(operator.cluster, ns, user, role)
        apis[user] = kubernetes.client.CustomObjectsApi(impersonating(operator.cluster, user))

    def listed(api: Any) -> bool:
        try:
            return bool(api.list_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS)["items"])
        except ApiException as exc:
            if exc.status == 403:
                return False
            raise

    # kube-controller-manager aggregates the chart's roles into view, edit and admin.
    wait_until(lambda: all(listed(api) for api in apis.values()), 30,
               "the chart's user roles aggregated into view, edit and admin")
    quota = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": "quota"},
             "spec": {"memory": "1Ti"}}
    for api in apis.values():
        assert api.get_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota")["spec"]["memory"] == "40Gi"
        forbidden(lambda a=api: a.create_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, quota))
        forbidden(lambda a=api: a.patch_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota",
                                                                 {"spec": {"memory": "1Ti"}}))
        forbidden(lambda a=api: a.replace_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota", quota))
        forbidden(lambda a=api: a.delete_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, "quota"))
        forbidden(lambda a=api: a.delete_collection_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS))
        forbidden(lambda a=api: a.patch_namespaced_custom_object_status(GROUP, VERSION, ns, QUOTAS, "quota", {
            "status": {"used": {"memory": "0", "slices": 0}}}))
        # Nor any slice's status: status.node is what hands a slice to a node's agent (its field
        # selector), and the binding in the status says which GPU and placement it gets.
        assert api.get_namespaced_custom_object_status(GROUP, VERSION, ns, "gpuslices", "theirs")
        forbidden(lambda a=api: a.patch_namespaced_custom_object_status(GROUP, VERSION, ns, "gpuslices", "theirs", {
            "status": {"phase": "Bound", "node": "anywhere", "gpu": 0, "mode": "fraction"}}))
    assert put_quota(operator, ns, "40Gi")["spec"]["memory"] == "40Gi"  # unchanged
    # The edit role still writes its GpuSlices: the quota is what it cannot raise.
    slice_body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "mine"},
                  "spec": {"memory": "1Gi"}}
    made = apis["editor"].create_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices", slice_body)
    assert made["metadata"]["name"] == "mine"
    slice_body["metadata"]["name"] = "viewers"
    forbidden(lambda: apis["viewer"].create_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices", slice_body))
