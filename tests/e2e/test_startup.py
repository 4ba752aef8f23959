"""Starting and stopping the parts against a real API server (issue 19 items 8 and 10): an agent for a
Node the API lacks refuses to start, a GpuNode goes with its Node, and a controller that made its own
webhook certificate leaves no key behind when it stops."""

from __future__ import annotations

import os
import time

from harness import SimNode, wait_until


def test_an_agent_for_a_node_the_api_lacks_exits_2_and_writes_no_gpunode(operator) -> None:
    ghost = SimNode("no-such-node-e2e", "h100-80gb", 1, True, operator.workdir / "ghost.json")
    proc = operator.agent(ghost)
    assert operator.wait_exit(proc, 30) == 2, proc.tail()
    lines = [line for line in proc.log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("mig-operator: --node 'no-such-node-e2e': the API server has no such Node")
    assert operator.gpunode(ghost) is None


def test_a_gpunode_is_owned_by_its_node_and_goes_when_the_node_is_deleted(operator) -> None:
    node = operator.add_node("h100-80gb")
    agent = operator.agent(node)
    gpunode = operator.wait_gpunode(node)
    node_uid = operator.core.read_node(node.name).metadata.uid
    assert [(o["kind"], o["name"], o["uid"]) for o in gpunode["metadata"]["ownerReferences"]] == [
        ("Node", node.name, node_uid)]

    operator.core.delete_node(node.name)
    # kube-controller-manager's garbage collector removes it; the agent, still running, writes no new one.
    wait_until(lambda: operator.gpunode(node) is None, 60, lambda: f"GpuNode {node.name} to go\n{operator.logs()}")
    time.sleep(3)  # more than the agent's publish interval after a change (1 s)
    assert operator.gpunode(node) is None and agent.alive, operator.logs()

    # The node comes back (a new UID): the agent publishes its GpuNode again, owned by the new Node.
    operator.core.create_node({"metadata": {"name": node.name, "labels": {"type": "kwok"},
                                            "annotations": {"kwok.x-k8s.io/node": "fake"}}})
    again = operator.wait_gpunode(node)
    new_uid = operator.core.read_node(node.name).metadata.uid
    assert new_uid != node_uid
    assert [o["uid"] for o in again["metadata"]["ownerReferences"]] == [new_uid]


def test_a_stopped_controller_leaves_no_webhook_key_on_disk(operator, tmp_path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = operator.controller_with_webhook({"TMPDIR": str(scratch)})
    operator.wait_webhook()
    made = [p for p in scratch.iterdir() if p.name.startswith("mig-operator-webhook-")]
    assert made and (made[0] / "tls.key").exists(), f"the certificate's files while it runs: {list(scratch.iterdir())}"
    assert oct((made[0] / "tls.key").stat().st_mode & 0o777) == oct(0o600)
    operator.stop(proc)
    assert proc.popen is not None and proc.popen.returncode is not None
    assert list(scratch.iterdir()) == [], os.listdir(scratch)
