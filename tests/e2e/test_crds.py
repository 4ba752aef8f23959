"""The GpuSlice and GpuNode CRDs on a real kube-apiserver (scripts/control-plane).

The API server's schema and CEL rules must refuse exactly what mig_operator.core.requests.slice_spec refuses:
every spec of tests/corpus/gpuslice_specs.yaml, and a generated set of memory strings, is sent to the
server (official Python client and kubectl) and the verdicts compared with core's.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from harness import wait_until
from slice_spec_reference import check_request_unchanged

from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.slice_spec import request_from_spec

# Its tests share a module-scoped fixture: one pytest-xdist worker runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_crds")

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = [REPO_ROOT / "crds" / "gpuslice.yaml", REPO_ROOT / "crds" / "gpunode.yaml"]
CORPUS = yaml.safe_load((REPO_ROOT / "tests" / "corpus" / "gpuslice_specs.yaml").read_text())
GROUP, VERSION = "cdmo.io", "v1alpha1"
SLICES, NODES = "gpuslices", "gpunodes"


def _ids(cases: list[dict]) -> list[str]:
    return [case["name"] for case in cases]


def _slice(name: str, spec: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name}, "spec": spec}


def _core_accepts(spec: dict) -> bool:
    try:
        request_from_spec(spec)
    except QuantityError:
        return False
    return True


def _api_error(error: kubernetes.client.ApiException) -> str:
    """The server's refusal as one text: its message and every cause's field and message."""
    try:
        body = json.loads(error.body)
    except (TypeError, ValueError):
        return str(error.body)
    causes = body.get("details", {}).get("causes", [])
    return " ".join([body.get("message", "")] + [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes])


@pytest.fixture(scope="module")
def crds(kube_cluster: Any) -> None:
    """Apply both CRDs and wait until they are served (a CEL rule that fails to compile fails here)."""
    for path in CRD_FILES:
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/gpuslices.cdmo.io", "crd/gpunodes.cdmo.io"
    )
    # Established is not the end: the resource must also be in discovery before kubectl can use it.
    wait_until(lambda: kube_cluster.kubectl("get", "gs", "-A", check=False).returncode == 0, 60,
               "gpuslices to become usable")


@pytest.fixture(scope="module")
def namespace(kube_cluster: Any, crds: None) -> Iterator[str]:
    name = f"crd-e2e-{uuid.uuid4().hex[:8]}"
    core = kube_cluster.core_v1()
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> kubernetes.client.CustomObjectsApi:
    return kube_cluster.custom_objects()


def _py_create(
    api: kubernetes.client.CustomObjectsApi, namespace: str, body: dict, dry_run: bool = False
) -> str | None:
    """None when the server accepts; its refusal text otherwise. Unknown fields refused, as kubectl does."""
    try:
        api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, SLICES, body, field_validation="Strict", dry_run="All" if dry_run else None
        )
    except kubernetes.client.ApiException as error:
        assert error.status in (400, 422), f"unexpected status {error.status}: {error.body}"
        return _api_error(error)
    return None


def _kubectl_create(kube_cluster: Any, namespace: str, body: dict) -> str | None:
    result = kube_cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    return None if result.returncode == 0 else result.stderr


# --- the corpus ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CORPUS["valid"], ids=_ids(CORPUS["valid"]))
def test_valid_slices_are_created(case: dict, api: Any, kube_cluster: Any, namespace: str) -> None:
    assert _core_accepts(case["spec"])
    refusal = _py_create(api, namespace, _slice(f"py-{case['name']}", case["spec"]))
    assert refusal is None, f"python client refused: {refusal}"
    refusal = _kubectl_create(kube_cluster, namespace, _slice(f"kc-{case['name']}", case["spec"]))
    assert refusal is None, f"kubectl refused: {refusal}"
    stored = api.get_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, f"py-{case['name']}")
    assert stored["spec"] == case["spec"]


@pytest.mark.parametrize("case", CORPUS["invalid"], ids=_ids(CORPUS["invalid"]))
def test_invalid_slices_are_refused_with_their_message(case: dict, api: Any, kube_cluster: Any, namespace: str) -> None:
    assert not _core_accepts(case["spec"])
    for client, refusal in (
        ("python client", _py_create(api, namespace, _slice(f"py-{case['name']}", case["spec"]))),
        ("kubectl", _kubectl_create(kube_cluster, namespace, _slice(f"kc-{case['name']}", case["spec"]))),
    ):
        assert refusal is not None, f"{client} created {case['spec']!r}"
        assert case["field"] in refusal, f"{client}: {case['field']} not named in: {refusal}"
        assert case["message"].lower() in refusal.lower(), f"{client}: {case['message']!r} not in: {refusal}"


# Memory strings built from every combination of sign, digits and unit: not chosen by hand, so they
# find rules the corpus did not think of. Dry-run creates, one per string.
_SIGNS = ["", "+", "-"]
_NUMBERS = [
    "0",
    "1",
    "7",
    "1.",
    ".5",
    "0.5",
    "1.5",
    "1.25",
    "4096",
    "000123",
    "1.000000001",
    "1.0000000001",
    "9223372036854775807",
    "9223372036854775808",
    "4611686018427387904.5",
    "12345678901234567890123",
]
_UNITS = [
    "",
    "n",
    "u",
    "m",
    "k",
    "K",
    "M",
    "G",
    "T",
    "P",
    "E",
    "Ki",
    "Mi",
    "Gi",
    "Ti",
    "Pi",
    "Ei",
    "gb",
    "GiB",
    "mB",
    "MIB",
    "TB",
    "e3",
    "E-3",
    "e18",
    "e-9",
    "e40",
    "e41",
    "e-12",
    " ",
    "x",
]
PROBES = ["".join(parts) for parts in itertools.product(_SIGNS, _NUMBERS, _UNITS)]
# And random strings over the characters quantities are made of (seeded: the same on every run).
_FUZZ_ALPHABET = "0123456789000.+-eEkKMGTPEinumbB "
_fuzz = random.Random(20261122)
PROBES += ["".join(_fuzz.choices(_FUZZ_ALPHABET, k=_fuzz.randint(1, 12))) for _ in range(1500)]


MEMORY_REFUSALS = (
    "has an unknown unit",
    "is not a quantity",
    "is out of range",
    "more than nine decimal places",
    "must be greater than zero",
    "is larger than 2^63-1 bytes",
    "is not a whole number of bytes",
    "is below the smallest slice, 1Gi",
)


def _core_refusal(spec: dict) -> str | None:
    try:
        request_from_spec(spec)
    except QuantityError as error:
        return str(error)
    return None


def test_server_and_core_agree_on_generated_memory_strings(api: Any, namespace: str) -> None:
    # Same verdict, and for a refusal the same reason (the server may add more reasons than core's one).
    disagreements = []
    for index, text in enumerate(PROBES):
        spec = {"memory": text}
        server = _py_create(api, namespace, _slice(f"probe-{index}", spec), dry_run=True)
        core = _core_refusal(spec)
        if (server is None) != (core is None):
            disagreements.append(f"{text!r}: server {'accepts' if server is None else 'refuses'}: {server}")
        elif core is not None and server is not None:
            reason = next(phrase for phrase in MEMORY_REFUSALS if phrase in core)
            # A value both fractional and above 2^63-1: core checks wholeness first, the server can
            # test wholeness only within int64 range, so it names the size. Both refuse.
            if reason == "is not a whole number of bytes" and "is larger than 2^63-1 bytes" in server:
                continue
            if reason not in server:
                disagreements.append(f"{text!r}: core says {reason!r}, server says {server}")
    assert not disagreements, f"{len(disagreements)} of {len(PROBES)} disagree:\n" + "\n".join(disagreements)


def test_the_corpus_covers_every_rule() -> None:
    # At least 30 refusals, and each of the CRD's memory messages appears in the corpus.
    assert len(CORPUS["invalid"]) >= 30
    messages = [case["message"] for case in CORPUS["invalid"] if case["field"] == "spec.memory"]
    for expected in MEMORY_REFUSALS:
        assert any(message in expected for message in messages), expected


# --- updates -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CORPUS["updates"], ids=_ids(CORPUS["updates"]))
def test_request_changes_are_refused(case: dict, api: Any, kube_cluster: Any, namespace: str) -> None:
    with pytest.raises(QuantityError):
        check_request_unchanged(case["old"], case["new"])
    name = f"upd-{case['name']}"
    created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, _slice(name, case["old"]))
    changed = dict(created, spec=case["new"])
    with pytest.raises(kubernetes.client.ApiException) as refused:
        api.replace_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, name, changed)
    text = _api_error(refused.value)
    assert refused.value.status == 422 and case["field"] in text and case["message"] in text, text
    # kubectl replace of the same change is refused the same way.
    result = kube_cluster.kubectl("replace", "-n", namespace, "-f", "-", input=json.dumps(changed), check=False)
    assert result.returncode != 0 and case["message"] in result.stderr, result.stderr


def test_other_updates_are_allowed(api: Any, namespace: str) -> None:
    name = "upd-allowed"
    created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, _slice(name, {"memory": "4Gi"}))
    # Labels, finalizers and status may change; the request stays the same.
    api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, SLICES, name, {"metadata": {"labels": {"team": "a"}, "finalizers": ["cdmo.io/x"]}}
    )
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, SLICES, name, {"status": {"phase": "Bound"}})
    api.replace_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        SLICES,
        name,
        dict(api.get_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, name), spec=created["spec"]),
    )
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, name, {"metadata": {"finalizers": None}})


def test_status_phase_is_an_enum(api: Any, namespace: str) -> None:
    name = "status-enum"
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, _slice(name, {"fraction": 0.5}))
    with pytest.raises(kubernetes.client.ApiException) as refused:
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, SLICES, name, {"status": {"phase": "Running"}}
        )
    assert "status.phase" in _api_error(refused.value)


# --- what kubectl shows ----------------------------------------------------------------------


def _table(output: str) -> list[list[str]]:
    """kubectl's table as rows of cells, cut where the header's columns start (cells may be empty)."""
    lines = output.rstrip().splitlines()
    starts = [match.start() for match in re.finditer(r"\S+(?: \S+)*", lines[0])]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [[line[start:end].strip() for start, end in bounds] for line in lines]


def test_kubectl_get_gs_shows_the_columns(api: Any, kube_cluster: Any, namespace: str) -> None:
    name = "columns"
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, _slice(name, {"memory": "17G"}))
    status = {
        "phase": "Ready",
        "reason": "Ready",
        "request": "memory 17G",
        "mode": "mig",
        "node": "gpu-node-1",
        "gpu": 0,
        "profile": "1g.18gb",
        "profileId": 19,
        "placement": {"start": 3, "size": 1},
        "deviceUUID": "MIG-0f6b6b7e-0000-4000-8000-000000000001",
        "giId": 9,
        "ciId": 0,
        "grantedBytes": 16384 * 2**20,
        "compute": "1/7",
        "reused": False,
        "phaseTimes": {"Bound": "2026-01-01T00:00:00.000Z", "Ready": "2026-01-01T00:00:00.120Z"},
        "observedGeneration": 1,
        "claim": name,
        "reclaim": [{"gpu": 0, "profile": "1g.18gb", "start": 4}],
        "usage": {"memoryUsed": 2 * 2**30, "memoryPeak": 3 * 2**30, "used": "2.0Gi", "peak": "3.0Gi", "processes": 1,
                  "refusals": 0, "observedAt": "2026-01-01T00:01:00Z", "lastActive": "2026-01-01T00:01:00Z"},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Created",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, SLICES, name, {"status": status})
    rows = _table(kube_cluster.kubectl("get", "gs", name, "-n", namespace).stdout)
    assert rows[0] == ["NAME", "REQUEST", "PHASE", "REASON", "NODE", "GPU", "PROFILE", "COMPUTE", "REUSED", "CLAIM",
                       "AGE"]
    assert rows[1][:10] == [name, "memory 17G", "Ready", "Ready", "gpu-node-1", "0", "1g.18gb", "1/7", "false", name]
    wide = _table(kube_cluster.kubectl("get", "gpuslice", name, "-n", namespace, "-o", "wide").stdout)
    assert wide[0][-7:] == ["MODE", "MEMORY", "FRACTION", "MIG-PROFILE", "DEVICE", "USED", "PEAK"]
    assert wide[1][-7:] == ["mig", "17G", "", "", status["deviceUUID"], "2.0Gi", "3.0Gi"]


def test_kubectl_get_gn_shows_the_columns(kube_cluster: Any, api: Any, crds: None) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuNode",
        "metadata": {"name": name},
        "spec": {"nodeName": name},
    }
    api.create_cluster_custom_object(GROUP, VERSION, NODES, body)
    try:
        models = [
            {
                "name": "h200-141gb",
                "profiles": [
                    {
                        "name": "1g.18gb",
                        "id": 19,
                        "slices": 1,
                        "memoryMiB": 16384,
                        "sm": 16,
                        "maxInstances": 7,
                        "placements": [{"start": s, "size": 1} for s in range(7)],
                    }
                ],
            }
        ]
        gpu = {
            "index": 0,
            "uuid": "GPU-1",
            "product": "NVIDIA H200",
            "model": "h200-141gb",
            "memoryMiB": 143771,
            "migCapable": True,
            "migEnabled": True,
            "instances": [
                {
                    "giId": 9,
                    "ciId": 0,
                    "profile": "1g.18gb",
                    "profileId": 19,
                    "start": 0,
                    "size": 1,
                    "deviceUUID": "MIG-1",
                    "inUse": False,
                    "slice": "",
                }
            ],
            "fractions": [],
        }
        status = {
            "models": models,
            "gpus": [gpu],
            "gpuCount": 2,
            "migGpuCount": 1,
            "freeSlots": 7,
            "usedSlots": 0,
            "idleSlots": 1,
            "idleInstances": 1,
            "inUseInstances": 0,
            "fractionSlices": 0,
            "observedAt": "2026-01-01T00:00:00Z",
        }
        api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, name, {"status": status})
        rows = _table(kube_cluster.kubectl("get", "gn", name).stdout)
        assert rows[0] == ["NAME", "GPUS", "MIG GPUS", "INSTANCES IN USE", "IDLE INSTANCES", "SLOTS IN USE",
                           "IDLE SLOTS", "FREE SLOTS", "FRACTIONS", "OBSERVED", "AGE"]
        assert rows[1][:9] == [name, "2", "1", "0", "1", "0", "1", "7", "0"]
        stored = api.get_cluster_custom_object(GROUP, VERSION, NODES, name)
        # Nothing pruned: the schema has every field.
        assert (stored["status"]["models"], stored["status"]["gpus"]) == (models, [gpu])
        changed = dict(stored, spec={"nodeName": "another"})
        with pytest.raises(kubernetes.client.ApiException, match="cannot change"):
            api.replace_cluster_custom_object(GROUP, VERSION, NODES, name, changed)
    finally:
        api.delete_cluster_custom_object(GROUP, VERSION, NODES, name)


def _gpunode(api: Any) -> str:
    name = f"node-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuNode", "metadata": {"name": name},
            "spec": {"nodeName": name}}
    api.create_cluster_custom_object(GROUP, VERSION, NODES, body)
    return name


def test_a_mixed_nodes_status_as_the_agent_builds_it_is_stored_whole(api: Any, crds: None) -> None:
    from mig_operator.core.node.lifecycle import OwnerRecord
    from mig_operator.core.placement.profiles import get_model
    from mig_operator.gpu.protocol import GpuInfo
    from mig_operator.kube.agent.inventory import gpunode_status

    h100, a30, l4 = get_model("h100-80gb"), get_model("a30-24gb"), get_model("l4-24gb")
    boards = [h100, a30, h100, l4]
    infos = [GpuInfo(i, f"GPU-{i}", m.product, m.memory_mib, m.mig_capable, m.mig_capable)
             for i, m in enumerate(boards)]
    status = gpunode_status(infos, {i: m if m.mig_capable else None for i, m in enumerate(boards)},
                            {i: [] for i in range(len(boards))}, OwnerRecord(), True, "2026-01-01T00:00:00.000Z")
    name = _gpunode(api)
    try:
        api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, name, {"status": status})
        stored = api.get_cluster_custom_object(GROUP, VERSION, NODES, name)["status"]
        assert [m["name"] for m in stored["models"]] == ["h100-80gb", "a30-24gb"]
        assert [g["model"] for g in stored["gpus"]] == ["h100-80gb", "a30-24gb", "h100-80gb", ""]
        assert stored == status  # nothing pruned, nothing added
    finally:
        api.delete_cluster_custom_object(GROUP, VERSION, NODES, name)


@pytest.mark.parametrize("models", [None, [], [{"name": "a30-24gb", "profiles": []}]])
def test_a_gpu_naming_a_model_the_status_lacks_is_refused(api: Any, crds: None, models: list | None) -> None:
    name = _gpunode(api)
    try:
        status: dict = {"gpus": [{"index": 0, "uuid": "GPU-0", "model": "h100-80gb"}]}
        if models is not None:
            status["models"] = models
        with pytest.raises(kubernetes.client.ApiException) as refused:
            api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, name, {"status": status})
        assert "every gpus[].model must name an entry of models" in _api_error(refused.value)
        # A GPU without MIG names no model and needs no entry.
        fine = {"models": [], "gpus": [{"index": 0, "uuid": "GPU-0", "model": ""}, {"index": 1, "uuid": "GPU-1"}]}
        api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, name, {"status": fine})
    finally:
        api.delete_cluster_custom_object(GROUP, VERSION, NODES, name)


def test_two_entries_for_one_model_are_refused(api: Any, crds: None) -> None:
    name = _gpunode(api)
    try:
        twice = {"models": [{"name": "h100-80gb", "profiles": []}, {"name": "h100-80gb", "profiles": []}]}
        with pytest.raises(kubernetes.client.ApiException) as refused:
            api.patch_cluster_custom_object_status(GROUP, VERSION, NODES, name, {"status": twice})
        assert "Duplicate value" in _api_error(refused.value)
    finally:
        api.delete_cluster_custom_object(GROUP, VERSION, NODES, name)


def test_gpuslice_is_namespaced_and_gpunode_cluster_scoped(kube_cluster: Any, crds: None) -> None:
    resources = kube_cluster.kubectl("api-resources", "--api-group", GROUP, "-o", "wide").stdout
    rows = {row[0]: row for row in _table(resources)[1:]}
    assert rows["gpuslices"][1:5] == ["gs", f"{GROUP}/{VERSION}", "true", "GpuSlice"]
    assert rows["gpunodes"][1:5] == ["gn", f"{GROUP}/{VERSION}", "false", "GpuNode"]


# --- kubectl explain -------------------------------------------------------------------------


def _schema(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _undocumented(schema: dict, path: str) -> Iterator[str]:
    for name, prop in schema.get("properties", {}).items():
        if name != "metadata" and not prop.get("description", "").strip():
            yield f"{path}.{name}"
        yield from _undocumented(prop, f"{path}.{name}")
        yield from _undocumented(prop.get("items", {}), f"{path}.{name}[]")


def test_every_field_has_a_description() -> None:
    for path in CRD_FILES:
        assert list(_undocumented(_schema(path), path.stem)) == []


def _explain(kube_cluster: Any, resource: str) -> str:
    # The OpenAPI document is rebuilt shortly after a CRD changes; wait for it to list the resource.
    deadline = time.monotonic() + 60
    while True:
        result = kube_cluster.kubectl("explain", resource, check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            assert result.returncode == 0, result.stderr
            return " ".join(result.stdout.split())


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("crd", "resource", "prop_path"),
    [
        (CRD_FILES[0], "gpuslice.spec", ["spec"]),
        (CRD_FILES[0], "gpuslice.status", ["status"]),
        (CRD_FILES[0], "gpuslice.status.placement", ["status", "placement"]),
        (CRD_FILES[1], "gpunode.status", ["status"]),
        (CRD_FILES[1], "gpunode.status.gpus", ["status", "gpus"]),
        (CRD_FILES[1], "gpunode.status.models", ["status", "models"]),
        (CRD_FILES[1], "gpunode.status.models.profiles", ["status", "models", "profiles"]),
        (CRD_FILES[1], "gpunode.status.gpus.instances", ["status", "gpus", "instances"]),
    ],
)
def test_kubectl_explain_documents_every_field(
    crd: Path, resource: str, prop_path: list[str], kube_cluster: Any, crds: None
) -> None:
    schema = _schema(crd)
    for name in prop_path:
        field = schema["properties"][name]
        schema = field.get("items", field)  # a list's fields are its items'
    shown = _explain(kube_cluster, resource)
    assert _words(field["description"]) in shown
    for name, prop in schema["properties"].items():
        # Each field is listed with its type and the start of its description.
        assert re.search(rf"\b{re.escape(name)}\s+<", shown), f"{name} missing from explain {resource}"
        assert _words(prop["description"])[:60] in shown, f"{name}'s description missing from explain {resource}"


def test_kubectl_explain_memory_says_what_it_accepts(kube_cluster: Any, crds: None) -> None:
    shown = _explain(kube_cluster, "gpuslice.spec.memory")
    for phrase in ("Kubernetes quantity", "GB, GiB, MB and MiB", "whole number of bytes", "4Gi"):
        assert phrase in shown
