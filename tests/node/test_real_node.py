"""The chart installed on a real node (kubelet, containerd with CDI, runc, CNI; tests/node/conftest.py),
each step checked the way a user would, with kubectl: the node Ready and a plain pod running; `helm
install` of helm/mig-operator with the built image (the agent on the simulator backend); an annotated
fraction pod whose container sees its slice and is refused past its limit; a MIG pod with its instance's
capability nodes; a pod naming a GpuSlice's claim; the kubelet restarted and the agent's pod replaced
while claims are prepared; a pod's status showing its GPU's health through a critical Xid and a reset;
`helm uninstall` leaving only what docs/operations.md says; then a release of its own upgraded to a new
image tag while a MIG pod, a fraction pod and two compute-share pods run.

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

from mig_operator.gpu.simulated import SimulatedBackend

# Needs a control plane, as tests/e2e: `pytest -m "not e2e"` leaves the suite out (and builds nothing).
pytestmark = pytest.mark.e2e

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
MIG_PROFILE = "1g.10gb"  # the H100 80GB's smallest
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
              claim: str | None = None, env: dict[str, str] | None = None, wait: bool = False,
              prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """A pod running the probe; ``prefix``: what its command starts with (the probe's own process
    started through it, e.g. ``env -u LD_PRELOAD``)."""
    container: dict[str, Any] = {
        "name": "probe", "image": node.images["WORKLOAD_IMAGE"], "imagePullPolicy": "Never",
        "command": [*prefix, "python3", "-c", PROBE, *(["--wait"] if wait else [])],
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


def wait_for_probe(node: RealNode, name: str) -> dict[str, Any]:
    """The probe's output of a pod kept running (--wait)."""
    wait_for(lambda: "PROBE " in node.kubectl("logs", name, "-n", TEAM, check=False).stdout, 60,
             f"pod {name}'s probe output")
    return probe_output(node, TEAM, name)


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
    assert node["status"]["nodeInfo"]["kubeletVersion"] == real_node.settings["K8S_VERSION"]
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
    version = real_node.settings["K8S_VERSION"]
    assert f'"gitVersion": "{version}"' in logs, logs
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
        "webhook": {"replicas": 1},
        "agent": {"backend": SIM_BACKEND, "stateDir": f"{node_dir}/var/lib/mig-operator",
                  "kubeletDir": f"{node_dir}/kubelet", "cdiDir": real_node.settings["NODE_CDI_DIR"],
                  "runtimeClassName": "", "toolkitConfig": ""},
        "shim": {"hostDir": f"{node_dir}/var/lib/mig-operator/shim"},
    }
    path = tmp_path_factory.mktemp("release") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    # The simulated hardware, as an admin left it: GPU 0 in MIG mode, GPU 1 not (`nvidia-smi -i 1 -mig 0`),
    # so that one node serves both kinds of slice (MIG on GPU 0 once the node is labelled for MIG).
    state = node_dir / "var/lib/mig-operator"
    state.mkdir(parents=True, exist_ok=True)
    gpus = [{"mig_enabled": enabled, "generation": 0, "instances": []} for enabled in (True, False)]
    (state / "simulated-gpus.json").write_text(json.dumps(
        {"version": 1, "model": SIM_BACKEND.removeprefix("sim:").split("x")[0], "gpus": gpus,
         "faults": {}, "latency_s": {}}))
    real_node.kubectl("label", "node", real_node.name, f"{GPU_PRESENT}=true", "--overwrite")
    real_node.helm("install", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--create-namespace",
                   "--values", str(path), "--wait", "--timeout", "5m")
    yield real_node


