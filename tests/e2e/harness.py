"""Running the operator for real in e2e tests: kwok nodes, agents on the simulator, a controller.

Every part runs as its own process (``python -m mig_operator.cli controller|agent``) against the
session's kube-apiserver, exactly as in a cluster; the simulator's state files are where the test
looks at the "GPUs" from outside. ``check_invariants`` is the one checker every crash test uses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from mig_operator.core.placement.profiles import get_model
from mig_operator.gpu.simulated import SimulatedBackend

REPO_ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, SLICES, NODES = "cdmo.io", "v1alpha1", "gpuslices", "gpunodes"
MIG_LABEL = "cdmo.clear.ml/gpu-partitioning"
AGENT_FINALIZER = "cdmo.io/agent"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def wait_until(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str],
               interval: float = 0.1) -> Any:
    """Poll until ``predicate`` returns something truthy; fail naming ``what`` (a string or a function
    that describes the state at the time, for a useful failure message)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            pytest.fail(f"timed out after {timeout} s waiting for {text}", pytrace=False)
        time.sleep(interval)


def log_end(log: Path) -> int:
    """Where a part's log ends now: the offset ``wait_for_log`` reads from."""
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


def wait_for_log(log: Path, pattern: str, after: int = 0, timeout: float = 30, count: int = 1) -> list[str]:
    """Until ``count`` lines written to ``log`` past offset ``after`` match ``pattern`` (a regular
    expression): the sign that a part did what might change things (a re-look, a watch event), after
    which a test checks once that nothing changed."""
    found = re.compile(pattern)

    def matched() -> list[str]:
        with log.open("rb") as f:
            f.seek(after)
            lines = [line for line in f.read().decode(errors="replace").splitlines() if found.search(line)]
        return lines if len(lines) >= count else []

    return wait_until(matched, timeout, lambda: f"{count} line(s) matching {pattern!r} in {log.name} past offset "
                      f"{after}; its end:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))


def apply_crds(cluster: Any) -> None:
    for path in sorted((REPO_ROOT / "crds").glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/gpuslices.cdmo.io",
                    "crd/gpunodes.cdmo.io", "crd/clusterkopfpeerings.kopf.dev")
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "gs", "-A", check=False).returncode != 0:
        assert time.monotonic() < deadline, "gpuslices never became usable"
        time.sleep(0.3)


