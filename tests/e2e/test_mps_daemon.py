"""The MPS control daemon's lifecycle on the simulator's stand-in (issue 26), against the real API
server: started with the first slice with a compute share on a GPU, holding the GPU's largest share,
adopted (not restarted) by an agent restarted with SIGKILL, stopped with the last such slice; its
failure shown as the GpuNode's MPSReady condition and on the slice (Failed, MPSUnavailable); the CDI
spec of a compute share carrying the MPS edits, as the official CDI library applies it; and, as the
chart runs it, the daemon started by the node's MPS host (``mig-operator mps-host``) for the agent.

The daemon is looked at from outside, not through gpu/mps.py: its PID file, its process, and the
answer on its control socket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from harness import OperatorHarness, Proc, SimNode, wait_until
from test_resource_slices import Kubelet, _registered, allocated_claim, claim_of, short_dir  # noqa: F401

from mig_operator.kube.agent.kubeletapi import dra_v1_pb2 as dra

DRIVER = "gpu.cdmo.io"


def daemon_pid(root: Path) -> int | None:
    """The stand-in daemon's PID while its process lives (its PID file, then /proc)."""
    try:
        pid = int((root / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    except (OSError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return None
    return pid if b"mps_standin" in cmdline else None


def adopted_lines(agent: Proc, uuid: str) -> int:
    """How many times the agent's log says it adopted the GPU's running daemon (one line per start)."""
    return agent.log.read_text(errors="replace").count(f"MPS control daemon of {uuid} adopted")


def ask(root: Path, command: str) -> str:
    # Through a descriptor of the pipe directory: the test's path is longer than a socket path may be.
    fd = os.open(root / "pipe", os.O_PATH)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        try:
            conn.connect(f"/proc/self/fd/{fd}/control")
        finally:
            os.close(fd)
        with conn.makefile("rw") as stream:
            stream.write(command + "\n")
            stream.flush()
            return stream.readline().strip()


def mps_condition(operator: OperatorHarness, node: SimNode) -> dict | None:
    body = operator.gpunode(node) or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or () if c["type"] == "MPSReady"), None)


def test_the_daemon_starts_with_the_first_share_is_adopted_and_stops_with_the_last(
        operator: OperatorHarness, cdi_validate: Path, short_dir: Path) -> None:  # noqa: F811
    node = operator.add_node("l4-24gb", labelled=False)
    (short_dir / "reg").mkdir()
    flags = ["--kubelet-registry-dir", str(short_dir / "reg"), "--kubelet-plugin-dir", str(short_dir / "plug"),
             "--cdi-dir", str(short_dir / "cdi"), "--shim-host-dir", str(short_dir / "shim")]
    agent = operator.agent(node, None, *flags)
    uuid = operator.wait_gpunode(node)["status"]["gpus"][0]["uuid"]
    operator.controller()
    root = Path(f"{node.state_file}.mps") / uuid
    ns = operator.namespace()
    try:
        operator.create_slice(ns, "shared", {"memory": "2Gi", "nodeName": node.name})
        operator.wait_phase(ns, "shared", "Ready")
        assert daemon_pid(root) is None  # a shared fraction needs no daemon
        operator.delete_slice(ns, "shared")
        operator.wait_gone(ns, "shared")

        operator.create_slice(ns, "infer", {"memory": "4Gi", "compute": 0.25, "nodeName": node.name})
        infer = operator.wait_phase(ns, "infer", "Ready")
        first = daemon_pid(root)
        assert first is not None, operator.logs()
        assert ask(root, "get_default_active_thread_percentage") == "25.0"  # the GPU's largest share
        assert ask(root, "get_default_device_pinned_mem_limit 0") == "4096M"  # 4Gi in MiB
        wait_until(lambda: (c := mps_condition(operator, node)) and c["status"] == "True", 30,
                   lambda: f"MPSReady\n{operator.logs()}")

        operator.create_slice(ns, "train", {"memory": "8Gi", "compute": 0.5, "nodeName": node.name})
        operator.wait_phase(ns, "train", "Ready")
        assert daemon_pid(root) == first  # one daemon per GPU, not restarted for the second share
        assert ask(root, "get_default_active_thread_percentage") == "50.0"

        # The CDI spec of a compute share, as the CDI library applies it to a container.
        claim = allocated_claim(operator, ns, "infer", node, infer["metadata"]["uid"])
        kubelet = Kubelet(short_dir / "reg")
        try:
            service = kubelet.register()
            answer = service.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim_of(claim)]),
                                                  timeout=30).claims[claim["metadata"]["uid"]]
            assert answer.error == ""
            seen = json.loads(subprocess.run(
                [str(cdi_validate), "--cdi-dir", str(short_dir / "cdi"), f"{DRIVER}/slice={infer['metadata']['uid']}"],
                check=True, capture_output=True, text=True).stdout)
            assert {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
                    "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "NVIDIA_VISIBLE_DEVICES=void"} <= set(seen["env"])
            mounts = {m["destination"]: m for m in seen["mounts"]}
            assert mounts["/tmp/nvidia-mps"]["source"] == str(root / "pipe")
            assert mounts["/dev/shm"]["source"] == str(root / "shm")
            assert "/etc/ld.so.preload" in mounts  # the shim stays, preloaded from the mounted file
            assert "rw" in mounts["/dev/shm"]["options"] and "nosuid" in mounts["/tmp/nvidia-mps"]["options"]
            gone = service.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[claim_of(claim)]),
                                                  timeout=30)
            assert gone.claims[claim["metadata"]["uid"]].error == ""
        finally:
            kubelet.close()

        # SIGKILL the agent: the restarted one adopts the daemon that answers.
        adoptions = adopted_lines(agent, uuid)
        operator.kill(agent)
        assert daemon_pid(root) == first
        operator.start(agent)
        wait_until(lambda: adopted_lines(agent, uuid) > adoptions, 30, lambda: f"adoption\n{operator.logs()}")
        assert daemon_pid(root) == first

        # The daemon dies and cannot be started again (its pipe directory blocked): a new share fails,
        # the GpuNode and the Ready shares say so, their phase stays; unblocked, the next share starts
        # it again and they say so too.
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: daemon_pid(root) is None, 30, "the daemon's death")
        shutil.rmtree(root / "pipe")
        (root / "pipe").write_text("blocked")
        operator.create_slice(ns, "probe", {"memory": "1Gi", "compute": 0.1, "nodeName": node.name})
        probe = operator.wait_phase(ns, "probe", "Failed")
        assert probe["status"]["reason"] == "MPSUnavailable", probe["status"]
        down = wait_until(lambda: (c := mps_condition(operator, node)) and c["status"] == "False" and c, 30,
                          lambda: f"MPSReady False\n{operator.logs()}")
        assert down["reason"] == "MPSDaemonFailed" and uuid in down["message"], down

        def ready_condition(name: str) -> dict:
            body = operator.get_slice(ns, name) or {}
            return next(c for c in body["status"]["conditions"] if c["type"] == "Ready")

        for name in ("infer", "train"):
            wait_until(lambda n=name: ready_condition(n)["status"] == "False", 30,
                       lambda: f"Ready False\n{operator.logs()}")
            assert ready_condition(name)["reason"] == "MPSUnavailable"
            assert (operator.get_slice(ns, name) or {})["status"]["phase"] == "Ready"
        (root / "pipe").unlink()
        operator.create_slice(ns, "probe-2", {"memory": "1Gi", "compute": 0.1, "nodeName": node.name})
        operator.wait_phase(ns, "probe-2", "Ready")
        first = daemon_pid(root)
        assert first is not None
        for name in ("infer", "train"):
            wait_until(lambda n=name: ready_condition(n)["status"] == "True", 30,
                       lambda: f"Ready True again\n{operator.logs()}")
        wait_until(lambda: (c := mps_condition(operator, node)) and c["status"] == "True", 30,
                   lambda: f"MPSReady True again\n{operator.logs()}")

        for name in ("infer", "probe", "probe-2"):
            operator.delete_slice(ns, name)
            operator.wait_gone(ns, name)
        assert daemon_pid(root) == first  # "train" still holds a share on the GPU
        operator.delete_slice(ns, "train")
        operator.wait_gone(ns, "train")
        # stopped, and its pipe directory removed after it
        wait_until(lambda: daemon_pid(root) is None and not (root / "pipe").exists(), 30,
                   lambda: f"the daemon's stop\n{operator.logs()}")
        wait_until(lambda: (c := mps_condition(operator, node)) and c["reason"] == "NoComputeShares", 30,
                   lambda: f"MPSReady\n{operator.logs()}")

        # A daemon that cannot start: the slice fails with the reason, nothing is left half-made.
        root.mkdir(parents=True, exist_ok=True)
        (root / "pipe").write_text("not a directory")
        operator.create_slice(ns, "broken", {"memory": "2Gi", "compute": 0.25, "nodeName": node.name})
        broken = operator.wait_phase(ns, "broken", "Failed")
        ready = next(c for c in broken["status"]["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "MPSUnavailable"), ready
        assert "MPS" in ready["message"] and uuid in ready["message"]
    finally:
        pid = daemon_pid(root)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)


def test_with_the_mps_host_the_daemon_is_the_hosts_and_outlives_the_agent(
        operator: OperatorHarness, short_dir: Path) -> None:  # noqa: F811
    """As the chart runs it: the agent asks the node's MPS host (``mig-operator mps-host``) for the
    daemon; the agent replaced, the daemon and its settings stay; no host, no new daemon."""
    node = operator.add_node("l4-24gb", labelled=False)
    mps_dir = f"{node.state_file}.mps"
    host = operator.mps_host(node)
    agent = operator.agent(node, None, "--kubelet-registry-dir", "")
    uuid = operator.wait_gpunode(node)["status"]["gpus"][0]["uuid"]
    operator.controller()
    root = Path(mps_dir) / uuid
    ns = operator.namespace()
    try:
        operator.create_slice(ns, "infer", {"memory": "4Gi", "compute": 0.25, "nodeName": node.name})
        operator.wait_phase(ns, "infer", "Ready")
        first = daemon_pid(root)
        assert first is not None, operator.logs()
        assert (root / "start").exists()  # the agent's request, the host's daemon
        assert f"MPS control daemon of {uuid} started" in host.tail(200)
        assert ask(root, "get_default_active_thread_percentage") == "25.0"

        # The agent replaced (SIGTERM, as a pod is): the next one adopts the host's daemon, nothing restarted.
        adoptions = adopted_lines(agent, uuid)
        operator.stop(agent)
        assert daemon_pid(root) == first
        operator.start(agent)
        wait_until(lambda: adopted_lines(agent, uuid) > adoptions, 30, lambda: f"adoption\n{operator.logs()}")
        operator.create_slice(ns, "train", {"memory": "8Gi", "compute": 0.5, "nodeName": node.name})
        operator.wait_phase(ns, "train", "Ready")
        assert daemon_pid(root) == first and ask(root, "get_default_active_thread_percentage") == "50.0"

        for name in ("infer", "train"):
            operator.delete_slice(ns, name)
            operator.wait_gone(ns, name)
        wait_until(lambda: daemon_pid(root) is None and not (root / "start").exists(), 30,
                   lambda: f"the daemon's stop\n{operator.logs()}")

        # No host: the next share gets no daemon, and its slice says where to look.
        operator.stop(host)
        operator.create_slice(ns, "probe", {"memory": "1Gi", "compute": 0.1, "nodeName": node.name})
        probe = operator.wait_phase(ns, "probe", "Failed", timeout=90)
        ready = next(c for c in probe["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "MPSUnavailable" and "mps-host" in ready["message"], probe["status"]
        assert daemon_pid(root) is None
    finally:
        pid = daemon_pid(root)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