def test_chart_installs_and_its_parts_run(release: RealNode) -> None:
    node = release
    for part in ("controller", "webhook"):
        deploy = get(node, "deployment", f"{RELEASE}-{part}", "-n", RELEASE_NS)
        assert deploy["status"].get("availableReplicas") == 1, (part, deploy["status"])
    ds = get(node, "daemonset", f"{RELEASE}-agent", "-n", RELEASE_NS)
    assert ds["status"]["numberReady"] == 1, ds["status"]
    # The agent publishes its node's simulated GPUs; the DeviceClass and policies are the chart's.
    gn = wait_for(lambda: (get(node, "gpunode", node.name) or {}).get("status", {}).get("gpus"), 120,
                  "the agent's GpuNode")
    assert len(gn) == 2
    assert get(node, "deviceclass", "gpuslice.cdmo.io")
    wait_for(lambda: (get(node, "mutatingwebhookconfiguration", RELEASE) or {}).get("webhooks", [{}])[0]
             .get("clientConfig", {}).get("caBundle"), 120, "the operator to patch its CA into the webhook")
    policies = get(node, "validatingadmissionpolicies")["items"]
    assert {p["metadata"]["name"] for p in policies}, "the chart's admission policies"


# ---- slices in containers ------------------------------------------------------------------------

