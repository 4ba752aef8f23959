"""A GpuSlice whose Pod ownerReference a tenant wrote by hand, on the real control plane.

The tenant holds the built-in ``edit`` role in its namespace (with the chart's user roles, which
kube-controller-manager aggregates into ``edit``) and applies a GpuSlice with ``kubectl apply``,
naming in ``metadata.ownerReferences`` a pod it did not make the slice for: a pod of another
namespace (its real name and UID), a UID that exists nowhere, or a plain running pod of its own
namespace. The controller writes the claim of a slice made for a pod early and reserves it for that
pod, and a reserved claim holds its slice's instance (DESIGN "release of a slice in use"); what a
forged reference reaches is checked from outside: the claims as the API server has them (every
version, through a watch), the GpuNode's instances, the pods, the GpuQuota's usage.

What happens. kube-controller-manager looks an owner up in the dependent's own namespace: a slice
naming another namespace's pod, a UID nobody has, or a name of its namespace under another UID is
deleted by the garbage collector within seconds (for another namespace's pod it may post
OwnerRefInvalidNamespace), often before it is bound, and its claim with it. The controller reserves
a claim only for the gated pod it made the slice for, so none of these claims is ever reserved.
Before that rule it wrote the forged pod's name and UID into ``reservedFor`` with the allocation;
kube-controller-manager's resourceclaim controller, which also looks the pod up by name in the
claim's namespace, took such a reservation away at its next look (no such pod, or another UID), so
nothing outside the namespace was reached. A plain running pod of the same namespace is an owner
that exists: the slice stays, and kube-controller-manager keeps a reservation for that pod while it
runs (it checks neither that the pod names the claim nor that it was gated), so before the rule the
deleted slice kept its instance and quota charge (``Released=False``, ``InUse``) for as long as that
pod lived. These tests fail on that code."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kubernetes
import pytest
import urllib3
import yaml
from harness import GROUP, VERSION, OperatorHarness, SimNode, check_invariants, wait_until
from kubernetes.client.rest import ApiException

# The tenant with `edit` and the pods it runs, as test_release_in_use plays them.
from test_release_in_use import TENANT, create_pod, put_quota, quota_used, running, slice_name  # isort: skip
from test_release_in_use import tenant_namespace, tenant_roles  # noqa: F401 (a fixture)  # isort: skip

# Also run on the oldest supported Kubernetes release (make compat).
pytestmark = pytest.mark.compat

CLAIMS = ("resource.k8s.io", "v1", "resourceclaims")
FREED = {"memory": "0", "slices": 0, "wholeGpus": 0}
# Bounded waits: what the garbage collector, kube-controller-manager and the agent take on a busy
# two-core machine, with room to spare (each usually takes a second or two).
SETTLE_S = 60


def forge(op: OperatorHarness, ns: str, name: str, owner_name: str, owner_uid: str) -> dict:
    """The tenant applies GpuSlice ``ns/name`` whose only ownerReference names pod ``owner_name``
    (UID ``owner_uid``), written as the controller writes its own; returns the slice as created."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice",
            "metadata": {"name": name, "namespace": ns, "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": owner_name, "uid": owner_uid, "controller": True}]},
            "spec": {"memory": "10G"}}
    answer = op.cluster.kubectl("apply", "-f", "-", "-o", "json", f"--as={TENANT}", input=yaml.safe_dump(body),
                                check=False)
    assert answer.returncode == 0, answer.stderr
    made = json.loads(answer.stdout)  # as created: the garbage collector may take it within a second
    assert made["metadata"]["ownerReferences"][0]["uid"] == owner_uid
    return made


def plain_pod(op: OperatorHarness, ns: str, name: str) -> Any:
    """A running pod of ``ns`` that asks for no GPU (no annotation: the webhook leaves it alone)."""
    create_pod(op, ns, name, {})
    return running(op, ns, name)


