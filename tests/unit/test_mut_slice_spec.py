"""core.slice_spec: the exact refusals and the length limits' edges (mutation testing, docs/testing.md).

A refusal names the value it refuses (docs/api.md); the limits are the CRD's maxLength values
(crds/gpuslice.yaml): memory 64, migProfile 32, nodeName 253 characters.
"""

from __future__ import annotations

import pytest

from mig_operator.core.quantities import QuantityError
from mig_operator.core.request import RequestError, SliceRequest
from mig_operator.core.slice_spec import (
    check_node_name,
    check_request_unchanged,
    request_from_annotations,
    request_from_spec,
)

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
     'unknown field "spec.another"; a GpuSlice spec has only memory, fraction, migProfile, nodeName, '
     "e.g. memory: '4Gi'"),
    # Keys of any type are named, not compared with one another.
    ({"memory": "1Gi", 3: 1, "b": 2}, 'unknown field "spec.3"; a GpuSlice spec has only memory, fraction, '
     "migProfile, nodeName, e.g. memory: '4Gi'"),
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
