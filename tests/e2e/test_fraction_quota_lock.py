"""A tenant cannot lock every fraction GPU with a small quota: a GPU its namespace holds alone (one
namespace per fraction GPU) is charged whole against its GpuQuota.

Team-b is played by a user holding only the built-in ``edit`` role in team-b (tests/e2e/tenants.py); it
tries the slices that once took every L40S of a node for 3Gi of quota: ``{memory: 1Gi, compute: 1}``
(a compute share of 1 takes a GPU alone) or ``{memory: 1Gi, nodeName: X}``. Expected charges come from
the catalog (an L40S holds 46068 MiB), not from the code under test."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest
from harness import GROUP, VERSION, OperatorHarness
from tenants import edit_tenant
from test_gpu_quota import put_quota, wait_quota_crd, wait_quota_status

MIB = 2**20
L40S = 46068 * MIB
RULE = "by the fraction tenancy rule of one namespace per fraction GPU"


def forms(node: str) -> dict[str, dict[str, Any]]:
    return {"compute": {"memory": "1Gi", "compute": 1}, "nodeName": {"memory": "1Gi", "nodeName": node}}


def tenant_slices(operator: OperatorHarness, namespace: str, spec: dict[str, Any], count: int) -> list[str]:
    tenant = kubernetes.client.CustomObjectsApi(edit_tenant(operator.cluster, namespace))
    names = [f"lock-{i}" for i in range(count)]
    for name in names:
        tenant.create_namespaced_custom_object(GROUP, VERSION, namespace, "gpuslices", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name}, "spec": spec})
    return names


@pytest.mark.parametrize("form", ["compute", "nodeName"])
def test_three_gib_of_quota_cannot_keep_another_namespace_off_every_fraction_gpu(operator: OperatorHarness,
                                                                                 form: str) -> None:
    node = operator.add_node("l40s-48gb", count=3, labelled=False)
    operator.start_operator(node)
    wait_quota_crd(operator)
    team_a, team_b = operator.namespace(), operator.namespace()
    put_quota(operator, team_b, "3Gi", 3)
    put_quota(operator, team_a, "200Gi")
    for name in tenant_slices(operator, team_b, forms(node.name)[form], 3):
        st = operator.wait_phase(team_b, name, "Pending", reason="QuotaExceeded")["status"]
        # Its own GPU and node may be named to it, with the rule and the whole GPU's charge.
        for part in (f"GpuQuota {team_b}/quota", RULE, f"of node {node.name}", "46068Mi"):
            assert part in st["message"], st["message"]
    wait_quota_status(operator, team_b, 0, 0, 3)
    # Every GPU stays open to team-a: three 40Gi slices, one per L40S.
    for i in range(3):
        operator.create_slice(team_a, f"work-{i}", {"memory": "40Gi"})
    gpus = {operator.wait_phase(team_a, f"work-{i}", "Ready")["status"]["gpu"] for i in range(3)}
    assert gpus == {0, 1, 2}


def test_a_quota_that_holds_one_gpu_holds_one_and_the_rest_stay_open(operator: OperatorHarness) -> None:
    node = operator.add_node("l40s-48gb", count=3, labelled=False)
    operator.start_operator(node)
    wait_quota_crd(operator)
    team_a, team_b = operator.namespace(), operator.namespace()
    put_quota(operator, team_b, "50Gi", 4)  # one L40S's 46068 MiB, not two
    # Three pinned fractions: the first takes a GPU alone, the others join it (the GPU it holds first),
    # charged once.
    names = tenant_slices(operator, team_b, forms(node.name)["nodeName"], 3)
    held = {operator.wait_phase(team_b, name, "Ready")["status"]["gpu"] for name in names}
    assert len(held) == 1, held
    (held_gpu,) = held
    wait_quota_status(operator, team_b, L40S, 3, 0, whole=1)
    # A compute share of 1 cannot join shared fractions: it would take a second GPU whole, past 50Gi.
    tenant = kubernetes.client.CustomObjectsApi(edit_tenant(operator.cluster, team_b))
    tenant.create_namespaced_custom_object(GROUP, VERSION, team_b, "gpuslices", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "alone"},
        "spec": forms(node.name)["compute"]})
    st = operator.wait_phase(team_b, "alone", "Pending", reason="QuotaExceeded")["status"]
    assert RULE in st["message"] and "holds 46068Mi of its 50Gi" in st["message"], st["message"]
    status = wait_quota_status(operator, team_b, L40S, 3, 1, whole=1)
    assert status["heldWhole"] == [{"node": node.name, "gpu": held_gpu, "memory": str(L40S)}]
    shown = operator.cluster.kubectl("get", "gq", "-n", team_b).stdout.splitlines()
    columns = shown[0].split()
    assert shown[1].split()[columns.index("WHOLE-GPUS")] == "1", shown
    # team-a takes the two other GPUs; its third slice waits for team-b's GPU without learning whose it is.
    for i in range(2):
        operator.create_slice(team_a, f"work-{i}", {"memory": "40Gi"})
        assert operator.wait_phase(team_a, f"work-{i}", "Ready")["status"]["gpu"] != held_gpu
    operator.create_slice(team_a, "third", {"memory": "40Gi"})
    st = operator.wait_phase(team_a, "third", "Pending", reason="OtherNamespace")["status"]
    assert "held by another namespace" in st["message"], st["message"]
    for secret in (team_b, node.name, f"GPU {held_gpu}"):
        assert secret not in st["message"], st["message"]
    # team-b lets its slices go (the waiting one first, else it would take the GPU next): team-a's
    # slice is served there.
    for name in ["alone", *names]:
        operator.delete_slice(team_b, name)
    assert operator.wait_phase(team_a, "third", "Ready")["status"]["gpu"] == held_gpu
