"""The real kubelet code drives the real agent over its real sockets: a control plane with the
hollow node (`scripts/control-plane up --with ...,hollow-node`), the agent on a simulated GPU as
that node's DRA driver, and the controller. kube-scheduler reserves the slice's claim (the controller allocated it), the
kubelet registers the agent's plugin and calls NodePrepareResources / NodeUnprepareResources, and
the CDI spec the agent writes is checked with the official CDI library (tools/cdi-validate)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cluster import KubeCluster
from harness import MIG_LABEL, REPO_ROOT, apply_crds, wait_until
from kubernetes.client.rest import ApiException

CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"
NODE = "hollow-agent"
NAMESPACE = "notebooks"
# The device nodes every slice's container gets (issue 16, item 5), besides its GPU's /dev/nvidiaN.
COMMON_NODES = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}


@dataclass
class HollowSetup:
    """A control plane with a hollow node, and the operator's processes started against it."""

    cluster: KubeCluster
    settings: dict[str, str]
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def cdi_dir(self) -> Path:
        return self.workdir / "cdi"

    def start(self, name: str, *args: str) -> None:
        log = (self.workdir / f"{name}.log").open("a")
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig), PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", *args], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)

    def start_agent(self) -> None:
        # Exactly the directories `scripts/control-plane env` names for this node's kubelet.
        self.start("agent", "agent", "--node", NODE, "--backend", "sim:a100-40gb",
                   "--state-file", str(self.workdir / "gpus.json"),
                   "--kubelet-registry-dir", self.settings["PLUGIN_REGISTRY_DIR"],
                   "--kubelet-plugin-dir", f"{self.settings['KUBELET_PLUGINS_DIR']}/gpu.cdmo.io",
                   "--cdi-dir", str(self.cdi_dir))

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def logs(self) -> str:
        parts = [f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:])
                 for path in sorted(self.workdir.glob("*.log"))]
        kubelet_log = Path(self.settings["STATE_DIR"]) / "logs" / "hollow-node.log"
        lines = [line for line in kubelet_log.read_text(errors="replace").splitlines() if "dra" in line.lower()]
        return "\n".join([*parts, "--- hollow-node (DRA lines)", *lines[-25:]])

    def claim(self, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.kubectl("get", "resourceclaim", name, "-n", NAMESPACE, "-o", "json").stdout)


@pytest.fixture
def hollow(tmp_path: Path) -> Iterator[HollowSetup]:
    # A short state dir: the agent's sockets go under it, and a unix socket path has 107 bytes.
    # A subdir, so that the script's lock file (beside the state dir) goes away with the parent.
    parent = Path(tempfile.mkdtemp(prefix="mo-hn-"))
    state = parent / "s"
    env = dict(os.environ, MIG_OPERATOR_RUN=str(state), MIG_OPERATOR_HOLLOW_NODE=NODE,
               MIG_OPERATOR_HOLLOW_NODE_LABELS=f"{MIG_LABEL}=mig,kubernetes.io/hostname={NODE}")

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(CONTROL_PLANE), *args], env=env, capture_output=True, text=True, timeout=600)

    up = script("up", "--with", "scheduler,controller-manager,hollow-node")
    setup = None
    try:
        assert up.returncode == 0, f"up failed:\n{up.stderr[-4000:]}"
        settings = dict(line.split("=", 1) for line in script("env").stdout.splitlines() if "=" in line)
        cluster = KubeCluster(kubeconfig=Path(up.stdout.strip().splitlines()[-1].removeprefix("KUBECONFIG=")),
                              bin_dir=Path(settings["BIN_DIR"]), k8s_version=settings["K8S_VERSION"],
                              running=frozenset())
        apply_crds(cluster)
        setup = HollowSetup(cluster, settings, tmp_path)
        setup.cdi_dir.mkdir()
        setup.start_agent()
        setup.start("controller", "controller", "--resync", "5s")
        yield setup
    finally:
        if setup is not None:
            for name in list(setup.procs):
                setup.kill(name)
            if setup.cluster._api_client is not None:
                setup.cluster._api_client.close()
        down = script("down")
        shutil.rmtree(parent, ignore_errors=True)
        assert down.returncode == 0, down.stderr