@dataclass
class SimNode:
    """A kwok node with an agent on simulated GPUs."""

    name: str
    model: str
    count: int
    labelled: bool
    state_file: Path

    @property
    def backend_spec(self) -> str:
        return f"sim:{self.model}x{self.count}" if self.count > 1 else f"sim:{self.model}"

    def backend(self) -> SimulatedBackend:
        """The node's GPUs as the test sees them from outside (the same state file the agent uses)."""
        return SimulatedBackend(self.model, count=self.count, state_file=str(self.state_file), host=self.name)

    @property
    def record_file(self) -> Path:
        return Path(f"{self.state_file}.owners.json")

    def record(self) -> dict:
        try:
            return json.loads(self.record_file.read_text())
        except FileNotFoundError:
            return {}


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class OperatorHarness:
    cluster: Any
    workdir: Path
    nodes: dict[str, SimNode] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    peering: str = field(default_factory=lambda: unique("e2e"))
    webhook_config: str = field(default_factory=lambda: unique("e2e-webhook"))
    webhook_port: int = 0
    # Part ("controller", "agent") -> kubeconfig it runs with; default the session's (cluster admin).
    # Filled with the chart's ServiceAccounts' credentials to prove their RBAC (tests/e2e/conftest.py).
    kubeconfigs: dict[str, Path] = field(default_factory=dict)
    # A restarted kube-apiserver refuses calls (403) until its RBAC caches are filled: a test that
    # restarts it sets this, and the refusals its parts logged meanwhile do not fail it.
    api_server_restarted: bool = False

    def __post_init__(self) -> None:
        # The session's cluster is the tests' own: an inventory left by an earlier (killed) run would
        # offer GPUs no agent serves, and a slice left by an earlier test (its namespace still being
        # deleted) would be bound by this test's controller, so every test starts with neither.
        for body in self.custom.list_cluster_custom_object(GROUP, VERSION, NODES)["items"]:
            try:
                self.custom.delete_cluster_custom_object(GROUP, VERSION, NODES, body["metadata"]["name"])
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for body in self.custom.list_cluster_custom_object(GROUP, VERSION, SLICES)["items"]:
            meta = body["metadata"]
            try:
                if meta.get("finalizers"):
                    self.custom.patch_namespaced_custom_object(GROUP, VERSION, meta["namespace"], SLICES,
                                                               meta["name"], {"metadata": {"finalizers": None}})
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, meta["namespace"], SLICES, meta["name"])
            except ApiException as exc:
                if exc.status != 404:
                    raise
        wait_until(lambda: not self.custom.list_cluster_custom_object(GROUP, VERSION, SLICES)["items"], 30,
                   "slices of earlier tests to be gone")

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return self.cluster.custom_objects()

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return self.cluster.core_v1()

    # ---- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}-{len(self.procs)}.log"
        full_env = {k: v for k, v in os.environ.items() if k != "MIG_OPERATOR_CRASHPOINT"}
        # The webhook runs as the controller's ServiceAccount, as in the chart.
        part = "controller" if args[0] == "webhook" else args[0]
        kubeconfig = self.kubeconfigs.get(part, self.cluster.kubeconfig)
        full_env.update(KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1", **(env or {}))
        proc = Proc(name, [sys.executable, "-m", "mig_operator.cli", *args], log, full_env)
        self.start(proc)
        self.procs.append(proc)
        return proc

    def start(self, proc: Proc, env: Mapping[str, str] | None = None) -> Proc:
        """(Re)start a process; ``env`` replaces the crash point setting of the last run."""
        if env is not None:
            proc.env = {k: v for k, v in proc.env.items() if k != "MIG_OPERATOR_CRASHPOINT"} | dict(env)
        with proc.log.open("a") as out:
            proc.popen = subprocess.Popen(proc.args, env=proc.env, stdout=out, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, start_new_session=True)
        return proc

    def controller(self, env: Mapping[str, str] | None = None, *args: str) -> Proc:
        # A peering of its own: a controller SIGKILLed by an earlier test cannot keep this one paused.
        return self._spawn("controller", ["controller", "--resync", "5s", "--peering", self.peering, *args], env)

    def controller_with_webhook(self, env: Mapping[str, str] | None = None, *args: str) -> Proc:
        """A controller that also serves the pod webhook on a free loopback port, with a webhook
        configuration of this test's own (deleted at the end, so a stopped test leaves none behind)."""
        if not self.webhook_port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.webhook_port = sock.getsockname()[1]
        return self.controller(env, "--webhook", f"127.0.0.1:{self.webhook_port}", "--webhook-config",
                               self.webhook_config, "--namespace", "mig-operator-system", *args)

    def webhook(self, env: Mapping[str, str] | None = None, *args: str) -> Proc:
        """``mig-operator webhook`` alone (as the chart runs it), on the port and with the configuration
        ``controller_with_webhook`` would use."""
        if not self.webhook_port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.webhook_port = sock.getsockname()[1]
        return self._spawn("webhook", ["webhook", "--webhook", f"127.0.0.1:{self.webhook_port}", "--webhook-config",
                                       self.webhook_config, "--namespace", "mig-operator-system", *args], env)

    def wait_webhook(self, timeout: float = 30) -> None:
        """Until the webhook configuration exists and the server answers."""
        admission = kubernetes.client.AdmissionregistrationV1Api(self.cluster.api_client)

        def ready() -> bool:
            try:
                admission.read_mutating_webhook_configuration(self.webhook_config)
            except ApiException:
                return False
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", self.webhook_port)) == 0

        wait_until(ready, timeout, lambda: f"the webhook on port {self.webhook_port}\n{self.logs()}")

    def agent(self, node: SimNode, env: Mapping[str, str] | None = None, *args: str) -> Proc:
        """The node's agent, with its MPS host beside it (``mps_host``), as the chart runs them."""
        self.mps_host(node)
        return self._spawn(f"agent-{node.name}", [
            "agent", "--node", node.name, "--backend", node.backend_spec, "--state-file", str(node.state_file),
            "--nvml-attempts", "3", *args,
        ], env)

    def process(self, name: str) -> Proc:
        """The last process started under ``name`` (e.g. ``f"agent-{node.name}"``)."""
        return next(p for p in reversed(self.procs) if p.name == name)

    def mps_host(self, node: SimNode) -> Proc:
        """``mig-operator mps-host`` of the node (its MPS directory beside the simulator's state, where
        the agent looks): the one running, else a new one."""
        running = next((p for p in self.procs if p.name == f"mps-host-{node.name}" and p.alive), None)
        return running or self._spawn(f"mps-host-{node.name}", ["mps-host", "--backend", node.backend_spec,
                                                                "--mps-dir", f"{node.state_file}.mps"])

    def start_operator(self, *nodes: SimNode, webhook: bool | str = False) -> None:
        """An agent per node, each GpuNode published, then the controller (with the webhook, if asked;
        ``webhook="process"``: the webhook in a process of its own, as the chart runs it)."""
        for node in nodes:
            self.agent(node)
        for node in nodes:
            self.wait_gpunode(node)
        if webhook == "process":
            self.controller()
            self.webhook()
            self.wait_webhook()
        elif webhook:
            self.controller_with_webhook()
            self.wait_webhook()
        else:
            self.controller()

    def kill(self, proc: Proc) -> None:
        """SIGKILL: no cleanup runs, as on a node losing power."""
        if proc.alive:
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(10)

    def stop(self, proc: Proc) -> None:
        if proc.alive:
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)

    def wait_exit(self, proc: Proc, timeout: float = 30) -> int:
        assert proc.popen is not None
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.name} did not exit within {timeout} s:\n{proc.tail()}", pytrace=False)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log.name})\n{p.tail(25)}" for p in self.procs)

    # ---- nodes -------------------------------------------------------------------------------

    def add_node(self, model: str, count: int = 1, labelled: bool = True, mig: bool | None = None,
                 name: str | None = None, labels: Mapping[str, str] | None = None,
                 allocatable: Mapping[str, str] | None = None) -> SimNode:
        """A kwok Node plus the simulator state of its GPUs (MIG enabled unless ``mig`` is False;
        models without MIG never have it); ``allocatable`` (also its capacity) is written with the Node,
        as a kubelet registers it, and kwok keeps it (else kwok's 1k CPUs)."""
        name = name or unique(model.split("-")[0])
        node = SimNode(name, model, count, labelled, self.workdir / f"{name}.json")
        backend = node.backend()
        if mig is False:
            for gpu in backend.gpus():
                if gpu.mig_enabled:
                    backend.set_mig_mode(gpu.index, False)
        all_labels = {"type": "kwok", "kubernetes.io/hostname": name, **(labels or {})}
        if labelled:
            all_labels[MIG_LABEL] = "mig"
        self.core.create_node({
            "metadata": {"name": name, "labels": all_labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
            "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
            **({"status": {"allocatable": dict(allocatable), "capacity": dict(allocatable)}} if allocatable else {}),
        })
        self.nodes[name] = node
        return node

    def attach_node(self, name: str, model: str, count: int = 1, labelled: bool = True) -> SimNode:
        """Simulated GPUs for a Node something else made (a node autoscaler), and its agent started, as
        the chart's DaemonSet would start one on a new node."""
        node = SimNode(name, model, count, labelled, self.workdir / f"{name}.json")
        node.backend()  # its GPUs' state, MIG enabled
        self.nodes[name] = node
        self.agent(node)
        return node

    def label(self, node: SimNode, labelled: bool) -> None:
        self.core.patch_node(node.name, {"metadata": {"labels": {MIG_LABEL: "mig" if labelled else None}}})
        node.labelled = labelled

    def gpunode(self, node: SimNode) -> dict | None:
        try:
            return self.custom.get_cluster_custom_object(GROUP, VERSION, NODES, node.name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def wait_gpunode(self, node: SimNode, timeout: float = 30) -> dict:
        return wait_until(lambda: (g := self.gpunode(node)) and g.get("status", {}).get("gpus") and g, timeout,
                          lambda: f"GpuNode {node.name}\n{self.logs()}")

    # ---- slices ------------------------------------------------------------------------------

    def namespace(self) -> str:
        name = unique("op")
        self.core.create_namespace({"metadata": {"name": name}})
        self.namespaces.append(name)
        return name

    def create_slice(self, namespace: str, name: str, spec: Mapping[str, Any]) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name},
                "spec": dict(spec)}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, body)

    def get_slice(self, namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete_slice(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def slices(self, namespace: str | None = None) -> list[dict]:
        if namespace is None:
            found: list[dict] = []
            for ns in self.namespaces:
                found.extend(self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, SLICES)["items"])
            return found
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, SLICES)["items"]

    def wait_phase(self, namespace: str, name: str, phases: str | Iterable[str], timeout: float = 30,
                   reason: str | None = None) -> dict:
        wanted = {phases} if isinstance(phases, str) else set(phases)

        def reached() -> dict | None:
            body = self.get_slice(namespace, name)
            st = (body or {}).get("status") or {}
            if st.get("phase") in wanted and (reason is None or st.get("reason") == reason):
                return body
            return None

        return wait_until(reached, timeout, lambda: (
            f"{namespace}/{name} in {sorted(wanted)}: it is {(self.get_slice(namespace, name) or {}).get('status')}\n"
            f"{self.logs()}"))

    def wait_gone(self, namespace: str, name: str, timeout: float = 30) -> None:
        wait_until(lambda: self.get_slice(namespace, name) is None, timeout,
                   lambda: f"{namespace}/{name} to be deleted\n{self.logs()}")

    # ---- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        # Slices go first, while the agents still run to release them: a slice left behind would be
        # bound by the next test's controller to the next test's GPUs.
        for ns in self.namespaces:
            self.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
            self.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, ns, SLICES)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(self.slices(ns) for ns in self.namespaces):
            time.sleep(0.2)
        for proc in self.procs:
            self.stop(proc)
        for node in self.nodes.values():  # the MPS stand-ins an agent left running (adopted, not stopped)
            for pipe in Path(f"{node.state_file}.mps").glob("*/pipe"):
                subprocess.run([sys.executable, "-m", "mig_operator.gpu.mps_standin"], input="quit\n", text=True,
                               capture_output=True, timeout=30,
                               env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
        if self.webhook_port:
            try:
                kubernetes.client.AdmissionregistrationV1Api(self.cluster.api_client).delete_mutating_webhook_configuration(
                    self.webhook_config)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for ns in self.namespaces:
            for body in self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, SLICES)["items"]:
                if body["metadata"].get("finalizers"):
                    self.custom.patch_namespaced_custom_object(
                        GROUP, VERSION, ns, SLICES, body["metadata"]["name"], {"metadata": {"finalizers": None}})
            try:
                self.core.delete_namespace(ns)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for name in self.nodes:
            for delete in (lambda n: self.custom.delete_cluster_custom_object(GROUP, VERSION, NODES, n),
                           self.core.delete_node):
                try:
                    delete(name)
                except ApiException as exc:
                    if exc.status != 404:
                        raise


