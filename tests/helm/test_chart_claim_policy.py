"""Who may ask for a slice's device, and what the controller may change in its webhook configuration,
offline (templates/claim-policy.yaml, templates/controller-write-policy.yaml): which requests the policies
match, whom they spare, which fields they read. tests/e2e/test_tenant_isolation.py plays them on the real
API server as a tenant holding `edit` and as the controller."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from helm_chart import workload

from mig_operator.kube.common.names import DEVICE_CLASS, DRA_DRIVER
from mig_operator.kube.controller.claims import claim_body

SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.34.0-local-strict"
KINDS = {"-claims.cdmo.io": ("resourceclaims", "object.spec"),
         "-claim-templates.cdmo.io": ("resourceclaimtemplates", "object.spec.spec")}


def properties(name: str) -> set[str]:
    """The fields Kubernetes 1.34 defines for a type (its published JSON schema)."""
    return set(json.loads((SCHEMAS / f"{name}.json").read_text())["properties"])


def policies(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    found = {}
    for suffix in KINDS:
        [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                    and d["metadata"]["name"].endswith(suffix)]
        [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                     and d["metadata"]["name"] == policy["metadata"]["name"]]
        found[suffix] = (policy, binding)
    return found


def test_two_policies_refuse_everyone_but_the_releases_controller_in_every_namespace(render: Any) -> None:
    docs = render("--set", "serviceAccount.controller.name=ctl", release="mo", namespace="gpu-system")
    found = policies(docs)
    assert [p["metadata"]["name"] for p, _ in found.values()] == ["mo-mig-operator-claims.cdmo.io",
                                                                    "mo-mig-operator-claim-templates.cdmo.io"]
    for part in ("controller", "webhook"):
        assert workload(docs, "Deployment", part)["spec"]["template"]["spec"]["serviceAccountName"] == "ctl"
    for suffix, (policy, binding) in found.items():
        resource, _ = KINDS[suffix]
        # Every namespace (no matchResources), enforced.
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        # v1 only, other versions converted to it (Equivalent); never the status subresource, which
        # kube-scheduler (and the controller, for pre-allocated claims) write.
        assert spec["matchConstraints"] == {"matchPolicy": "Equivalent", "resourceRules": [{
            "apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
            "resources": [resource]}]}
        conditions = {c["name"]: c["expression"] for c in spec["matchConditions"]}
        assert conditions["not-the-controller"] == 'request.userInfo.username != "system:serviceaccount:gpu-system:ctl"'
        # An UPDATE that leaves the spec alone (kube-scheduler's finalizer) is not refused.
        assert conditions["writes-the-spec"] == "oldObject == null || object.spec != oldObject.spec"


def test_they_read_every_request_form_of_the_claims_spec_and_name_the_class_and_the_way(render: Any) -> None:
    for suffix, (policy, _) in policies(render()).items():
        _, spec = KINDS[suffix]
        variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
        text = " ".join(variables.values())
        # The kind's own spec (a template's is one level down), never the other kind's.
        assert f"{spec}.devices.requests" in variables["requests"]
        if spec == "object.spec":
            assert "object.spec.spec" not in text
        # Both request forms and the opaque configuration; the class and driver are names.py's.
        for form in ("r.exactly.deviceClassName", "r.firstAvailable.exists(q, q.deviceClassName",
                     "r.exactly.selectors", "q.selectors", "c.opaque.driver"):
            assert form in text, form
        assert f"'{DEVICE_CLASS}'" in variables["ofTheClass"]
        assert f"contains('{DRA_DRIVER}')" in variables["namingTheDriver"]
        assert f"'{DRA_DRIVER}'" in variables["configForTheDriver"]
        # Every field of a request, so that a new request form would be noticed here.
        assert properties("devicerequest-resource-v1") == {"name", "exactly", "firstAvailable"}
        assert properties("deviceclaim-resource-v1") == {"requests", "constraints", "config"}
        validations = policy["spec"]["validations"]
        assert len(validations) == 3
        for validation in validations:
            assert validation["reason"] == "Forbidden"
            for message in (validation["messageExpression"], validation["message"]):
                assert DEVICE_CLASS in message and "GpuSlice" in message and "cdmo.io/gpu-memory" in message
            assert "\n" not in validation["message"]


def test_the_controllers_own_claim_is_one_the_policy_would_refuse_anyone_else() -> None:
    """The exemption is what lets the controller write claims.py's claim: its class and selector are the
    very ones refused to everyone else."""
    [request] = claim_body("ns", "s", "UID")["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == DEVICE_CLASS
    assert DRA_DRIVER in request["exactly"]["selectors"][0]["cel"]["expression"]


def test_they_can_be_turned_off(render: Any) -> None:
    assert not [d for d in render("--set", "claimPolicy.enabled=false") if d["metadata"]["name"].endswith(
        tuple(KINDS))]


@pytest.mark.parametrize("cert_manager", [False, True])
def test_the_controller_may_change_only_the_ca_of_its_webhook_configuration(render: Any, cert_manager: bool) -> None:
    docs = render("--set", f"webhook.certManager.enabled={str(cert_manager).lower()}", release="mo",
                  namespace="gpu-system")
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                and d["metadata"]["name"].endswith("-controller-writes.cdmo.io")]
    expressions = [v["expression"] for v in policy["spec"]["validations"]]
    [update] = [e for e in expressions if "request.operation != 'UPDATE'" in e]
    # Every field of a webhook but its name (matched) and clientConfig.caBundle, from Kubernetes' own schema.
    compared = properties("mutatingwebhook-admissionregistration-v1") - {"name", "clientConfig"}
    compared |= {f"clientConfig.{f}" for f in properties("webhookclientconfig-admissionregistration-v1") - {"caBundle"}}
    for field in compared:
        assert f"w.{field} == o.{field}" in update, field
    assert "caBundle" not in update
    for field in ("labels", "annotations", "ownerReferences", "finalizers"):
        assert f"object.metadata.{field} == oldObject.metadata.{field}" in update, field
    [create] = [e for e in expressions if "request.operation != 'CREATE'" in e]
    assert 'w.clientConfig.service.namespace == "gpu-system"' in create
    assert 'w.clientConfig.service.name == "mo-mig-operator-webhook"' in create
    # RBAC: patch of the one configuration by name; create cannot be named (the policy names it).
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "mo-mig-operator-controller")
    rules = [r for r in role["rules"] if r["resources"] == ["mutatingwebhookconfigurations"]]
    if cert_manager:
        assert not rules
    else:
        assert rules == [{"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
                          "verbs": ["create"]},
                         {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
                          "resourceNames": ["mig-operator"], "verbs": ["patch"]}]