class ClaimLog:
    """Every version of every ResourceClaim of a namespace, as the API server sends them (a watch)."""

    def __init__(self, op: OperatorHarness, ns: str) -> None:
        self.api = kubernetes.client.CustomObjectsApi(op.cluster.api_client)
        self.ns = ns
        self.seen: list[tuple[str, dict]] = []  # (event type, claim)
        self._watch = kubernetes.watch.Watch()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        version = self.api.list_namespaced_custom_object(*CLAIMS[:2], self.ns, CLAIMS[2])["metadata"][
            "resourceVersion"]
        self._ready.set()
        while not self._stop.is_set():
            try:
                for event in self._watch.stream(self.api.list_namespaced_custom_object, *CLAIMS[:2], self.ns,
                                                CLAIMS[2], resource_version=version, timeout_seconds=5):
                    self.seen.append((event["type"], event["object"]))
                    version = event["object"]["metadata"]["resourceVersion"]
                    if self._stop.is_set():
                        break
            except ApiException as exc:
                if exc.status != 410:
                    raise
                # Compacted away (never within a test's minute): the log would have a gap.
                self.seen.append(("GAP", {}))
                return
            except urllib3.exceptions.HTTPError:
                if self._stop.is_set():
                    return  # ``stop`` closed the stream
                # Otherwise the stream broke: watched again from the last version seen, nothing lost.

    @contextmanager
    def running(self) -> Iterator[ClaimLog]:
        self._thread.start()
        self._ready.wait(10)
        try:
            yield self
        finally:
            self._stop.set()
            self._watch.stop()
            self._thread.join(15)

    def versions(self, name: str) -> list[dict]:
        assert ("GAP", {}) not in self.seen, "the claim watch lost events"
        return [claim for _, claim in self.seen if claim.get("metadata", {}).get("name") == name]

    def reservations(self, name: str) -> list[list[dict]]:
        """Each distinct ``status.reservedFor`` claim ``name`` had, in order (empty ones left out)."""
        found: list[list[dict]] = []
        for claim in self.versions(name):
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            if reserved and reserved not in found:
                found.append(reserved)
        return found


