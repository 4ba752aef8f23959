"""core.requests.slice_spec: the exact refusals and the length limits' edges (mutation testing, docs/testing.md).

A refusal names the value it refuses (docs/api.md); the limits are the CRD's maxLength values
(crds/gpuslice.yaml): memory 64, migProfile 32, nodeName 253 characters.
"""

from __future__ import annotations

import pytest
from slice_spec_reference import check_request_unchanged

from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.request import RequestError, SliceRequest
from mig_operator.core.requests.slice_spec import check_node_name, request_from_annotations, request_from_spec

GiB = 2**30


@pytest.mark.parametrize(("spec", "message"), [
    ([1], "spec [1] must be an object; e.g. {memory: '4Gi'}"),
    ({"memory": 5}, "memory 5 must be of type string; use e.g. '4Gi'"),
    ({"fraction": "0.5"}, "fraction '0.5' must be of type number; use e.g. 0.5"),
    ({"migProfile": 2}, "migProfile 2 must be of type string; use e.g. '2g.35gb'"),
    ({"memory": "1Gi", "nodeName": 7}, "nodeName 7 must be of type string; use e.g. 'gpu-node-1'"),
    ({"memory": "1Gi", "nodeName": "Node_1"},
     "nodeName 'Node_1' is not a node name (lower-case DNS subdomain); use e.g. 'gpu-node-1'"),
    ({"memory": "1Gi", "nodeName": "a" * 254}, "nodeName is too long: may not be more than 253 characters"),
    ({"memory": "1Gi", "extra": 1, "another": 2},
     'unknown field "spec.another"; a GpuSlice spec has only memory, fraction, migProfile, compute, '
     "nodeName, e.g. memory: '4Gi'"),
    # Keys of any type are named, not compared with one another.
    ({"memory": "1Gi", 3: 1, "b": 2}, 'unknown field "spec.3"; a GpuSlice spec has only memory, fraction, '
     "migProfile, compute, nodeName, e.g. memory: '4Gi'"),
    ({"fraction": 0.5, "compute": "0.5"}, "compute '0.5' must be of type number; use e.g. 0.25"),
    ({"memory": "1Gi", "compute": 1.5}, "compute 1.5 must be in (0, 1]; use e.g. '0.25'"),
    ({"migProfile": "1g.10gb", "compute": 0.5},
     "compute cannot be asked of a MIG slice: its compute is its profile's (spec.migProfile); leave compute out, "
     "or ask by memory or fraction, e.g. fraction: 0.5 with compute: 0.25"),
])
def test_spec_refusals_name_the_value(spec, message: str) -> None:
    with pytest.raises(QuantityError) as info:
        request_from_spec(spec)
    assert str(info.value) == message


def test_length_limits_are_inclusive() -> None:
    memory = "0" * 61 + "1Gi"  # 64 characters, one GiB
    assert len(memory) == 64 and request_from_spec({"memory": memory}) == SliceRequest(memory_bytes=GiB)
    with pytest.raises(QuantityError, match="^memory is too long: may not be more than 64 characters$"):
        request_from_spec({"memory": "0" + memory})
    # No MIG profile name is 32 characters long: at 32 the name is judged, at 33 its length.
    with pytest.raises(RequestError, match="is not a MIG profile name"):
        request_from_spec({"migProfile": "x" * 32})
    with pytest.raises(RequestError, match="^migProfile is too long: may not be more than 32 characters$"):
        request_from_spec({"migProfile": "x" * 33})
    node = ".".join(["a" * 63] * 4)[:253]  # 253 characters, labels of letters only
    assert check_node_name(node) == node


@pytest.mark.parametrize(("annotations", "message"), [
    ({"cdmo.io/gpu-memroy": "4G"},
     "annotation cdmo.io/gpu-memroy: '4G' is not a slice annotation (keys are lower case); use one of "
     "cdmo.io/gpu-memory, "
     "cdmo.io/gpu-fraction, cdmo.io/mig-profile, e.g. cdmo.io/gpu-memory: '4Gi'"),
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/mig-profile": "1g.18gb"},
     "a pod may carry only one of cdmo.io/gpu-memory, cdmo.io/gpu-fraction, cdmo.io/mig-profile "
     "(got cdmo.io/gpu-memory: '4G', cdmo.io/mig-profile: '1g.18gb'); e.g. cdmo.io/gpu-memory: '4Gi'"),
])
def test_annotation_refusals(annotations, message: str) -> None:
    with pytest.raises(RequestError) as info:
        request_from_annotations(annotations)
    assert str(info.value) == message


def test_a_changed_request_names_the_old_and_the_new_value() -> None:
    with pytest.raises(RequestError) as info:
        check_request_unchanged({"memory": "4Gi"}, {"memory": "5Gi"})
    assert str(info.value) == (
        "spec.memory cannot change after creation (was '4Gi', now '5Gi'); delete the GpuSlice and create a new one")


def test_two_long_annotations_share_the_quote_budget() -> None:
    # Two values of 200 characters: each is quoted to about half of the ~100 characters one may take.
    with pytest.raises(RequestError) as info:
        request_from_annotations({"cdmo.io/gpu-memory": "x" * 200, "cdmo.io/mig-profile": "y" * 200})
    assert str(info.value) == (
        "a pod may carry only one of cdmo.io/gpu-memory, cdmo.io/gpu-fraction, cdmo.io/mig-profile (got "
        "cdmo.io/gpu-memory: '" + "x" * 49 + "... (200 characters), "
        "cdmo.io/mig-profile: '" + "y" * 49 + "... (200 characters)); e.g. cdmo.io/gpu-memory: '4Gi'")


def test_annotation_values_over_the_length_limits_are_quoted_with_an_example() -> None:
    # 64 characters of memory are judged as a quantity, 65 by their length (the CRD's maxLength).
    with pytest.raises(QuantityError) as judged:
        request_from_annotations({"cdmo.io/gpu-memory": "1" * 64})
    assert "too long" not in str(judged.value) and "larger than 2^63-1 bytes" in str(judged.value)
    with pytest.raises(QuantityError) as long_memory:
        request_from_annotations({"cdmo.io/gpu-memory": "1" * 65})
    assert not isinstance(long_memory.value, RequestError)  # a quantity problem, like every memory refusal
    assert str(long_memory.value) == (
        "annotation cdmo.io/gpu-memory: memory '" + "1" * 65 + "' is too long: may not be more than 64 "
        "characters; use e.g. '4Gi'")
    with pytest.raises(RequestError) as long_profile:
        request_from_annotations({"cdmo.io/mig-profile": "a" * 33})
    assert str(long_profile.value) == (
        "annotation cdmo.io/mig-profile: migProfile '" + "a" * 33 + "' is too long: may not be more than 32 "
        "characters; use e.g. '2g.35gb'")
    # A fraction's limit (32) is the fraction grammar's own, with the same shape of message.
    with pytest.raises(QuantityError) as long_fraction:
        request_from_annotations({"cdmo.io/gpu-fraction": "0." + "5" * 31})
    assert str(long_fraction.value) == (
        "annotation cdmo.io/gpu-fraction: fraction '0." + "5" * 31 + "' is too long: may not be more than 32 "
        "characters; use e.g. '0.5'")
