"""The chart's pod device policy (templates/pod-device-policy.yaml), offline: what it matches, which
namespaces it binds, that it can be turned off, and that it refuses every variable the slice's own
environment and the agent's NVIDIA runtime settings use. tests/e2e/test_pod_device_policy.py runs it on
the real API server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART_DIR, REPO_ROOT

from mig_operator.core.node.environment import SHIM_PATH_IN_CONTAINER, slice_environment

SUFFIX = "-pod-devices.cdmo.io"
NAME_LABEL = "kubernetes.io/metadata.name"
# Written out here, not read from the chart: the variables by which the NVIDIA container toolkit hands out
# devices (internal/config/image/envvars.go, internal/modifier/gated.go, swarm-resource's default), and CUDA's.
DEVICE_VARIABLES = ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES",
                    "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_NVSWITCH", "NVIDIA_GDRCOPY",
                    "DOCKER_RESOURCE_GPU", "CUDA_VISIBLE_DEVICES"]


def pod_policy(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy and its binding (exactly one of each)."""
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith(SUFFIX)]
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["metadata"]["name"].endswith(SUFFIX)]
    return policy, binding


def selector(binding: dict[str, Any]) -> dict[str, Any]:
    return binding["spec"]["matchResources"]["namespaceSelector"]


def device_names(policy: dict[str, Any]) -> list[str]:
    [variable] = [v for v in policy["spec"]["variables"] if v["name"] == "deviceNames"]
    return re.findall(r"'([A-Z_]+)'", variable["expression"])


def test_by_default_it_is_on_for_pods_and_ephemeral_containers_in_every_namespace_but_two(render: Any) -> None:
    policy, binding = pod_policy(render(release="mo", namespace="gpu-system"))
    assert policy["metadata"]["name"] == "mo-mig-operator-pod-devices.cdmo.io"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    rules = {(tuple(r["apiGroups"]), tuple(r["apiVersions"]), res, tuple(r["operations"]))
             for r in policy["spec"]["matchConstraints"]["resourceRules"] for res in r["resources"]}
    assert rules == {(("",), ("v1",), "pods", ("CREATE", "UPDATE")),
                     (("",), ("v1",), "pods/ephemeralcontainers", ("UPDATE",))}
    # Every namespace but the release's and kube-system: no label needed, no include list.
    assert selector(binding) == {"matchExpressions": [
        {"key": NAME_LABEL, "operator": "NotIn", "values": ["gpu-system", "kube-system"]}]}
    assert "matchConditions" not in policy["spec"]  # every pod, annotated or not


def test_each_refusal_has_a_message_expression_a_fallback_message_and_reason_forbidden(render: Any) -> None:
    policy, _ = pod_policy(render())
    validations = policy["spec"]["validations"]
    assert len(validations) == 5
    for validation in validations:
        assert validation["reason"] == "Forbidden"
        assert "ResourceClaim" in validation["messageExpression"] and "gpu.cdmo.io" in validation["messageExpression"]
        # The API server falls back to `message` when the expression's result is over 5 KiB.
        assert "ResourceClaim" in validation["message"] and "\n" not in validation["message"]
    text = " ".join(v["expression"] for v in policy["spec"]["variables"])
    for route in ("CDMO_", "GPU_MEM_LIMIT_GB", "LD_PRELOAD", "libgpuslice", "nvidia-container-devices",
                  r"cdi\.k8s\.io", "ephemeralContainers", "initContainers", "oldObject"):
        assert route in text, route


def test_it_refuses_exactly_the_device_variables_of_the_nvidia_runtime(render: Any) -> None:
    policy, _ = pod_policy(render())
    assert device_names(policy) == DEVICE_VARIABLES


def test_the_slices_own_environment_is_all_refused(render: Any) -> None:
    """Every variable the driver's CDI spec gives a slice (core/node/environment.py) is one a pod may not set."""
    policy, _ = pod_policy(render())
    refused = set(device_names(policy))
    for mode in ("mig", "fraction"):
        for name, value in slice_environment(mode, 4 * 2**30, "ns", "s").items():
            assert (name in refused or name.startswith("CDMO_") or name == "GPU_MEM_LIMIT_GB"
                    or (name == "LD_PRELOAD" and "libgpuslice" in value)), name
    assert "libgpuslice" in SHIM_PATH_IN_CONTAINER


def test_the_agents_nvidia_settings_would_be_refused_so_its_namespace_is_never_checked(render: Any) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    refused = set(device_names(pod_policy(render())[0]))
    assert {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_MIG_CONFIG_DEVICES"} <= set(values["agent"]["nvidiaEnv"]) and (
        set(values["agent"]["nvidiaEnv"]) - {"NVIDIA_DRIVER_CAPABILITIES"} <= refused)
    for namespace in ("mig-operator", "gpu-system"):
        _, binding = pod_policy(render("--set", "podDevicePolicy.excludeNamespaces={a}", namespace=namespace))
        [names] = selector(binding)["matchExpressions"]
        assert names["operator"] == "NotIn" and names["values"] == [namespace, "kube-system", "a"]


def test_turned_off_nothing_of_it_is_rendered(render: Any) -> None:
    docs = render("--set", "podDevicePolicy.enabled=false")
    assert not [d for d in docs if d["metadata"]["name"].endswith(SUFFIX)]
    assert [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]  # the others stay


def test_more_exclusions_an_include_list_and_labels(render: Any, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"podDevicePolicy": {
        "namespaces": ["team-a", "team-b"], "excludeNamespaces": ["gpu-operator", "kube-system"],
        "namespaceLabels": {"tenant": "true", "example.com/gpu": "yes"}}}))
    _, binding = pod_policy(render("--values", str(values), namespace="gpu-system"))
    assert selector(binding) == {
        "matchLabels": {"tenant": "true", "example.com/gpu": "yes"},
        "matchExpressions": [
            # kube-system once, however often it is named
            {"key": NAME_LABEL, "operator": "NotIn", "values": ["gpu-system", "kube-system", "gpu-operator"]},
            {"key": NAME_LABEL, "operator": "In", "values": ["team-a", "team-b"]},
        ]}


@pytest.mark.parametrize("listed", ["gpu-system", "kube-system", "gpu-operator"])
def test_an_include_list_naming_an_excluded_namespace_fails_naming_it(helm: Any, listed: str) -> None:
    result = helm("template", "mo", str(CHART_DIR), "--namespace", "gpu-system", "--set",
                  f"podDevicePolicy.namespaces={{team-a,{listed}}}", "--set",
                  "podDevicePolicy.excludeNamespaces={gpu-operator}", check=False)
    assert result.returncode != 0
    assert f"podDevicePolicy.namespaces lists {listed}, which is never checked" in result.stderr
    assert "e.g. podDevicePolicy.namespaces={team-a,team-b}" in result.stderr


def test_the_operations_guide_lists_what_the_policy_refuses() -> None:
    guide = (REPO_ROOT / "docs" / "operations.md").read_text()
    section = guide.split("## Pods cannot name devices", 1)[1].split("\n## ", 1)[0]
    for name in [*DEVICE_VARIABLES, "CDMO_", "GPU_MEM_LIMIT_GB", "LD_PRELOAD", "/var/run/nvidia-container-devices",
                 "cdi.k8s.io/", "accept-nvidia-visible-devices-envvar-when-unprivileged", "envFrom",
                 "podDevicePolicy.excludeNamespaces", "/etc/nvidia-container-runtime/config.toml"]:
        assert name in section, name
