"""The chart's extended-resource policy (templates/extended-resource-policy.yaml), offline: a pod whose
container asks for the slices' DeviceClass as an extended resource is refused at creation, in every
namespace, with what to write instead; the examples it gives are request forms the operator serves.
tests/e2e/test_extended_resources.py runs it on the real API server as a tenant."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
from helm_chart import REPO_ROOT

from mig_operator.core.requests.request_forms import mig_resource_request, pod_devices
from mig_operator.kube.common.names import DEVICE_CLASS

SUFFIX = "-extended-resources.cdmo.io"
SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.34.0-local-strict"
# Kubernetes' ResourceDeviceClassPrefix (pkg/apis/resource/types.go): every DeviceClass is an extended
# resource of this prefix and its name where DRAExtendedResource is on (1.36 and later).
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"


def properties(name: str) -> set[str]:
    """The fields Kubernetes 1.34 defines for a type (its published JSON schema)."""
    return set(json.loads((SCHEMAS / f"{name}.json").read_text())["properties"])


def extended_resource_policy(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy and its binding (exactly one of each)."""
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith(SUFFIX)]
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["metadata"]["name"] == policy["metadata"]["name"]]
    return policy, binding


def variables(policy: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


def test_it_refuses_pod_creation_in_every_namespace_enforced(render: Any) -> None:
    policy, binding = extended_resource_policy(render(release="mo", namespace="gpu-system"))
    assert policy["metadata"]["name"] == "mo-mig-operator-extended-resources.cdmo.io"
    # Every namespace (no matchResources), the release's too: no pod of the operator asks for it.
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"] == {"resourceRules": [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}
    assert "matchConditions" not in policy["spec"]


def test_it_names_the_implicit_resource_of_the_charts_device_class_and_any_explicit_one(render: Any) -> None:
    docs = render()
    policy, _ = extended_resource_policy(docs)
    [device_class] = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == DEVICE_CLASS
    expected = [IMPLICIT_PREFIX + DEVICE_CLASS]
    # A DeviceClass may name an extended resource of its own besides the implicit one (1.36 and later).
    if "extendedResourceName" in device_class["spec"]:
        expected.append(device_class["spec"]["extendedResourceName"])
    assert re.findall(r"'([^']+)'", variables(policy)["resourceNames"]) == expected


def test_it_reads_limits_and_requests_of_every_container_that_can_have_resources(render: Any) -> None:
    policy, _ = extended_resource_policy(render())
    asking = variables(policy)["asking"]
    for where in ("object.spec.containers", "object.spec.initContainers"):
        assert f"{where}.filter(c, has(c.resources)" in asking, where
    for field in ("limits", "requests"):
        assert f"c.resources.{field}.exists(k, k in variables.resourceNames)" in asking, field
        assert f"n in c.resources.{field}" in asking, field
    assert "\"container '\"" in asking and "\"init container '\"" in asking
    # Where a pod holds containers, and where a container holds resources: a new place would be noticed here.
    # Ephemeral containers cannot set resources (the API server refuses it) and a pod is created without any.
    assert {f for f in properties("podspec-v1") if f.endswith(("ontainers", "Containers"))} == {
        "containers", "initContainers", "ephemeralContainers"}
    assert properties("resourcerequirements-v1") == {"limits", "requests", "claims"}


def test_the_refusal_names_the_resource_and_the_class_and_says_what_to_write(render: Any) -> None:
    policy, _ = extended_resource_policy(render())
    [validation] = policy["spec"]["validations"]
    assert validation["expression"] == "size(variables.asking) == 0"
    assert validation["reason"] == "Forbidden"
    assert validation["messageExpression"].startswith('variables.asking.join("; ") + " (DeviceClass ')
    # The API server falls back to `message` when the expression's result is over 5 KiB.
    assert validation["message"].startswith(f"a container asks for {IMPLICIT_PREFIX}{DEVICE_CLASS} (DeviceClass ")
    assert "\n" not in validation["message"]
    for message in (validation["messageExpression"], validation["message"]):
        for word in (f"DeviceClass {DEVICE_CLASS}", "would never start", "cdmo.io/gpu-memory: 4G",
                     "nvidia.com/mig-1g.10gb: 1", "resourceClaimName", "docs/api.md, Request forms"):
            assert word in message, word


def test_the_examples_in_the_refusal_are_request_forms_the_operator_serves(render: Any) -> None:
    """Each annotation it shows is one slice request by itself (core's own parser), gpu-count beside one
    makes that many, and the MIG resource it shows is a MIG device request."""
    message = extended_resource_policy(render())[0]["spec"]["validations"][0]["message"]
    examples = dict(re.findall(r"(cdmo\.io/[a-z-]+): '?([0-9A-Za-z.]+)'?", message))
    assert set(examples) == {"cdmo.io/gpu-memory", "cdmo.io/gpu-fraction", "cdmo.io/mig-profile", "cdmo.io/gpu-count"}
    count = examples.pop("cdmo.io/gpu-count")
    for key, value in examples.items():
        assert len(pod_devices({key: value})) == 1, (key, value)
        assert len(pod_devices({key: value, "cdmo.io/gpu-count": count})) == int(count), (key, value)
    [(resource, quantity)] = re.findall(r"(nvidia\.com/mig-[0-9a-z.]+): (\d+)", message)
    pod = {"spec": {"containers": [{"name": "main", "resources": {"limits": {resource: quantity}}}]}}
    request = mig_resource_request(pod)
    assert request is not None and request.asked == {"main": {resource: quantity}}


def test_it_goes_with_the_claim_policy(render: Any) -> None:
    """It exists because the claim policy refuses kube-scheduler's claim: off together, on together."""
    docs = render("--set", "claimPolicy.enabled=false")
    assert not [d for d in docs if d["metadata"]["name"].endswith((SUFFIX, "-claims.cdmo.io"))]
    assert [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]  # the others stay


def test_the_docs_say_what_is_refused_and_why() -> None:
    guide = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert f"`<release>{SUFFIX}`" in guide.split("## Before you install", 1)[0]
    section = guide.split("### Claims belong to the controller", 1)[1].split("\n### ", 1)[0]
    api = (REPO_ROOT / "docs" / "api.md").read_text()
    forms = api.split("### Request forms", 1)[1].split("\n### ", 1)[0]
    for text in (section, forms):
        assert f"{IMPLICIT_PREFIX}{DEVICE_CLASS}" in text
