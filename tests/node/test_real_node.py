"""The chart installed on a real node (kubelet, containerd with CDI, runc, CNI; tests/node/conftest.py),
each step checked the way a user would, with kubectl: the node Ready and a plain pod running; `helm
install` of helm/mig-operator with the built image (the agent on the simulator backend); an annotated
fraction pod whose container sees its slice and is refused past its limit; a MIG pod with its instance's
capability nodes; a pod naming a GpuSlice's claim; the kubelet restarted and the agent's pod replaced
while claims are prepared; `helm uninstall` leaving only what docs/operations.md says.

The tests run in file order and share one release (module fixture): each step builds on the last.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# tests/node/conftest.py's RealNode (a fixture's type; not imported: several test directories have a
# conftest module of that name).
RealNode = Any
REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
PROBE = (Path(__file__).parent / "probe.py").read_text()
RELEASE, RELEASE_NS, TEAM = "mig-operator", "mig-operator", "team-a"
GPU_PRESENT = "nvidia.com/gpu.present"
MIG_LABEL = "cdmo.clear.ml/gpu-partitioning"
SIM_BACKEND = "sim:h100-80gbx2"
# The driver's numbering of MIG capability minors (NVIDIA's /proc/driver/nvidia-caps/mig-minors):
# 1 config, 2 monitor, then per GPU 15 GPU instances of 1 + 8 compute-instance minors each.
CAPS_MAJOR_SIM = 510
GI_MINORS, GIS_PER_GPU = 9, 15
FRONTEND_MAJOR = 195


def wait_for(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what() if callable(what) else what}",
                        pytrace=False)
        time.sleep(0.5)


def get(node: RealNode, *args: str) -> Any:
    out = node.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def pod_phase(node: RealNode, ns: str, name: str) -> str:
    pod = get(node, "pod", name, "-n", ns)
    return pod["status"].get("phase", "") if pod else ""


def describe(node: RealNode, ns: str, name: str) -> Callable[[], str]:
    return lambda: f"pod {ns}/{name}:\n" + node.kubectl("describe", "pod", name, "-n", ns, check=False).stdout[-3000:]


def probe_output(node: RealNode, ns: str, name: str) -> dict[str, Any]:
    logs = node.kubectl("logs", name, "-n", ns).stdout
    line = next((x for x in logs.splitlines() if x.startswith("PROBE ")), None)
    assert line, f"pod {ns}/{name} printed no PROBE line:\n{logs}"
    return json.loads(line.removeprefix("PROBE "))


def probe_pod(node: RealNode, name: str, *, annotations: dict[str, str] | None = None,
              claim: str | None = None, env: dict[str, str] | None = None, wait: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "probe", "image": node.images["WORKLOAD_IMAGE"], "imagePullPolicy": "Never",
        "command": ["python3", "-c", PROBE, *(["--wait"] if wait else [])],
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container],
                            "terminationGracePeriodSeconds": 1}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": TEAM, "annotations": annotations or {}}, "spec": spec}


def run_pod(node: RealNode, pod: dict[str, Any], until: str = "Succeeded", timeout: float = 180) -> str:
    name = pod["metadata"]["name"]
    node.kubectl("apply", "-f", "-", input=json.dumps(pod))
    wait_for(lambda: pod_phase(node, TEAM, name) in (until, "Failed"), timeout, describe(node, TEAM, name))
    phase = pod_phase(node, TEAM, name)
    assert phase == until, describe(node, TEAM, name)() + node.kubectl("logs", name, "-n", TEAM, check=False).stdout
    return name


def fake_cuda_env(node: RealNode, alloc: int, tries: int = 64) -> dict[str, str]:
    """The fake libcuda of the shim's C tests (in the workload image) found by the loader, a GPU far
    larger than the slice, and the probe's allocation loop."""
    return {"LD_LIBRARY_PATH": node.images["FAKE_CUDA_DIR"], "FAKE_TOTAL": str(80 << 30),
            "PROBE_ALLOC_BYTES": str(alloc), "PROBE_ALLOC_TRIES": str(tries)}


