"""README's install section and docs/operations.md's "Try it without a GPU", checked offline, command by
command, as read from the pages (tests/doc_commands.py): each `helm install` renders with the same flags,
each manifest validates against its schema (the CRD's, or Kubernetes 1.34's for a Pod) and has the shape
a pod needs to get its device, each label and `mig-operator` subcommand is one the code knows.
tests/node/test_readme_install.py runs the same commands on a real node.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from doc_commands import OPERATIONS, README, REPO_ROOT, Command, page_commands
from helm_chart import CHART_DIR, container, workload

from mig_operator.cli.main import build_parser

K8S_SCHEMA_VERSION = "1.34.0"
INSTALL = "Install on a cluster"
NO_GPU = "Try it without a GPU"
# helm install/upgrade flags that only change how helm waits or what it does to the cluster, not what it renders.
CLUSTER_ONLY_FLAGS = {"--wait", "--timeout", "--create-namespace", "--reset-then-reuse-values", "--atomic"}
RENDER_FLAGS = {"--namespace", "-n", "--set", "--set-string", "--values", "-f"}


def crd_schema(kind: str) -> dict[str, Any]:
    for path in (REPO_ROOT / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == kind:
                [version] = [v for v in doc["spec"]["versions"] if v["storage"]]
                return version["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD of kind {kind} in crds/")


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the schema does not declare (the API server prunes them: a typo would be lost silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and "properties" in schema:
        found = [f"{path}.{k}" for k in value if k not in schema["properties"]]
        for key, item in value.items():
            if key in schema["properties"]:
                found += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
        return found
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value) for f in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


def option(argv: list[str], *names: str) -> list[str]:
    """The values of an option, written `--name value` or `--name=value`."""
    found = []
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                found.append(argv[i + 1])
            elif word.startswith(name + "="):
                found.append(word.split("=", 1)[1])
    return found


def helm_template_args(argv: list[str]) -> tuple[str, list[str]]:
    """`helm install|upgrade RELEASE CHART FLAGS`: the release and the flags that change what it renders;
    a flag this test does not know fails, so that a new one is looked at here."""
    assert argv[:2] in (["helm", "install"], ["helm", "upgrade"]), argv
    release, chart = argv[2], argv[3]
    assert (REPO_ROOT / chart).resolve() == CHART_DIR, f"the page installs {chart}, not the repository's chart"
    flags, i = [], 4
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        takes_value = "=" not in argv[i] and name in RENDER_FLAGS | {"--timeout"}
        if name in RENDER_FLAGS:
            flags += argv[i:i + 2] if takes_value else [argv[i]]
        else:
            assert name in CLUSTER_ONLY_FLAGS, f"{argv[i]}: a flag of {' '.join(argv[:2])} this test does not know"
        i += 2 if takes_value else 1
    return release, flags


def manifests(command: Command) -> list[dict[str, Any]]:
    assert command.stdin, f"{command.line}: no here-document"
    return [d for d in yaml.safe_load_all(command.stdin) if d]


def namespace_of(argv: list[str]) -> str:
    [ns] = option(argv, "-n", "--namespace") or ["default"]
    return ns


@pytest.fixture(scope="module")
def readme() -> list[Command]:
    return page_commands(README, INSTALL)


def test_every_install_command_of_the_readme_is_one_this_file_checks(readme: list[Command]) -> None:
    known = {("helm", "install"), ("kubectl", "create"), ("kubectl", "label"), ("kubectl", "apply"),
             ("kubectl", "get"), ("mig-operator", "check")}
    for command in readme:
        argv = command.argv
        key = (argv[0], _kubectl_verb(argv) if argv[0] == "kubectl" else argv[1])
        assert key in known, f"README: `{command.line}` is a command this test does not check"
    assert 20 >= sum(c.script.count("\n") for c in readme), "README's install: more than 20 lines of commands"


def _kubectl_verb(argv: list[str]) -> str:
    """kubectl's verb, after its global flags (`kubectl -n team-a apply`)."""
    i = 1
    while argv[i].startswith("-"):
        i += 2 if "=" not in argv[i] else 1
    return argv[i]


def test_the_helm_install_renders_with_its_flags_and_names_the_image_it_sets(
        readme: list[Command], render: Callable[..., list[dict[str, Any]]]) -> None:
    [install] = [c for c in readme if c.argv[:2] == ["helm", "install"]]
    release, flags = helm_template_args(install.argv)
    namespace = namespace_of(install.argv)
    docs = render(*flags, release=release, namespace=namespace)
    [repository] = [v.split("=", 1)[1] for v in option(install.argv, "--set") if v.startswith("image.repository=")]
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images and all(i.startswith(repository + ":") for i in images), images
    # The namespace it creates and labels for privileged pods is the one it installs into.
    assert f"kubectl create namespace {namespace}" in [c.line for c in readme]
    assert any(c.argv[:4] == ["kubectl", "label", "namespace", namespace]
               and "pod-security.kubernetes.io/enforce=privileged" in c.argv for c in readme)