def claimed_pod(name: str, claim: str) -> dict[str, Any]:
    """A pod of the notebook kind: it names the slice's claim itself (issue 16, item 2)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                     "containers": [{"name": "main", "image": "fake", "resources": {"claims": [{"name": "gpu"}]}}]}}


@pytest.mark.compat
def test_kubelet_prepares_and_unprepares_through_the_agent(hollow: HollowSetup, cdi_validate: Path) -> None:
    core = hollow.cluster.core_v1()
    kubectl = hollow.cluster.kubectl
    kubectl("create", "namespace", NAMESPACE)
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "nb", "namespace": NAMESPACE},
        "spec": {"migProfile": "2g.10gb"}}))

    def claim_written() -> bool:
        return kubectl("get", "resourceclaim", "nb", "-n", NAMESPACE, check=False).returncode == 0

    wait_until(claim_written, 60, lambda: f"the slice's ResourceClaim\n{hollow.logs()}")

    def spec_files() -> list[Path]:
        return sorted(hollow.cdi_dir.glob("*"))

    def pod_running(name: str) -> bool:
        return core.read_namespaced_pod(name, NAMESPACE).status.phase == "Running"

    def pod_gone(name: str) -> bool:
        try:
            core.read_namespaced_pod(name, NAMESPACE)
        except ApiException as error:
            return error.status == 404
        return False

    # Twice: prepare after an unprepare works as the first time (the notebook's pod restarts).
    for round_ in range(2):
        pod = f"nb-{round_}"
        kubectl("apply", "-f", "-", input=json.dumps(claimed_pod(pod, "nb")))
        wait_until(lambda pod=pod: pod_running(pod), 60,
                   lambda pod=pod: f"pod {pod} to run on {NODE}\n{hollow.logs()}")
        assert core.read_namespaced_pod(pod, NAMESPACE).spec.node_name == NODE
        claim = hollow.claim("nb")
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == ("gpu.cdmo.io", NODE)
        assert [r["name"] for r in claim["status"]["reservedFor"]] == [pod]
        device_id = f"gpu.cdmo.io/slice={result['device']}"

        # The kubelet recorded what NodePrepareResources returned: the agent's CDI device ID.
        checkpoint = json.loads(json.loads(
            (Path(hollow.settings["KUBELET_DIR"]) / "dra_manager_state").read_text())["Data"])
        [claim_state] = checkpoint["ClaimInfoStateList"]
        [device_state] = claim_state["DriverState"]["gpu.cdmo.io"]["Devices"]
        assert device_state["CDIDeviceIDs"][0] == device_id

        # The spec the agent wrote passes the CDI library and gives the slice's GPU, nothing wider.
        [spec_path] = spec_files()
        checked = subprocess.run([str(cdi_validate), "--cdi-dir", str(hollow.cdi_dir), device_id],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stderr
        applied = json.loads(checked.stdout)
        assert "NVIDIA_VISIBLE_DEVICES=void" in applied["env"]
        written = json.loads(spec_path.read_text())
        [device] = written["devices"]
        written_nodes = device["containerEdits"]["deviceNodes"]
        assert [n["path"] for n in applied["deviceNodes"]] == [n["path"] for n in written_nodes]
        paths = {n["path"] for n in applied["deviceNodes"]}
        assert COMMON_NODES <= paths and "/dev/nvidia0" in paths
        caps = [p for p in paths if p.startswith("/dev/nvidia-caps/")]
        assert len(caps) == 2, paths  # the GPU instance's and the compute instance's
        assert len(paths) == len(COMMON_NODES) + 1 + 2

        core.delete_namespaced_pod(pod, NAMESPACE)
        wait_until(lambda pod=pod: pod_gone(pod), 60, lambda pod=pod: f"pod {pod} to be deleted\n{hollow.logs()}")
        assert spec_files() == []  # NodeUnprepareResources removed it
        assert not hollow.claim("nb")["status"].get("reservedFor")

    # An agent SIGKILLed while the pod holds the claim: the kubelet cannot unprepare, so the pod
    # stays; once the agent is back (same record, new sockets), the kubelet unprepares and it goes.
    kubectl("apply", "-f", "-", input=json.dumps(claimed_pod("nb-killed", "nb")))
    wait_until(lambda: pod_running("nb-killed"), 60, lambda: f"pod nb-killed to run\n{hollow.logs()}")
    hollow.kill("agent")
    core.delete_namespaced_pod("nb-killed", NAMESPACE)
    with pytest.raises(pytest.fail.Exception):
        wait_until(lambda: pod_gone("nb-killed"), 5, "(expected to time out)")
    assert len(spec_files()) == 1
    hollow.start_agent()
    wait_until(lambda: pod_gone("nb-killed"), 60, lambda: f"pod nb-killed to be deleted\n{hollow.logs()}")
    assert spec_files() == []


def test_a_claim_of_another_namespace_never_gets_the_slices_device(hollow: HollowSetup) -> None:
    """Issue 24: a claim in another namespace whose selector names this slice's namespace (here written
    by the cluster admin: the chart's admission policy refuses tenants' claims of this class). The
    controller allocated the slice's own claim as soon as the slice was Ready, so kube-scheduler never
    gives the device to the thief's claim. Even allocated to it (written here by the admin, as a
    compromised component could), the agent is the last line: the kubelet asks it to prepare the claim,
    it refuses with a reason the pod's events show, writes no CDI spec, and the slice's own claim is
    then prepared for the slice's own pod."""
    core = hollow.cluster.core_v1()
    kubectl = hollow.cluster.kubectl
    thieves = "team-b"
    for ns in (NAMESPACE, thieves):
        kubectl("create", "namespace", ns)
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "nb", "namespace": NAMESPACE},
        "spec": {"migProfile": "2g.10gb"}}))
    wait_until(lambda: kubectl("get", "resourceclaim", "nb", "-n", NAMESPACE, check=False).returncode == 0, 60,
               lambda: f"the slice's ResourceClaim\n{hollow.logs()}")
    slice_uid = json.loads(kubectl("get", "gs", "nb", "-n", NAMESPACE, "-o", "json").stdout)["metadata"]["uid"]
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "steal", "namespace": thieves},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpuslice.cdmo.io", "selectors": [{"cel": {"expression":
                f'device.attributes["gpu.cdmo.io"].sliceNamespace == "{NAMESPACE}"'}}]}}]}}}))
    thief = claimed_pod("thief", "steal")
    thief["metadata"]["namespace"] = thieves
    kubectl("apply", "-f", "-", input=json.dumps(thief))

    # The slice's device is allocated to its own claim already: kube-scheduler finds nothing for the thief.
    def unschedulable() -> bool:
        pod = core.read_namespaced_pod("thief", thieves)
        return any(c.type == "PodScheduled" and c.status == "False" for c in pod.status.conditions or ())

    wait_until(unschedulable, 60, lambda: f"the thief pod to be found unschedulable\n{hollow.logs()}")
    time.sleep(3)  # a scheduling retry changes nothing
    steal = json.loads(kubectl("get", "resourceclaim", "steal", "-n", thieves, "-o", "json").stdout)
    assert "allocation" not in (steal.get("status") or {}), steal["status"]
    assert not core.read_namespaced_pod("thief", thieves).spec.node_name

    # Allocated to the thief all the same, by hand (written independently of the operator's code), with
    # the timestamp an allocator writes (from 1.36 kube-scheduler's reservation would otherwise stamp the
    # immutable allocation and be refused, and the pod would never reach the kubelet).
    stolen = {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": NODE, "device": slice_uid}]},
              "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                  {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
              "allocationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    kubectl("patch", "resourceclaim", "steal", "-n", thieves, "--subresource=status", "--type=merge", "-p",
            json.dumps({"status": {"allocation": stolen}}))

    def refusal() -> str | None:
        events = core.list_namespaced_event(thieves, field_selector="involvedObject.name=thief").items
        return next((e.message for e in events if "belongs to GpuSlice" in (e.message or "")), None)

    message = wait_until(refusal, 60, lambda: f"the thief pod's FailedPrepare event\n{hollow.logs()}")
    steal = json.loads(kubectl("get", "resourceclaim", "steal", "-n", thieves, "-o", "json").stdout)
    [result] = steal["status"]["allocation"]["devices"]["results"]
    assert result["device"] == slice_uid, "the thief's claim names the slice's device"
    assert f"ResourceClaim {thieves}/steal" in message and f"device gpu.cdmo.io/{NODE}/{slice_uid}" in message
    assert f"belongs to GpuSlice {NAMESPACE}/nb (uid {slice_uid})" in message, message
    assert core.read_namespaced_pod("thief", thieves).status.phase != "Running"
    assert sorted(hollow.cdi_dir.glob("*")) == []

    # The thief gives up: its claim is deallocated, and the slice's own pod gets the device.
    kubectl("delete", "pod", "thief", "-n", thieves, "--grace-period=0", "--force", "--wait=true")
    kubectl("delete", "resourceclaim", "steal", "-n", thieves, "--wait=true", "--timeout=60s")
    kubectl("apply", "-f", "-", input=json.dumps(claimed_pod("owner", "nb")))

    def owner_running() -> bool:
        return core.read_namespaced_pod("owner", NAMESPACE).status.phase == "Running"

    wait_until(owner_running, 90, lambda: f"the slice's own pod to run\n{hollow.logs()}")
    assert [p.name for p in hollow.cdi_dir.glob("*")] == [f"gpu.cdmo.io-slice_{slice_uid}.json"]