def test_fraction_pod_sees_its_slice_and_is_refused_past_its_limit(release: RealNode) -> None:
    node = release
    limit = 4 * 10**9  # cdmo.io/gpu-memory: 4G (Kubernetes' G: 10^9 bytes)
    chunk = 10**9
    pod = probe_pod(node, "fraction", annotations={"cdmo.io/gpu-memory": "4G"}, env=fake_cuda_env(node, chunk))
    run_pod(node, pod)
    view = probe_output(node, TEAM, "fraction")
    claim = get(node, "pod", "fraction", "-n", TEAM)["spec"]["resourceClaims"][0]["resourceClaimName"]
    env = view["env"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CDMO_SLICE"] == f"{TEAM}/{claim}"
    assert env["CDMO_GPU_MEMORY_LIMIT"] == str(limit)
    assert env["GPU_MEM_LIMIT_GB"] == "4"
    assert "LD_PRELOAD" not in env  # the runtime's /etc/ld.so.preload loads the shim
    for read_only in ("/usr/local/lib/cdmo/libgpuslice.so", "/run/cdmo/limit", "/etc/ld.so.preload"):
        assert "ro" in view["mounts"][read_only], (read_only, view["mounts"])
    assert "rw" in view["mounts"]["/run/cdmo/ledger"]
    assert view["shim_mapped"], "the shim is not loaded into the container's process"
    # GPU 1 (MIG mode off) serves fractions: its node, the control and UVM nodes, no MIG capability.
    assert view["devices"] == {"/dev/nvidia1": [FRONTEND_MAJOR, 1], "/dev/nvidiactl": [FRONTEND_MAJOR, 255],
                               "/dev/nvidia-uvm": [509, 0], "/dev/nvidia-uvm-tools": [509, 1]}
    # 80 GiB behind the fake driver, 4G granted: four 10^9-byte allocations fit, the fifth is refused
    # with CUDA_ERROR_OUT_OF_MEMORY (2).
    assert view["alloc"]["results"] == [0] * (limit // chunk) + [2], view["alloc"]
    node.kubectl("delete", "pod", "fraction", "-n", TEAM, "--wait=true")


def test_a_fraction_process_that_drops_ld_preload_and_raises_its_limit_keeps_the_slices(release: RealNode) -> None:
    """A hostile workload starts its process with LD_PRELOAD removed and CDMO_GPU_MEMORY_LIMIT at the
    fake GPU's whole 80 GiB: runc's /etc/ld.so.preload (the CDI spec's read-only file) loads the shim
    all the same, and the shim takes the limit from the spec's read-only limit file."""
    node = release
    limit, chunk, whole = 4 * 10**9, 10**9, 80 << 30
    pod = probe_pod(node, "hostile", annotations={"cdmo.io/gpu-memory": "4G"}, env=fake_cuda_env(node, chunk),
                    prefix=("env", "-u", "LD_PRELOAD", f"CDMO_GPU_MEMORY_LIMIT={whole}"))
    run_pod(node, pod)
    view = probe_output(node, TEAM, "hostile")
    assert "LD_PRELOAD" not in view["env"] and view["env"]["CDMO_GPU_MEMORY_LIMIT"] == str(whole), view["env"]
    assert view["shim_mapped"], "the shim is not loaded into the process that dropped LD_PRELOAD"
    assert view["alloc"]["results"] == [0] * (limit // chunk) + [2], view["alloc"]
    node.kubectl("delete", "pod", "hostile", "-n", TEAM, "--wait=true")


def test_mig_pod_gets_its_instances_capability_nodes(release: RealNode) -> None:
    node = release
    node.kubectl("label", "node", node.name, f"{MIG_LABEL}=mig", "--overwrite")
    # Kept running: a pod's slice goes when the pod finishes.
    run_pod(node, probe_pod(node, "mig", annotations={"cdmo.io/mig-profile": MIG_PROFILE}, wait=True),
            until="Running")
    view = wait_for_probe(node, "mig")
    claim = get(node, "pod", "mig", "-n", TEAM)["spec"]["resourceClaims"][0]["resourceClaimName"]
    status = get(node, "gpuslice", claim, "-n", TEAM)["status"]
    assert status["mode"] == "mig" and status["profile"] == MIG_PROFILE, status
    gpu, gi, ci = status["gpu"], status["giId"], status["ciId"]
    gi_minor = 3 + gpu * GIS_PER_GPU * GI_MINORS + gi * GI_MINORS
    assert view["devices"] == {
        f"/dev/nvidia{gpu}": [FRONTEND_MAJOR, gpu], "/dev/nvidiactl": [FRONTEND_MAJOR, 255],
        "/dev/nvidia-uvm": [509, 0], "/dev/nvidia-uvm-tools": [509, 1],
        f"/dev/nvidia-caps/nvidia-cap{gi_minor}": [CAPS_MAJOR_SIM, gi_minor],
        f"/dev/nvidia-caps/nvidia-cap{gi_minor + 1 + ci}": [CAPS_MAJOR_SIM, gi_minor + 1 + ci],
    }
    assert view["env"] == {"NVIDIA_VISIBLE_DEVICES": "void"}, "a MIG slice needs no shim"
    assert view["mounts"] == {} and not view["shim_mapped"]
    node.kubectl("delete", "pod", "mig", "-n", TEAM, "--wait=true")


def test_pod_using_a_gpuslices_claim(release: RealNode) -> None:
    node = release
    slice_doc = {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
                 "metadata": {"name": "notebook", "namespace": TEAM}, "spec": {"migProfile": MIG_PROFILE}}
    node.kubectl("apply", "-f", "-", input=json.dumps(slice_doc))
    wait_for(lambda: get(node, "resourceclaim", "notebook", "-n", TEAM), 120, "the GpuSlice's ResourceClaim")
    status = get(node, "gpuslice", "notebook", "-n", TEAM)["status"]
    run_pod(node, probe_pod(node, "notebook-1", claim="notebook"))
    view = probe_output(node, TEAM, "notebook-1")
    assert f"/dev/nvidia{status['gpu']}" in view["devices"]
    assert len([d for d in view["devices"] if d.startswith("/dev/nvidia-caps/")]) == 2
    # The claim outlives the pod: a second pod gets the same instance.
    node.kubectl("delete", "pod", "notebook-1", "-n", TEAM, "--wait=true")
    run_pod(node, probe_pod(node, "notebook-2", claim="notebook"))
    assert probe_output(node, TEAM, "notebook-2")["devices"] == view["devices"]
    node.kubectl("delete", "pod", "notebook-2", "-n", TEAM, "--wait=true")
    node.kubectl("delete", "gpuslice", "notebook", "-n", TEAM, "--wait=true")


# ---- restarts ------------------------------------------------------------------------------------

def test_kubelet_restart_and_agent_replacement_keep_running_containers(release: RealNode) -> None:
    node = release
    # Fractions again (GPU 1): without the MIG label a memory request cannot go to GPU 0.
    node.kubectl("label", "node", node.name, f"{MIG_LABEL}-")
    chunk = 10**9
    run_pod(node, probe_pod(node, "steady", annotations={"cdmo.io/gpu-memory": "2G"},
                            env=fake_cuda_env(node, chunk), wait=True), until="Running")
    before = wait_for_probe(node, "steady")
    assert before["alloc"]["results"] == [0, 0, 2], before["alloc"]
    claim = get(node, "pod", "steady", "-n", TEAM)["spec"]["resourceClaims"][0]["resourceClaimName"]
    assert prepared_count(agent_logs(node), claim) == 1

    restart = node.control_plane("restart", "kubelet")
    assert restart.returncode == 0, restart.stderr
    run_pod(node, probe_pod(node, "after-kubelet", annotations={"cdmo.io/gpu-memory": "2G"},
                            env=fake_cuda_env(node, chunk)))
    assert probe_output(node, TEAM, "after-kubelet")["alloc"]["results"] == [0, 0, 2]
    old_agent = node.kubectl("get", "pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=agent",
                             "-o", "jsonpath={.items[0].metadata.name}").stdout
    old_logs = agent_logs(node)
    assert prepared_count(old_logs, claim) == 1, "the restarted kubelet had the claim prepared again"

    node.kubectl("delete", "pod", old_agent, "-n", RELEASE_NS, "--wait=true")
    wait_for(lambda: (get(node, "daemonset", f"{RELEASE}-agent", "-n", RELEASE_NS) or {})
             .get("status", {}).get("numberReady") == 1
             and old_agent not in node.kubectl("get", "pods", "-n", RELEASE_NS, "-o", "name").stdout,
             120, "the DaemonSet's new agent pod")
    run_pod(node, probe_pod(node, "after-agent", annotations={"cdmo.io/gpu-memory": "2G"},
                            env=fake_cuda_env(node, chunk)))
    assert probe_output(node, TEAM, "after-agent")["alloc"]["results"] == [0, 0, 2]
    assert prepared_count(agent_logs(node), claim) == 0, "the new agent prepared the running pod's claim again"

    # The running container kept its devices, its slice's variables and its limit: a second process in
    # it shares the first one's ledger, which already holds the whole 2G.
    steady = get(node, "pod", "steady", "-n", TEAM)
    assert steady["status"]["phase"] == "Running"
    assert steady["status"]["containerStatuses"][0]["restartCount"] == 0
    again = node.kubectl("exec", "steady", "-n", TEAM, "--", "python3", "-c", PROBE).stdout
    after = json.loads(next(x for x in again.splitlines() if x.startswith("PROBE ")).removeprefix("PROBE "))
    assert after["devices"] == before["devices"] and after["env"] == before["env"]
    assert after["alloc"]["results"] == [2], after["alloc"]
    for name in ("steady", "after-kubelet", "after-agent"):
        node.kubectl("delete", "pod", name, "-n", TEAM, "--wait=true")


# ---- a GPU that fails ----------------------------------------------------------------------------

def test_a_pods_status_shows_its_gpus_health(release: RealNode) -> None:
    """The kubelet (ResourceHealthStatus, on by default from 1.36) asks the plugin for its devices' health
    and writes it in the pod's status: Unhealthy after a critical Xid on the slice's GPU, Healthy after
    its reset."""
    node = release
    run_pod(node, probe_pod(node, "sick", annotations={"cdmo.io/gpu-memory": "2G"}, wait=True), until="Running")
    pod = get(node, "pod", "sick", "-n", TEAM)
    claim = pod["spec"]["resourceClaims"][0]["resourceClaimName"]
    [used] = pod["spec"]["containers"][0]["resources"]["claims"]
    name = f"claim:{used['name']}" + (f"/{used['request']}" if used.get("request") else "")
    status = get(node, "gpuslice", claim, "-n", TEAM)["status"]
    uid = get(node, "gpuslice", claim, "-n", TEAM)["metadata"]["uid"]
    gpus = SimulatedBackend(SIM_BACKEND.removeprefix("sim:").split("x")[0], count=2, host=node.name,
                            state_file=str(node.node_dir / "var/lib/mig-operator/simulated-gpus.json"))

    def health() -> list[tuple[str, str, str, str]]:
        container = (get(node, "pod", "sick", "-n", TEAM)["status"].get("containerStatuses") or [{}])[0]
        return [(r["name"], h["resourceID"], h.get("health", ""), h.get("message", ""))
                for r in container.get("allocatedResourcesStatus") or () for h in r.get("resources") or ()]

    device = f"gpu.cdmo.io/slice={uid}"
    wait_for(lambda: [h[:3] for h in health()] == [(name, device, "Healthy")], 120,
             lambda: f"the pod's device Healthy: {health()}")
    gpus.inject_xid(status["gpu"], 79)
    wait_for(lambda: [h[:3] for h in health()] == [(name, device, "Unhealthy")], 120,
             lambda: f"the pod's device Unhealthy: {health()}")
    assert "Xid 79" in health()[0][3], health()
    gpus.reset_gpu(status["gpu"])
    wait_for(lambda: [h[:3] for h in health()] == [(name, device, "Healthy")], 120,
             lambda: f"the pod's device Healthy again: {health()}")
    node.kubectl("delete", "pod", "sick", "-n", TEAM, "--wait=true")


# ---- uninstall -----------------------------------------------------------------------------------

CLUSTER_KINDS = ("clusterroles", "clusterrolebindings", "mutatingwebhookconfigurations",
                 "validatingwebhookconfigurations", "validatingadmissionpolicies",
                 "validatingadmissionpolicybindings", "deviceclasses", "clusterkopfpeerings", "priorityclasses")
NAMESPACED_KINDS = "all,secrets,configmaps,serviceaccounts,roles,rolebindings,resourcequotas,poddisruptionbudgets"


def test_helm_uninstall_leaves_only_what_the_docs_say(release: RealNode) -> None:
    node = release
    # docs/operations.md, "Uninstall": workloads and slices first, while the operator runs.
    node.kubectl("delete", "pods", "--all", "-n", TEAM, "--wait=true")
    node.kubectl("delete", "gs", "--all", "-A", "--wait=true", timeout=180)
    node.helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "3m")
    wait_for(lambda: not node.kubectl("get", "pods", "-n", RELEASE_NS, "-o", "name").stdout.strip(), 120,
             "the release's pods to go")
    left = set(node.kubectl("get", NAMESPACED_KINDS, "-n", RELEASE_NS, "-o", "name").stdout.split())
    # Step 3 of the guide removes the controller's certificate Secret by hand; the rest is Kubernetes' own.
    assert left == {f"secret/{RELEASE}-webhook-cert", "configmap/kube-root-ca.crt", "serviceaccount/default"}, left
    for kind in CLUSTER_KINDS:
        names = node.kubectl("get", kind, "-o", "name").stdout.split()
        assert not [n for n in names if RELEASE in n or "cdmo" in n], f"{kind} left: {names}"
    # The CRDs stay (the operator's are kept on uninstall, Helm never deletes a chart's crds/), with the
    # GpuNode the agent published (step 4 of the guide deletes both).
    assert get(node, "gpunode", node.name)
    chart_crds = {f"customresourcedefinition.apiextensions.k8s.io/{doc['metadata']['name']}"
                  for path in [*(CHART_DIR / "crds").glob("*.yaml"), *(CHART_DIR / "files" / "crds").glob("*.yaml")]
                  for doc in yaml.safe_load_all(path.read_text())
                  if doc and doc.get("kind") == "CustomResourceDefinition"}
    assert len(chart_crds) == 5
    assert chart_crds <= set(node.kubectl("get", "crds", "-o", "name").stdout.split())
    assert not node.kubectl("get", "resourceclaims", "-A", "-o", "name").stdout.strip()
    # The kubelet withdraws the devices of a driver whose plugin is gone (after its grace period).
    wait_for(lambda: not [r for r in get(node, "resourceslices")["items"] if r["spec"]["driver"] == "gpu.cdmo.io"],
             120, "the agent's ResourceSlices to go")
    # On the node: every claim unprepared (no CDI spec left); the state dir stays (step 5 is optional).
    assert not list(Path(node.settings["NODE_CDI_DIR"]).iterdir())
    assert (node.node_dir / "var/lib/mig-operator/shim/libgpuslice.so").exists()


# ---- upgrade -------------------------------------------------------------------------------------

UPGRADE_BACKEND = "sim:h100-80gbx3"  # GPU 0 MIG, GPU 1 shared fractions, GPU 2 compute shares


def release_pods(node: RealNode) -> dict[str, tuple[str, str]]:
    """The release's pods: name -> (component, image)."""
    items = get(node, "pods", "-n", RELEASE_NS)["items"]
    return {p["metadata"]["name"]: (p["metadata"]["labels"].get("app.kubernetes.io/component", ""),
                                    p["spec"]["containers"][0]["image"]) for p in items
            if p["metadata"].get("deletionTimestamp") is None}


def container_identity(node: RealNode, name: str) -> tuple[str, int, str]:
    """The container's ID, restart count, and its first process's start time (field 22 of /proc/1/stat):
    the same three after an upgrade means the same process, never restarted."""
    pod = get(node, "pod", name, "-n", TEAM)
    status = pod["status"]["containerStatuses"][0]
    stat = node.kubectl("exec", name, "-n", TEAM, "--", "cat", "/proc/1/stat").stdout
    return status["containerID"], status["restartCount"], stat.rsplit(")", 1)[1].split()[19]


def exec_probe(node: RealNode, name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    argv = ["env", *(f"{k}={v}" for k, v in (env or {}).items()), "python3", "-c", PROBE]
    out = node.kubectl("exec", name, "-n", TEAM, "--", *argv).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("PROBE ")).removeprefix("PROBE "))


def mps_view(node: RealNode, name: str) -> tuple[dict[str, str], str]:
    """A compute share's MPS variables, and the PID file of the daemon whose pipe directory its CDI spec
    mounted at /tmp/nvidia-mps."""
    env = node.kubectl("exec", name, "-n", TEAM, "--", "env").stdout
    mps_env = dict(line.split("=", 1) for line in env.splitlines() if line.startswith("CUDA_MPS_"))
    pid = node.kubectl("exec", name, "-n", TEAM, "--", "cat", "/tmp/nvidia-mps/nvidia-cuda-mps-control.pid").stdout
    return mps_env, pid.strip()


def test_helm_upgrade_with_every_pod_replaced_keeps_running_containers(real_node: RealNode,
                                                                       tmp_path: Path) -> None:
    """docs/operations.md, "Upgrade": a release (its own state directory, three simulated GPUs) runs a MIG
    pod, a fraction pod and two compute-share pods; `helm upgrade` to the same image under a new tag
    replaces the controller, webhook and agent pods and leaves the MPS host pod (OnDelete); every
    container keeps its process, its devices, its limit and its MPS daemon, and new slices work after."""
    node = real_node
    repository, tag = node.images["OPERATOR_IMAGE"].rsplit(":", 1)
    new_tag = f"{tag}-upgraded"
    tagged = node.ctr("images", "tag", "--force", node.images["OPERATOR_IMAGE"], f"{repository}:{new_tag}")
    assert tagged.returncode == 0, tagged.stderr
    state = node.node_dir / "var/lib/mig-upgrade"
    state.mkdir(parents=True, exist_ok=True)
    gpus = [{"mig_enabled": enabled, "generation": 0, "instances": []} for enabled in (True, False, False)]
    (state / "simulated-gpus.json").write_text(json.dumps(
        {"version": 1, "model": UPGRADE_BACKEND.removeprefix("sim:").split("x")[0], "gpus": gpus,
         "faults": {}, "latency_s": {}}))
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "controller": {"replicas": 1},
        "webhook": {"replicas": 1},
        "agent": {"backend": UPGRADE_BACKEND, "stateDir": str(state), "kubeletDir": f"{node.node_dir}/kubelet",
                  "cdiDir": node.settings["NODE_CDI_DIR"], "runtimeClassName": "", "toolkitConfig": ""},
        "shim": {"hostDir": f"{state}/shim"},
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    node.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite")
    node.kubectl("create", "namespace", TEAM, check=False)
    node.helm("install", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--create-namespace",
              "--values", str(path), "--wait", "--timeout", "5m")
    wait_for(lambda: len((get(node, "gpunode", node.name) or {}).get("status", {}).get("gpus") or []) == 3, 120,
             "the agent's GpuNode with three GPUs")
    wait_for(lambda: (get(node, "mutatingwebhookconfiguration", RELEASE) or {}).get("webhooks", [{}])[0]
             .get("clientConfig", {}).get("caBundle"), 120, "the operator to patch its CA into the webhook")
    chunk = 10**9
    # The MIG pod on GPU 0 while the node is labelled for MIG; then fractions only (GPUs 1 and 2).
    node.kubectl("label", "node", node.name, f"{MIG_LABEL}=mig", "--overwrite")
    run_pod(node, probe_pod(node, "up-mig", annotations={"cdmo.io/mig-profile": MIG_PROFILE}, wait=True),
            until="Running")
    node.kubectl("label", "node", node.name, f"{MIG_LABEL}-")
    run_pod(node, probe_pod(node, "up-fraction", annotations={"cdmo.io/gpu-memory": "2G"},
                            env=fake_cuda_env(node, chunk), wait=True), until="Running")
    for name, share in (("up-compute-a", "0.25"), ("up-compute-b", "0.5")):
        run_pod(node, probe_pod(node, name, annotations={"cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-compute": share},
                                wait=True), until="Running")
    views = {name: wait_for_probe(node, name) for name in ("up-mig", "up-fraction", "up-compute-a", "up-compute-b")}
    assert views["up-fraction"]["alloc"]["results"] == [0, 0, 2], views["up-fraction"]["alloc"]
    slices = {name: get(node, "gpuslice", get(node, "pod", name, "-n", TEAM)["spec"]["resourceClaims"][0]
                        ["resourceClaimName"], "-n", TEAM)["status"] for name in views}
    assert slices["up-mig"]["mode"] == "mig" and slices["up-fraction"]["mode"] == "fraction"
    assert slices["up-compute-a"]["gpu"] == slices["up-compute-b"]["gpu"] != slices["up-fraction"]["gpu"]
    compute_uuid = slices["up-compute-a"]["deviceUUID"]
    pid_file = state / "simulated-gpus.json.mps" / compute_uuid / "pipe" / "nvidia-cuda-mps-control.pid"

    def daemon() -> tuple[int, str, str]:
        """The GPU's daemon as the MPS host pod sees it (its PID namespace): PID, start time, and its
        answer to get_default_active_thread_percentage (the stand-in's client, in that pod)."""
        pid = int(pid_file.read_text())
        host = next(n for n, (c, _) in release_pods(node).items() if c == "mps")
        assert "mps_standin" in node.kubectl("exec", "-n", RELEASE_NS, host, "--", "cat",
                                             f"/proc/{pid}/cmdline").stdout
        stat = node.kubectl("exec", "-n", RELEASE_NS, host, "--", "cat", f"/proc/{pid}/stat").stdout
        answer = node.kubectl("exec", "-i", "-n", RELEASE_NS, host, "--", "env",
                              f"CUDA_MPS_PIPE_DIRECTORY={pid_file.parent}", "python3", "-m",
                              "mig_operator.gpu.mps_standin", input="get_default_active_thread_percentage\n").stdout
        return pid, stat.rsplit(")", 1)[1].split()[19], answer.strip()

    daemon_before = daemon()
    identities = {name: container_identity(node, name) for name in views}
    mps_before = {name: mps_view(node, name) for name in ("up-compute-a", "up-compute-b")}
    assert mps_before["up-compute-a"][0]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert mps_before["up-compute-b"][0]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert mps_before["up-compute-a"][1] == mps_before["up-compute-b"][1] == str(daemon_before[0])
    assert daemon_before[2] == "50.0"  # the GPU's largest share, held by its daemon
    pods_before = release_pods(node)
    assert sorted(c for c, _ in pods_before.values()) == ["agent", "controller", "mps", "webhook"], pods_before

    # Helm 4's default --wait (kstatus) would wait for the MPS host pod, which OnDelete never replaces;
    # the legacy waiter (Helm 3's) passes an OnDelete DaemonSet (docs/operations.md, "Upgrade").
    node.helm("upgrade", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--reset-then-reuse-values",
              "--set", f"image.tag={new_tag}", "--wait=legacy", "--timeout", "5m")

    def replaced() -> dict[str, tuple[str, str]] | None:
        now = release_pods(node)
        parts = {c: (n, image) for n, (c, image) in now.items()}
        if len(now) != 4 or any(parts[c][1].endswith(f":{new_tag}") is False for c in ("agent", "controller",
                                                                                          "webhook")):
            return None
        ready = all(pod_phase(node, RELEASE_NS, n) == "Running" for n in now)
        return now if ready else None

    after = wait_for(replaced, 300, lambda: f"the release's new pods: {release_pods(node)}")
    for name, (component, image) in after.items():
        if component == "mps":  # OnDelete: the MPS host stays, with its daemons
            assert name in pods_before and image.endswith(f":{tag}"), (name, image)
        else:
            assert name not in pods_before and image.endswith(f":{new_tag}"), (name, image)
    mps_set = get(node, "daemonset", f"{RELEASE}-mps", "-n", RELEASE_NS)
    assert mps_set["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{new_tag}")
    # The new agent adopts what runs (its record, the instances, the MPS daemon).
    wait_for(lambda: "adopted" in agent_logs(node), 120, "the new agent to adopt the MPS daemon")

    for name in views:
        assert container_identity(node, name) == identities[name], name
    again = exec_probe(node, "up-mig")
    assert again["devices"] == views["up-mig"]["devices"] and again["env"] == views["up-mig"]["env"]
    again = exec_probe(node, "up-fraction", fake_cuda_env(node, chunk))
    assert again["devices"] == views["up-fraction"]["devices"] and again["env"] == views["up-fraction"]["env"]
    assert again["alloc"]["results"] == [2], again["alloc"]  # the running process still holds the whole 2G
    for name in ("up-compute-a", "up-compute-b"):
        assert exec_probe(node, name)["devices"] == views[name]["devices"]
        assert mps_view(node, name) == mps_before[name], name
    assert daemon() == daemon_before

    # New slices work after: a fraction beside the running one, a compute share beside the running two.
    run_pod(node, probe_pod(node, "up-new-fraction", annotations={"cdmo.io/gpu-memory": "2G"},
                            env=fake_cuda_env(node, chunk)))
    assert probe_output(node, TEAM, "up-new-fraction")["alloc"]["results"] == [0, 0, 2]
    run_pod(node, probe_pod(node, "up-new-compute", annotations={"cdmo.io/gpu-memory": "2G",
                                                                 "cdmo.io/gpu-compute": "0.25"}, wait=True),
            until="Running")
    assert mps_view(node, "up-new-compute")[1] == str(daemon_before[0])
    assert daemon() == daemon_before

    node.kubectl("delete", "pods", "--all", "-n", TEAM, "--wait=true")
    node.kubectl("delete", "gs", "--all", "-A", "--wait=true", timeout=180)
    node.helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "3m")