def agent_logs(node: RealNode) -> str:
    names = node.kubectl("get", "pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=agent",
                         "-o", "name").stdout.split()
    return "\n".join(node.kubectl("logs", "-n", RELEASE_NS, n, "-c", "agent", check=False).stdout for n in names)


def prepared_count(logs: str, claim: str) -> int:
    return len(re.findall(rf"prepared ResourceClaim {re.escape(TEAM)}/{re.escape(claim)} ", logs))


# ---- the node ------------------------------------------------------------------------------------

def test_node_is_ready_and_runs_a_plain_pod(real_node: RealNode) -> None:
    node = get(real_node, "node", real_node.name)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True", node["status"]["conditions"]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.4"
    real_node.kubectl("create", "namespace", TEAM)
    wait_for(lambda: get(real_node, "serviceaccount", "default", "-n", TEAM), 60, "team-a's default ServiceAccount")
    # A plain pod: it runs, its network is the node's bridge, and it reaches the API server through
    # the kubernetes Service as every in-cluster client does.
    reach = ("import os, ssl, urllib.request as u; ctx = ssl.create_default_context("
             "cafile='/var/run/secrets/kubernetes.io/serviceaccount/ca.crt'); "
             "url = 'https://%s:%s/version' % (os.environ['KUBERNETES_SERVICE_HOST'], "
             "os.environ['KUBERNETES_SERVICE_PORT']); print('VERSION', u.urlopen(url, context=ctx).read().decode())")
    pod = probe_pod(real_node, "plain")
    pod["spec"]["containers"][0]["command"] = ["python3", "-c", reach]
    run_pod(real_node, pod)
    logs = real_node.kubectl("logs", "plain", "-n", TEAM).stdout
    assert '"gitVersion": "v1.34.4"' in logs, logs
    assert get(real_node, "pod", "plain", "-n", TEAM)["status"]["podIP"].startswith("10.88.")
    real_node.kubectl("delete", "pod", "plain", "-n", TEAM, "--wait=true")


# ---- the chart -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def release(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """helm install of the chart with the built image; the node labelled as GPU Feature Discovery would."""
    repository, tag = real_node.images["OPERATOR_IMAGE"].rsplit(":", 1)
    node_dir = real_node.node_dir
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "controller": {"replicas": 1},
        "agent": {"backend": SIM_BACKEND, "stateDir": f"{node_dir}/var/lib/mig-operator",
                  "kubeletDir": f"{node_dir}/kubelet", "cdiDir": real_node.settings["NODE_CDI_DIR"],
                  "runtimeClassName": "", "toolkitConfig": ""},
        "shim": {"hostDir": f"{node_dir}/var/lib/mig-operator/shim"},
    }
    path = tmp_path_factory.mktemp("release") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    real_node.kubectl("label", "node", real_node.name, f"{GPU_PRESENT}=true", "--overwrite")
    real_node.helm("install", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--create-namespace",
                   "--values", str(path), "--wait", "--timeout", "5m")
    yield real_node


def test_chart_installs_and_its_parts_run(release: RealNode) -> None:
    node = release
    deploy = get(node, "deployment", f"{RELEASE}-controller", "-n", RELEASE_NS)
    assert deploy["status"].get("availableReplicas") == 1, deploy["status"]
    ds = get(node, "daemonset", f"{RELEASE}-agent", "-n", RELEASE_NS)
    assert ds["status"]["numberReady"] == 1, ds["status"]
    # The agent publishes its node's simulated GPUs; the DeviceClass and policies are the chart's.
    gn = wait_for(lambda: (get(node, "gpunode", node.name) or {}).get("status", {}).get("gpus"), 120,
                  "the agent's GpuNode")
    assert len(gn) == 2
    assert get(node, "deviceclass", "gpuslice.cdmo.io")
    wait_for(lambda: (get(node, "mutatingwebhookconfiguration", RELEASE) or {}).get("webhooks", [{}])[0]
             .get("clientConfig", {}).get("caBundle"), 120, "the controller to patch its CA into the webhook")
    policies = get(node, "validatingadmissionpolicies")["items"]
    assert {p["metadata"]["name"] for p in policies}, "the chart's admission policies"