def claim_of(op: OperatorHarness, ns: str, name: str) -> dict | None:
    try:
        return op.custom.get_namespaced_custom_object(*CLAIMS[:2], ns, CLAIMS[2], name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def instances(op: OperatorHarness, node: SimNode) -> list[dict]:
    """The MIG instances the node's GpuNode lists (held by a slice or idle)."""
    return [inst for gpu in (op.gpunode(node) or {}).get("status", {}).get("gpus") or []
            for inst in gpu.get("instances") or []]


def idle_in_kubectl(op: OperatorHarness, node: SimNode) -> tuple[int, int]:
    """``kubectl get gn``'s Instances In Use and Idle Instances columns for the node."""
    header, row = op.cluster.kubectl("get", "gn", node.name).stdout.splitlines()[:2]
    assert header.split()[:9] == ["NAME", "GPUS", "MIG", "GPUS", "INSTANCES", "IN", "USE", "IDLE", "INSTANCES"], header
    cells = row.split()
    return int(cells[3]), int(cells[4])


def wait_released(op: OperatorHarness, node: SimNode, uid: str, in_use: int) -> list[dict]:
    """Until no instance on ``node`` is held by slice ``uid`` and ``kubectl get gn`` counts ``in_use``
    instances in use and every other instance the GPUs have (the simulator's state, from outside) idle;
    the idle instances the GpuNode lists. (A forged slice the garbage collector takes before it is
    bound never gets one.)"""
    idle: list[dict] = []

    def released() -> bool:
        listed = instances(op, node)
        if any(i.get("sliceUID") == uid for i in listed):
            return False
        backend = node.backend()
        made = sum(len(backend.instances(gpu.index)) for gpu in backend.gpus() if gpu.mig_enabled)
        if idle_in_kubectl(op, node) != (in_use, made - in_use):
            return False
        idle[:] = [i for i in listed if not i.get("slice") and not i.get("sliceUID")]
        return True

    wait_until(released, SETTLE_S, lambda: (
        f"slice {uid}'s instance released on {node.name}: {instances(op, node)}\n"
        f"{op.cluster.kubectl('get', 'gn', node.name).stdout}\n{op.logs()}"))
    return idle


def measured_apart(body: dict) -> str:
    """A GpuSlice as JSON without what its agent's usage loop writes on its own (``status.usage``, the
    ``Active`` condition) and without the versions every write moves."""
    meta = {k: v for k, v in body["metadata"].items() if k not in ("resourceVersion", "managedFields")}
    status = {k: v for k, v in (body.get("status") or {}).items() if k != "usage"}
    status["conditions"] = [c for c in status.get("conditions") or () if c.get("type") != "Active"]
    return json.dumps({**body, "metadata": meta, "status": status}, sort_keys=True)


def snapshot(op: OperatorHarness, ns: str) -> dict[tuple[str, str], str]:
    """Every pod, ResourceClaim and Event of ``ns`` with its resourceVersion, and every GpuSlice with what
    anything but its usage loop writes (``measured_apart``)."""
    found = {("pod", p.metadata.name): p.metadata.resource_version for p in op.core.list_namespaced_pod(ns).items}
    group, version, plural = CLAIMS
    for body in op.custom.list_namespaced_custom_object(group, version, ns, plural)["items"]:
        found[(plural, body["metadata"]["name"])] = body["metadata"]["resourceVersion"]
    for body in op.custom.list_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices")["items"]:
        found[("gpuslices", body["metadata"]["name"])] = measured_apart(body)
    for event in op.core.list_namespaced_event(ns).items:
        if event.reason != "Idle":  # the usage loop's own Event, unrelated to the forgery
            found[("event", event.metadata.name)] = event.metadata.resource_version
    return found


def garbage_collected(op: OperatorHarness, ns: str, name: str, uid: str, log: ClaimLog) -> list[list[dict]]:
    """The forged slice is deleted by kube-controller-manager's garbage collector (its owner does not
    exist in ``ns``), and its claim, if it got one, with it; returns the distinct reservations the
    claim had."""
    op.wait_gone(ns, name, timeout=SETTLE_S)

    def claim_gone() -> bool:
        kinds = [kind for kind, body in log.seen if body.get("metadata", {}).get("name") == name]
        return claim_of(op, ns, name) is None and (not kinds or kinds[-1] == "DELETED")

    wait_until(claim_gone, SETTLE_S, f"claim {ns}/{name} to go with its slice")
    versions = log.versions(name)
    # Whatever it had, the claim's last version holds no reservation: nothing held the slice then.
    assert not versions or not (versions[-1].get("status") or {}).get("reservedFor"), versions[-1]
    return log.reservations(name)


@pytest.mark.usefixtures("tenant_roles")
def test_an_owner_reference_to_another_namespaces_pod_reaches_nothing_there(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node, webhook=True)
    team_a, team_b = tenant_namespace(operator), operator.namespace()
    put_quota(operator, team_a, "1Ti", slices=1)
    # team-b's pod runs on its own slice, its claim reserved for it.
    create_pod(operator, team_b, "victim", {"cdmo.io/gpu-memory": "10G"})
    victim = running(operator, team_b, "victim")
    theirs = slice_name(operator, team_b, "victim")
    their_claim = wait_until(lambda: (c := claim_of(operator, team_b, theirs)) and (c.get("status") or {}).get(
        "reservedFor") and c, 30, "team-b's claim reserved")
    their_uid = operator.get_slice(team_b, theirs)["metadata"]["uid"]
    before = snapshot(operator, team_b)

    with ClaimLog(operator, team_a).running() as log:
        forged = forge(operator, team_a, "borrowed", "victim", victim.metadata.uid)
        uid = forged["metadata"]["uid"]
        reservations = garbage_collected(operator, team_a, "borrowed", uid, log)
        wait_released(operator, node, uid, in_use=1)
        wait_until(lambda: quota_used(operator, team_a) == FREED, SETTLE_S,
                   lambda: f"team-a's quota freed: {quota_used(operator, team_a)}")

    # Never reserved for anyone, in any version of its claim: the controller made no slice for
    # team-b's pod.
    assert reservations == [], reservations
    # Nothing in team-b was written: its pod, its slice, its claim and its Events are as they were.
    assert snapshot(operator, team_b) == before
    now = claim_of(operator, team_b, theirs)
    assert now["status"]["reservedFor"] == their_claim["status"]["reservedFor"] == [
        {"resource": "pods", "name": "victim", "uid": victim.metadata.uid}]
    assert now["status"]["allocation"] == their_claim["status"]["allocation"]
    [result] = now["status"]["allocation"]["devices"]["results"]
    assert (result["pool"], result["device"]) == (node.name, their_uid)
    assert running(operator, team_b, "victim", timeout=1).spec.node_name == node.name
    assert [i["sliceUID"] for i in instances(operator, node) if i.get("slice")] == [their_uid]
    check_invariants(operator)


@pytest.mark.usefixtures("tenant_roles")
def test_an_owner_reference_to_a_uid_that_exists_nowhere_holds_nothing(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node, webhook=True)
    ns = tenant_namespace(operator)
    put_quota(operator, ns, "1Ti", slices=1)
    # Two spellings: a pod name nobody has, and the name of a pod that runs here under another UID.
    plain_pod(operator, ns, "neighbour")
    for name, owner in (("ghost", "nobody"), ("twin", "neighbour")):
        with ClaimLog(operator, ns).running() as log:
            forged = forge(operator, ns, name, owner, str(uuid.uuid4()))
            uid = forged["metadata"]["uid"]
            reservations = garbage_collected(operator, ns, name, uid, log)
            wait_released(operator, node, uid, in_use=0)
            wait_until(lambda: quota_used(operator, ns) == FREED, SETTLE_S,
                       lambda: f"the quota freed: {quota_used(operator, ns)}")
        assert reservations == [], (name, reservations)
    assert running(operator, ns, "neighbour", timeout=1).spec.resource_claims is None
    check_invariants(operator)


@pytest.mark.usefixtures("tenant_roles")
def test_an_owner_reference_to_a_plain_pod_of_its_namespace_neither_holds_the_instance_nor_hands_it_on(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node, webhook=True)
    ns = tenant_namespace(operator)
    put_quota(operator, ns, "1Ti", slices=1)
    bystander = plain_pod(operator, ns, "bystander")
    seen = operator.core.read_namespaced_pod("bystander", ns)

    with ClaimLog(operator, ns).running() as log:
        forged = forge(operator, ns, "parasite", "bystander", bystander.metadata.uid)
        uid = forged["metadata"]["uid"]
        ready = operator.wait_phase(ns, "parasite", "Ready", timeout=SETTLE_S)
        device = ready["status"]["deviceUUID"]
        # Its owner exists: the garbage collector keeps it, and its claim is the controller's,
        # allocated to its device and reserved for nobody (the pod does not name it).
        claim = wait_until(lambda: (c := claim_of(operator, ns, "parasite")) and (c.get("status") or {}).get(
            "allocation") and c, SETTLE_S, lambda: f"the claim allocated: {claim_of(operator, ns, 'parasite')}")
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (node.name, uid)
        assert [r["uid"] for r in claim["metadata"]["ownerReferences"]] == [uid]
        # The tenant deletes its slice: the instance is let go, the pod goes on running without it.
        answer = operator.cluster.kubectl("delete", "gs", "parasite", "-n", ns, "--wait=false", f"--as={TENANT}")
        assert answer.returncode == 0, answer.stderr
        operator.wait_gone(ns, "parasite", timeout=SETTLE_S)
        idle = wait_released(operator, node, uid, in_use=0)
        assert [i["deviceUUID"] for i in idle] == [device]
        wait_until(lambda: quota_used(operator, ns) == FREED, SETTLE_S,
                   lambda: f"the quota freed: {quota_used(operator, ns)}")
    assert log.reservations("parasite") == []

    # The pod got nothing: no claim in its spec or its containers, none in its status, not written at all.
    pod = running(operator, ns, "bystander", timeout=1)
    assert pod.metadata.resource_version == seen.metadata.resource_version
    assert pod.spec.resource_claims is None and pod.status.resource_claim_statuses is None
    assert all(c.resources.claims is None for c in pod.spec.containers)
    # The instance is served once: the next slice of the namespace gets it, and nothing else holds it.
    operator.create_slice(ns, "next", {"memory": "10G"})
    after = operator.wait_phase(ns, "next", "Ready", timeout=SETTLE_S)
    assert after["status"]["deviceUUID"] == device
    wait_until(lambda: [i["sliceUID"] for i in instances(operator, node) if i.get("slice")] == [
        after["metadata"]["uid"]], 30, lambda: f"the next slice's instance listed: {instances(operator, node)}")
    check_invariants(operator)
