"""`make demo` (scripts/demo) end to end: it starts its own control plane, builds nothing the demo does
not start, and shows the request the project exists for: a pod annotated `cdmo.io/gpu-memory: 4G` is
admitted, gets its slice and runs; deleted, it leaves the MIG instance idle and a second annotated pod
reuses it; a slice given a process shows its usage and the smaller profile advise names. Read from what the
demo prints, as a user reads it.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mig_operator.core.placement.profiles import get_model

REPO_ROOT = Path(__file__).resolve().parents[2]
# 4G is 3815 MiB: the smallest MIG profile covering it among the demo's GPUs is the A100 40GB's 1g.5gb
# (4864 MiB; the H100's smallest, 1g.10gb, holds 9856 MiB), on gpu-b, the demo's A100 node.
EXPECTED_NODE, EXPECTED_PROFILE = "gpu-b", "1g.5gb"
# What the demo sets in step 6: slice `train` asks for 3g.40gb (only the H100 of gpu-a has it) and its one
# process holds 4 GiB; advise adds 10 % headroom by default.
USAGE_SLICE, USAGE_PROFILE, USAGE_MODEL, USAGE_BYTES, HEADROOM = "train", "3g.40gb", "h100-80gb", 4 * 2**30, 0.10
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


def table_row(output: str, columns: set[str], key: str, value: str) -> dict[str, str]:
    """The row where column ``key`` is ``value`` of the first table printed whose header has ``columns``,
    cut at the header's column starts (kubectl and advise align cells under them)."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        names = line.split()
        if not columns <= set(names) or key not in names:
            continue
        starts = [m.start() for m in re.finditer(r"\S+", line)]
        for row in lines[i + 1:]:
            if not row.strip():
                break
            cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
            found = dict(zip(names, cells, strict=True))
            if found.get(key) == value:
                return found
    raise AssertionError(f"no table with columns {sorted(columns)} and {key} {value}:\n{output}")


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f}Gi"


def test_a_slice_shows_its_usage_and_advise_names_a_smaller_profile(demo_output: str) -> None:
    # kubectl get gs -o wide: USED and PEAK are the 4 GiB its process holds.
    wide = table_row(demo_output, {"USED", "PEAK"}, "NAME", USAGE_SLICE)
    assert (wide["PROFILE"], wide["USED"], wide["PEAK"]) == (USAGE_PROFILE, gib(USAGE_BYTES), gib(USAGE_BYTES)), wide
    # The smallest profile of the same model holding the peak plus headroom, ordered by memory then slices.
    model = get_model(USAGE_MODEL)
    need = math.ceil(USAGE_BYTES * (1 + HEADROOM))
    best = min((p for p in model.profiles if not p.media_extension and p.memory_mib * 2**20 >= need),
               key=lambda p: (p.memory_mib, p.slices))
    back = (model.profile(USAGE_PROFILE).memory_mib - best.memory_mib) * 2**20
    assert best.name == "1g.10gb" and back > 0  # the numbers above make a smaller profile exist
    advised = table_row(demo_output, {"ADVICE", "BACK", "WHY"}, "NAME", USAGE_SLICE)
    assert (advised["CURRENT"], advised["PEAK"], advised["ADVICE"], advised["BACK"]) == (
        USAGE_PROFILE, gib(USAGE_BYTES), f"-> {best.name}", gib(back)), advised
    assert best.name in advised["WHY"], advised
    assert re.search(r"^ +total: .* back, .* whole GPU\(s\);", demo_output, re.M), demo_output