def test_the_node_labels_are_the_ones_the_chart_and_the_controller_read(
        readme: list[Command], render: Callable[..., list[dict[str, Any]]]) -> None:
    from mig_operator.kube.common.names import MIG_NODE_LABEL

    labels = [w for c in readme if c.argv[:3] == ["kubectl", "label", "node"] for w in c.argv[4:]]
    assert f"{MIG_NODE_LABEL}=mig" in labels
    # The agents' nodeSelector is a prerequisite (GPU Feature Discovery's label), named in the checklist.
    selector = workload(render(), "DaemonSet", "agent")["spec"]["template"]["spec"]["nodeSelector"]
    for key, value in selector.items():
        assert f"`{key}={value}`" in README.read_text().split(f"## {INSTALL}", 1)[1]


def test_the_mig_operator_commands_are_subcommands_of_the_cli(readme: list[Command]) -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command in readme:
        if command.argv[0] == "mig-operator":
            assert command.argv[1] in sub.choices, f"README runs `{command.line}`: no such subcommand"
            sub.choices[command.argv[1]].parse_args(command.argv[2:])


def test_every_manifest_validates_and_a_pod_uses_a_slice_through_its_claim(readme: list[Command]) -> None:
    from mig_operator.core.requests.quantities import parse_memory

    slices: set[tuple[str, str]] = set()
    claim_pods, annotated_pods = [], []
    slice_schema = crd_schema("GpuSlice")
    for command in readme:
        if "apply" not in command.argv:
            continue
        namespace = namespace_of(command.argv)
        for doc in manifests(command):
            name = doc["metadata"]["name"]
            if doc["kind"] == "GpuSlice":
                jsonschema.validate(doc, slice_schema)
                assert not unknown_fields(doc, slice_schema), unknown_fields(doc, slice_schema)
                assert len({"memory", "fraction", "migProfile"} & set(doc["spec"])) == 1, doc["spec"]
                slices.add((doc["metadata"].get("namespace", namespace), name))
                continue
            assert doc["kind"] == "Pod", doc["kind"]
            try:
                kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"README's pod {name}: {exc.message} at {list(exc.path)}")
            spec = doc["spec"]
            claims = {c["name"]: c.get("resourceClaimName") for c in spec.get("resourceClaims") or []}
            for c in spec["containers"]:
                used = {x["name"] for x in (c.get("resources") or {}).get("claims") or []}
                assert used <= set(claims), (name, used, claims)
                if used:
                    claim_pods.append((doc["metadata"].get("namespace", namespace), name, claims))
            annotations = doc["metadata"].get("annotations") or {}
            if "cdmo.io/gpu-memory" in annotations:
                assert parse_memory(annotations["cdmo.io/gpu-memory"]) > 0
                assert not claims, "an annotated pod gets its claim from the webhook"
                annotated_pods.append(name)
    assert annotated_pods, "README: no pod annotated cdmo.io/gpu-memory"
    assert claim_pods, "README: no pod whose container lists a claim in resources.claims"
    for namespace, name, claims in claim_pods:
        # The claim it names is a slice's: a Ready slice's ResourceClaim has the slice's name.
        assert {(namespace, c) for c in claims.values()} <= slices, (name, claims, slices)


def test_the_schema_checks_here_refuse_a_pod_without_its_claim_and_a_misspelt_field() -> None:
    """Not vacuous: a misspelt GpuSlice field is found, and a Pod field Kubernetes does not know fails."""
    schema = crd_schema("GpuSlice")
    assert unknown_fields({"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "a"},
                           "spec": {"memroy": "1Gi"}}, schema) == [".spec.memroy"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                      "spec": {"containers": [{"name": "c", "image": "i",
                                                               "resources": {"claim": [{"name": "gpu"}]}}]}},
                                     K8S_SCHEMA_VERSION, strict=True)


def test_try_it_without_a_gpu_renders_the_simulator_with_no_runtime_class_or_toolkit(
        render: Callable[..., list[dict[str, Any]]]) -> None:
    commands = page_commands(OPERATIONS, NO_GPU)
    [install] = [c for c in commands if c.argv[:2] == ["helm", "install"]]
    release, flags = helm_template_args(install.argv)
    docs = render(*flags, release=release, namespace=namespace_of(install.argv))
    [backend] = [v.split("=", 1)[1] for v in option(install.argv, "--set") if v.startswith("agent.backend=")]
    assert backend.startswith("sim:")
    agent = container(docs, "DaemonSet", "agent")
    assert f"--backend={backend}" in agent["args"]
    assert [a for a in agent["args"] if a.startswith("--state-file=")], agent["args"]
    assert f"--backend={backend}" in container(docs, "DaemonSet", "mps-host")["args"]
    for part in ("agent", "mps-host"):
        pod = workload(docs, "DaemonSet", part)["spec"]["template"]["spec"]
        assert "runtimeClassName" not in pod, part
        assert not [v for v in pod.get("volumes") or [] if v["name"] == "toolkit-config"], part
    # The node is labelled for the agents' nodeSelector, and for MIG (the simulated H100s are in MIG mode).
    labelled = [w for c in commands if c.argv[:3] == ["kubectl", "label", "node"] for w in c.argv[4:]]
    selector = workload(docs, "DaemonSet", "agent")["spec"]["template"]["spec"]["nodeSelector"]
    assert {f"{k}={v}" for k, v in selector.items()} <= set(labelled)
    assert "cdmo.clear.ml/gpu-partitioning=mig" in labelled
