"""`make demo` (scripts/demo) end to end: it starts its own control plane, builds nothing the demo does
not start, and shows the request the project exists for: a pod annotated `cdmo.io/gpu-memory: 4G` is
admitted, gets its slice and runs; deleted, it leaves the MIG instance idle and a second annotated pod
reuses it. Read from what the demo prints, as a user reads it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# 4G is 3815 MiB: the smallest MIG profile covering it among the demo's GPUs is the A100 40GB's 1g.5gb
# (4864 MiB; the H100's smallest, 1g.10gb, holds 9856 MiB), on gpu-b, the demo's A100 node.
EXPECTED_NODE, EXPECTED_PROFILE = "gpu-b", "1g.5gb"
RAN = re.compile(r"^ +(train-[12]): phase Running on node (\S+); its slice demo/\S+: (\S+) on (\S+) GPU \d+, "
                 r"device (MIG-[0-9a-f-]+), (.*)$", re.M)


@pytest.fixture(scope="module")
def demo_output() -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MIG_OPERATOR_RUN", "KUBECONFIG")}
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "demo")], capture_output=True, text=True,
                            env=env, timeout=900, cwd=REPO_ROOT)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def test_an_annotated_pod_gets_its_slice_runs_and_its_instance_is_reused_after_it(demo_output: str) -> None:
    ran = {m[0]: m for m in RAN.findall(demo_output)}
    assert set(ran) == {"train-1", "train-2"}, demo_output
    for _, node, profile, slice_node, _, _ in ran.values():
        assert (node, slice_node, profile) == (EXPECTED_NODE, EXPECTED_NODE, EXPECTED_PROFILE)
    assert ran["train-1"][5] == "a new MIG instance"
    assert ran["train-2"][4] == ran["train-1"][4]  # the same device
    assert "reused" in ran["train-2"][5]
    # What admission added, before the pod ran: the claim, the container's use of it, the gate.
    assert re.search(r"spec\.resourceClaims: gpu-slice -> ResourceClaim train-1-", demo_output)
    assert "containers[train].resources.claims: gpu-slice" in demo_output
    assert "spec.schedulingGates: cdmo.io/gpu-slice" in demo_output


def test_the_demo_builds_only_what_it_starts(demo_output: str) -> None:
    plane = [line for line in demo_output.splitlines() if line.startswith("[control-plane]")]
    assert plane, demo_output[:2000]
    assert not [line for line in plane if re.search(r"hollow-node|cdi-validate|helm", line)], plane
