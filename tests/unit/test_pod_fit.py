"""A pod's requests against a node's allocatable, as kube-scheduler's NodeResourcesFit counts them.
Every expected figure below is worked out by hand in the comment beside it."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from mig_operator.core.placement.pod_fit import NodeUse, Shortfall, node_use, pod_requests, shortfalls
from mig_operator.core.requests.quantities import QuantityError, parse_quantity


def container(name: str, restart: str | None = None, **requests: str) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "resources": {"requests": dict(requests)}}
    if restart:
        body["restartPolicy"] = restart
    return body


def bound(phase: str, **requests: str) -> dict[str, Any]:
    return {"spec": {"containers": [container("c", **requests)]}, "status": {"phase": phase}}


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("2", Fraction(2)), ("1.5", Fraction(3, 2)), ("4Gi", Fraction(4 * 2**30)),
    ("1e3", Fraction(1000)), ("0", Fraction(0)), ("100k", Fraction(100_000)), (".5", Fraction(1, 2)),
    ("1n", Fraction(1, 10**9)), ("+3", Fraction(3)), (7, Fraction(7)),
])
def test_a_resource_quantity_is_read_exactly(text: Any, value: Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["-1", "4GB", "1x", "", "²", "1 ", " 1", "٣", "1\n", "1" * 65, True, None, 1.5])
def test_a_malformed_quantity_is_refused(text: Any) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text, "cpu")


def test_the_containers_requests_add_up_in_millicores_and_bytes() -> None:
    spec = {"containers": [container("a", cpu="500m", memory="1Gi"), container("b", cpu="1.5", memory="512Mi")]}
    # cpu 0.5 + 1.5 = 2 cores = 2000m; memory 1024 Mi + 512 Mi = 1536 Mi = 1610612736 bytes.
    assert pod_requests(spec) == {"cpu": 2000, "memory": 1536 * 2**20}


def test_an_init_container_counts_only_when_it_asks_more_than_the_containers() -> None:
    spec = {"initContainers": [container("setup", cpu="4", memory="100Mi")],
            "containers": [container("a", cpu="1", memory="1Gi"), container("b", cpu="1", memory="1Gi")]}
    # cpu: max(4, 1 + 1) = 4 cores; memory: max(100Mi, 2Gi) = 2Gi.
    assert pod_requests(spec) == {"cpu": 4000, "memory": 2 * 2**30}


def test_a_sidecar_adds_to_the_containers_and_to_each_later_init_container() -> None:
    spec = {"initContainers": [container("proxy", "Always", cpu="1"), container("migrate", cpu="3")],
            "containers": [container("app", cpu="2")]}
    # Running together: app 2 + proxy 1 = 3; while migrate runs: migrate 3 + proxy 1 = 4; the pod asks max = 4.
    assert pod_requests(spec) == {"cpu": 4000}
    spec["initContainers"][1]["resources"]["requests"]["cpu"] = "1"
    # migrate 1 + proxy 1 = 2 < 3: the running set's 3.
    assert pod_requests(spec) == {"cpu": 3000}


def test_overhead_and_pod_level_requests() -> None:
    spec = {"containers": [container("a", cpu="1", memory="1Gi", **{"example.com/fpga": "2"})],
            "overhead": {"cpu": "250m", "memory": "120Mi"}}
    # 1000m + 250m; 1Gi + 120Mi = 1144 Mi; the extended resource as is.
    assert pod_requests(spec) == {"cpu": 1250, "memory": 1144 * 2**20, "example.com/fpga": 2}
    spec["resources"] = {"requests": {"cpu": "3", "memory": "2Gi"}}
    # Pod-level requests replace the containers' cpu and memory; the overhead still adds.
    assert pod_requests(spec) == {"cpu": 3250, "memory": 2168 * 2**20, "example.com/fpga": 2}


def test_amounts_round_up_as_the_scheduler_rounds() -> None:
    # 1.0001 cores = 1000.1 millicores, counted 1001; 1.5 bytes counted 2.
    assert pod_requests({"containers": [container("a", cpu="1.0001", memory="1500m")]}) == {"cpu": 1001, "memory": 2}


def test_finished_pods_take_nothing_from_a_node() -> None:
    use = node_use([bound("Running", cpu="6"), bound("Pending", cpu="1"), bound("Succeeded", cpu="8"),
                    bound("Failed", cpu="8")])
    # 6 + 1 cores from the two pods not finished.
    assert use == NodeUse({"cpu": 7000}, 2)


ALLOCATABLE = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def test_a_pod_fits_what_is_left_of_the_allocatable() -> None:
    use = node_use([bound("Running", cpu="8"), bound("Succeeded", cpu="16")])
    asks = pod_requests({"containers": [container("a", cpu="8", memory="8Gi")]})
    assert shortfalls(asks, ALLOCATABLE, use) == ()  # 16 - 8 = 8 cores free: exactly enough
    more = pod_requests({"containers": [container("a", cpu="8500m")]})
    assert shortfalls(more, ALLOCATABLE, use) == (Shortfall("cpu", 8500, 8000, 16000),)


def test_too_small_a_node_says_what_it_lacks() -> None:
    asks = pod_requests({"containers": [container("a", cpu="8", memory="100Gi", **{"example.com/fpga": "1"})]})
    found = shortfalls(asks, {"cpu": "2", "memory": "64Gi", "pods": "110"}, NodeUse({}, 0))
    assert [s.resource for s in found] == ["cpu", "example.com/fpga", "memory"]
    assert found[0].describe("n1") == "cpu: the pod asks 8, node n1 has 2 free of 2 allocatable"
    assert found[2].describe("n1") == "memory: the pod asks 100Gi, node n1 has 64Gi free of 64Gi allocatable"


def test_a_full_node_takes_no_pod_even_one_asking_nothing() -> None:
    asks = pod_requests({"containers": [{"name": "a"}]})
    assert asks == {}
    assert shortfalls(asks, {"pods": "3"}, NodeUse({}, 2)) == ()
    [full] = shortfalls(asks, {"pods": "3"}, NodeUse({}, 3))
    assert full.resource == "pods" and full.describe("n1") == "pods: node n1 holds 3 of its 3 pods"


def test_a_resource_asked_as_zero_is_not_checked() -> None:
    asks = pod_requests({"containers": [container("a", **{"example.com/fpga": "0"})]})
    assert shortfalls(asks, {"pods": "10"}, NodeUse({}, 0)) == ()
