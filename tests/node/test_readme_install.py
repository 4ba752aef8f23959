"""README's install section run verbatim on the real node (tests/node/conftest.py), then docs/operations.md's
uninstall: the commands are read from the pages (tests/doc_commands.py), never copied here. What the
pages leave to the reader is filled in as a reader would: the node's name for `gpu-node-1`, the built
image's repository for `REGISTRY/mig-operator`, and, after each `helm install`, the node's own values
(the simulator backend, this node's kubelet and CDI directories). tests/helm/test_readme_commands.py
checks the same commands offline.

It runs before test_real_node.py (file order) and leaves the node as that file expects it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from doc_commands import OPERATIONS, README, Command, commands, page_commands, sh_blocks
from test_real_node import wait_for

from mig_operator.kube.common.names import MIG_NODE_LABEL

pytestmark = pytest.mark.e2e

RealNode = Any  # tests/node/conftest.py's RealNode (a fixture's type)
README_IMAGE = "docker.io/library/ubuntu:24.04"  # what README's pods run: the workload image, tagged so
GPU_PRESENT = "nvidia.com/gpu.present"


def run(node: RealNode, command: Command, values: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    script = command.script.replace("gpu-node-1", node.name).replace(
        "REGISTRY/mig-operator", node.images["OPERATOR_IMAGE"].rsplit(":", 1)[0])
    if command.argv[:2] in (["helm", "install"], ["helm", "upgrade"]):
        script = script.rstrip("\n") + f" --values {values}\n"
    env = dict(os.environ, PATH=f"{node.bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               KUBECONFIG=str(node.kubeconfig))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"`{command.line}` exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result


def node_values(node: RealNode, tmp_path: Path) -> Path:
    """What this node needs beyond the page: the built image's tag, the simulator, its own directories."""
    node_dir = node.node_dir
    state = f"{node_dir}/var/lib/mig-operator-readme"
    values = {
        "image": {"tag": node.images["OPERATOR_IMAGE"].rsplit(":", 1)[1], "pullPolicy": "Never"},
        "agent": {"backend": "sim:h100-80gbx2", "stateDir": state, "kubeletDir": f"{node_dir}/kubelet",
                  "cdiDir": node.settings["NODE_CDI_DIR"], "runtimeClassName": "", "toolkitConfig": ""},
        "shim": {"hostDir": f"{state}/shim"},
    }
    path = tmp_path / "node-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def phase(node: RealNode, ns: str, name: str) -> str:
    out = node.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout)["status"].get("phase", "") if out.returncode == 0 else ""


def test_the_readme_install_runs_verbatim_and_its_pods_get_their_devices(real_node: RealNode,
                                                                          tmp_path: Path) -> None:
    node = real_node
    values = node_values(node, tmp_path)
    tagged = node.ctr("images", "tag", "--force", node.images["WORKLOAD_IMAGE"], README_IMAGE)
    assert tagged.returncode == 0, tagged.stderr
    node.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite")  # as GPU Feature Discovery
    try:
        for command in page_commands(README, "Install on a cluster"):
            run(node, command, values)
        pods = [(d["metadata"].get("namespace", "team-a"), d["metadata"]["name"])
                for c in page_commands(README, "Install on a cluster") if c.stdin
                for d in yaml.safe_load_all(c.stdin) if d and d["kind"] == "Pod"]
        assert len(pods) == 2, pods
        for ns, name in pods:
            wait_for(lambda ns=ns, name=name: phase(node, ns, name) in ("Succeeded", "Failed"), 240,
                     f"pod {ns}/{name} to end")
            logs = node.kubectl("logs", name, "-n", ns).stdout
            assert phase(node, ns, name) == "Succeeded" and "/dev/nvidia" in logs, (name, logs)
        # docs/operations.md's uninstall (its first block; the second is for slices left without agents),
        # verbatim: it finishes, and leaves no slice behind.
        for command in commands(sh_blocks(OPERATIONS, "Uninstall")[0]):
            run(node, command, values)
        assert not node.kubectl("get", "gs", "-A", "-o", "name").stdout.strip()
    finally:
        node.kubectl("delete", "namespace", "team-a", "--ignore-not-found", "--wait=true", "--timeout=180s",
                     check=False)
        node.helm("uninstall", "mig-operator", "--namespace", "mig-operator", "--ignore-not-found", check=False)
        node.kubectl("label", "node", node.name, f"{MIG_NODE_LABEL}-", f"{GPU_PRESENT}-", check=False)