def check_invariants(harness: OperatorHarness, in_use: Iterable[tuple[str, int, str]] = ()) -> None:
    """What no crash may break, checked from outside (simulator state files, API objects, records):

    - no instance serves two slices, and no two bound slices overlap on one GPU;
    - every Ready MIG slice's device exists where its status says, with that UUID;
    - every owner the agents' records name is a slice that exists (nothing owned by the dead);
    - no GPU instance is left without its compute instance;
    - instances a process uses (``in_use``: node, GPU, device UUID) still exist;
    - fractions on a GPU add up to at most its memory, their compute shares (status.compute, as
      written) to at most 1, and shares and shared fractions never meet on one GPU.
    """
    slices = harness.slices()
    live = {s["metadata"]["uid"] for s in slices}
    devices: dict[str, dict[tuple[int, int], Any]] = {}
    for name, node in harness.nodes.items():
        backend = node.backend()
        devices[name] = {}
        for gpu in backend.gpus():
            if gpu.mig_enabled:
                for inst in backend.instances(gpu.index):
                    assert inst.ci_id >= 0 and inst.device_uuid, f"half-made instance left on {name}: {inst}"
                    devices[name][(gpu.index, inst.gi_id)] = inst
        for uid, entry in (node.record().get("owners") or {}).items():
            assert uid in live, f"{name}'s record names slice {entry.get('slice')} ({uid}), which no longer exists"
    held: dict[tuple[str, int], list[tuple[int, str]]] = {}
    served: dict[tuple[str, int, int], str] = {}
    fractions: dict[tuple[str, int], int] = {}
    computes: dict[tuple[str, int], list[str]] = {}
    for body in slices:
        st = body.get("status") or {}
        ref = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
        if st.get("phase") not in ("Bound", "Creating", "Ready"):
            continue
        key = (st["node"], st["gpu"])
        if st.get("mode") == "mig":
            mask = ((1 << st["placement"]["size"]) - 1) << st["placement"]["start"]
            for other_mask, other in held.get(key, []):
                assert not mask & other_mask, f"{ref} and {other} overlap on {key}"
            held.setdefault(key, []).append((mask, ref))
            if st["phase"] == "Ready":
                inst = devices.get(st["node"], {}).get((st["gpu"], st["giId"]))
                assert inst is not None, f"{ref} is Ready but GI {st['giId']} does not exist on {key}"
                assert inst.device_uuid == st["deviceUUID"], f"{ref}: device {st['deviceUUID']} is {inst.device_uuid}"
                assert (st["node"], st["gpu"], st["giId"]) not in served, f"{ref} and {served.get(key)} share a GI"
                served[(st["node"], st["gpu"], st["giId"])] = ref
        else:
            fractions[key] = fractions.get(key, 0) + int(st.get("grantedBytes", 0))
            computes.setdefault(key, []).append(st.get("compute", "shared"))
    for node, gpu, device in in_use:
        assert any(i.device_uuid == device for (g, _), i in devices[node].items() if g == gpu), (
            f"instance {device} on {node} GPU {gpu} was in use and is gone")
    for (node, gpu), granted in fractions.items():
        model = get_model(harness.nodes[node].model)
        assert granted <= model.memory_mib * 2**20, f"fractions on {node} GPU {gpu} exceed its memory"
    for key, shares in computes.items():
        assert "shared" not in shares or set(shares) == {"shared"}, f"shares and shared fractions on {key}: {shares}"
        assert sum(Decimal(c) for c in shares if c != "shared") <= 1, f"compute over 1 on {key}: {shares}"
