"""mig_operator.core.requests.slice_spec: the GpuSlice request rules in Python, on the corpus the CRD shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from slice_spec_reference import check_request_unchanged

from mig_operator.core.requests.quantities import MAX_BYTES, QuantityError
from mig_operator.core.requests.request import MIN_FRACTION, MIN_SLICE_BYTES, RequestError, SliceRequest
from mig_operator.core.requests.slice_spec import (
    ANNOTATION_FRACTION,
    ANNOTATION_MEMORY,
    ANNOTATION_PROFILE,
    check_node_name,
    request_from_annotations,
    request_from_spec,
)

CORPUS = yaml.safe_load((Path(__file__).parents[1] / "corpus" / "gpuslice_specs.yaml").read_text())


def _ids(cases: list[dict]) -> list[str]:
    return [case["name"] for case in cases]


def test_corpus_is_big_enough_and_names_are_unique() -> None:
    # The e2e test needs at least 30 refusals to send to the API server.
    assert len(CORPUS["invalid"]) >= 30
    names = _ids(CORPUS["valid"]) + _ids(CORPUS["invalid"]) + _ids(CORPUS["updates"])
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", CORPUS["valid"], ids=_ids(CORPUS["valid"]))
def test_valid_specs_are_accepted(case: dict) -> None:
    request = request_from_spec(case["spec"])
    if "bytes" in case:
        assert request.memory_bytes == case["bytes"]
    if "fraction" in case["spec"]:
        assert request.fraction == case["spec"]["fraction"]
    if "migProfile" in case["spec"]:
        assert request.profile == case["spec"]["migProfile"]
    assert request.compute == case["spec"].get("compute")


@pytest.mark.parametrize("case", CORPUS["invalid"], ids=_ids(CORPUS["invalid"]))
def test_invalid_specs_are_refused_with_the_corpus_message(case: dict) -> None:
    with pytest.raises(QuantityError) as refused:
        request_from_spec(case["spec"])
    message = str(refused.value)
    assert case["message"].lower() in message.lower()
    # The message is about the field the corpus names, and says so first (the API server prefixes the
    # full path itself); a message about another field fails here even if it contains this one's name.
    if case["field"] == "spec":
        assert message.startswith("a slice needs exactly one of memory, fraction, migProfile")
    elif case["message"] == "unknown field":
        assert message.startswith(f'unknown field "{case["field"]}"')
    else:
        assert message.startswith(case["field"].removeprefix("spec.") + " ")


@pytest.mark.parametrize("case", CORPUS["updates"], ids=_ids(CORPUS["updates"]))
def test_request_changes_are_refused(case: dict) -> None:
    request_from_spec(case["old"])
    with pytest.raises(RequestError) as refused:
        check_request_unchanged(case["old"], case["new"])
    assert str(refused.value).startswith(f"{case['field']} {case['message']} (was ")


def test_unchanged_request_passes() -> None:
    spec = {"memory": "4Gi", "nodeName": "gpu-node-1"}
    check_request_unchanged(spec, dict(spec))


def test_refusals_show_a_valid_example() -> None:
    for spec in ({"memory": "4X"}, {"fraction": 2}, {"migProfile": "big"}, {}):
        with pytest.raises(QuantityError) as refused:
            request_from_spec(spec)
        assert "e.g." in str(refused.value)


def test_non_mapping_spec_is_refused() -> None:
    with pytest.raises(RequestError, match="must be an object"):
        request_from_spec(["memory", "4Gi"])  # type: ignore[arg-type]


# --- annotations ---------------------------------------------------------------------------


def test_no_slice_annotation_means_no_request() -> None:
    assert request_from_annotations(None) is None
    assert request_from_annotations({}) is None
    assert request_from_annotations({"app": "x", "cdmo.clear.ml/queue": "q"}) is None
    # What the webhook records of a pod's nvidia.com/mig-* request is informational: no request.
    assert request_from_annotations({"cdmo.io/requested-resources": '{"c":{"nvidia.com/mig-1g.10gb":"1"}}'}) is None


@pytest.mark.parametrize("key", ["cdmo.io/gpu", "cdmo.io/slice", "CDMO.IO/gpus", "cdmo.io/gpu-counts",
                                 "cdmo.io/Requested-Resources", "cdmo.io/"])
def test_an_unknown_cdmo_annotation_is_refused_with_the_known_keys(key: str) -> None:
    with pytest.raises(RequestError) as caught:
        request_from_annotations({key: "1"})
    message = str(caught.value)
    assert f"annotation {key}: '1' is not a slice annotation" in message
    assert "cdmo.io/gpu-memory, cdmo.io/gpu-fraction, cdmo.io/mig-profile" in message


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({ANNOTATION_MEMORY: "4G"}, SliceRequest(memory_bytes=4 * 10**9)),
        ({ANNOTATION_MEMORY: "4Gi"}, SliceRequest(memory_bytes=4 * 2**30)),
        ({ANNOTATION_MEMORY: "4096MiB"}, SliceRequest(memory_bytes=4 * 2**30)),
        ({ANNOTATION_FRACTION: "0.5"}, SliceRequest(fraction=0.5)),
        ({ANNOTATION_FRACTION: "1"}, SliceRequest(fraction=1.0)),
        ({ANNOTATION_PROFILE: "2g.35gb", "other": "kept"}, SliceRequest(profile="2g.35gb")),
    ],
)
def test_annotations_give_a_request(annotations: dict, expected: SliceRequest) -> None:
    assert request_from_annotations(annotations) == expected


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({ANNOTATION_MEMORY: "4Gi", ANNOTATION_FRACTION: "0.5"}, "only one of"),
        ({ANNOTATION_MEMORY: "4X"}, "cdmo.io/gpu-memory: memory '4X' has an unknown unit"),
        ({ANNOTATION_MEMORY: "0"}, "greater than zero"),
        ({ANNOTATION_MEMORY: "1e400"}, "out of range"),
        ({ANNOTATION_MEMORY: "1.9999999999"}, "more than nine decimal places"),
        ({ANNOTATION_FRACTION: "1.5"}, "cdmo.io/gpu-fraction: fraction '1.5' must be in (0, 1]"),
        ({ANNOTATION_FRACTION: "half"}, "is not a number"),
        ({ANNOTATION_FRACTION: "nan"}, "is not a number"),
        ({ANNOTATION_FRACTION: "0.2_5"}, "cdmo.io/gpu-fraction: fraction '0.2_5' is not a number"),
        ({ANNOTATION_FRACTION: "1e-1"}, "fraction '1e-1' is not a number"),
        ({ANNOTATION_FRACTION: " 0.5"}, "fraction ' 0.5' is not a number"),
        ({ANNOTATION_FRACTION: "\uff10.\uff15"}, "is not a number"),
        ({ANNOTATION_FRACTION: "inf"}, "is not a number"),
        ({ANNOTATION_FRACTION: "-1"}, "cdmo.io/gpu-fraction: fraction '-1' must be in (0, 1]; use e.g. '0.5'"),
        ({ANNOTATION_FRACTION: "0.000000000000000000001"},
         "cdmo.io/gpu-fraction: fraction '0.000000000000000000001' is below the smallest share, 0.01"),
        ({ANNOTATION_MEMORY: "512Mi"}, "cdmo.io/gpu-memory: memory '512Mi' is below the smallest slice, 1Gi"),
        ({ANNOTATION_PROFILE: "2g.35gb\n"}, "is not a MIG profile name"),
        ({"cdmo.io/gpu-memroy": "4Gi"}, "annotation cdmo.io/gpu-memroy: '4Gi' is not a slice annotation"),
        ({"cdmo.io/GPU-memory": "4Gi"}, "annotation cdmo.io/GPU-memory: '4Gi' is not a slice annotation"),
        ({"cdmo.io/mig-profiles": "1g.10gb"}, "annotation cdmo.io/mig-profiles: '1g.10gb' is not a slice annotation"),
        ({"CDMO.IO/MIG-PROFILE": "1g.10gb"}, "annotation CDMO.IO/MIG-PROFILE: '1g.10gb' is not a slice annotation"),
    ],
)
def test_bad_annotations_are_refused(annotations: dict, message: str) -> None:
    with pytest.raises(QuantityError) as refused:
        request_from_annotations(annotations)
    assert message in str(refused.value)


def test_long_values_are_quoted_short() -> None:
    cases = [
        {"nodeName": "N" * 5000, "memory": "4Gi"},
        {"migProfile": ["x"] * 5000},
        {"fraction": "0." + "5" * 5000},
        {"memory": 10**5000},
        {"z" * 5000: 1, "memory": "4Gi"},
    ]
    for spec in cases:
        with pytest.raises(QuantityError) as refused:
            request_from_spec(spec)
        assert len(str(refused.value)) < 400, str(refused.value)[:500]
    with pytest.raises(QuantityError) as refused:
        request_from_annotations({ANNOTATION_FRACTION: "9" * 5000})
    assert len(str(refused.value)) < 400 and "5000 characters" in str(refused.value)
    with pytest.raises(RequestError) as refused:
        check_request_unchanged({"memory": "4Gi"}, {"memory": "1" * 5000})
    assert len(str(refused.value)) < 400 and str(refused.value).startswith("spec.memory cannot change")


def test_annotation_errors_keep_their_type() -> None:
    with pytest.raises(RequestError):
        request_from_annotations({ANNOTATION_PROFILE: "big"})
    with pytest.raises(QuantityError):
        request_from_annotations({ANNOTATION_MEMORY: "-1G"})


@pytest.mark.parametrize("name", ["gpu-node-1", "a", "node.example.com", "0ab"])
def test_node_names_accepted(name: str) -> None:
    assert check_node_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "A", "a..b", "a_b", "a" * 254, 7])
def test_node_names_refused(name: object) -> None:
    with pytest.raises(RequestError):
        check_node_name(name)


# --- properties ----------------------------------------------------------------------------

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_ALIASES = {"GB": "G", "MB": "M", "GIB": "Gi", "MIB": "Mi"}


@given(st.integers(min_value=2**30, max_value=MAX_BYTES))
def test_any_byte_count_from_the_floor_up_is_accepted_as_itself(count: int) -> None:
    assert request_from_spec({"memory": str(count)}).memory_bytes == count


@given(st.integers(min_value=1, max_value=2**30 - 1))
def test_any_byte_count_below_one_gibibyte_is_refused_with_the_floor(count: int) -> None:
    # The floor is 1 GiB, written here as a number, not taken from the code under test.
    with pytest.raises(QuantityError, match=rf"memory '{count}' is below the smallest slice, 1Gi .* e\.g\. '4Gi'"):
        request_from_spec({"memory": str(count)})
    with pytest.raises(QuantityError, match=rf"annotation {ANNOTATION_MEMORY}: memory '{count}' is below"):
        request_from_annotations({ANNOTATION_MEMORY: str(count)})


def test_the_floor_is_one_gibibyte_to_the_byte() -> None:
    assert MIN_SLICE_BYTES == 1073741824
    assert request_from_spec({"memory": "1073741824"}).memory_bytes == 1073741824
    assert request_from_spec({"memory": "1Gi"}).memory_bytes == 1073741824
    assert request_from_annotations({ANNOTATION_MEMORY: "1GiB"}).memory_bytes == 1073741824
    for below in ("1073741823", "1G", "1023Mi", "1073741.823k"):
        with pytest.raises(QuantityError, match="below the smallest slice, 1Gi"):
            request_from_spec({"memory": below})
        with pytest.raises(QuantityError, match="below the smallest slice, 1Gi"):
            request_from_annotations({ANNOTATION_MEMORY: below})


def test_the_smallest_share_is_one_hundredth() -> None:
    assert MIN_FRACTION == 0.01
    assert request_from_spec({"fraction": 0.01}).fraction == 0.01
    assert request_from_annotations({ANNOTATION_FRACTION: "0.01"}).fraction == 0.01
    # Written in plain decimal to nine places, as the API server's message writes them.
    for below, shown in ((0.0099999, "0.0099999"), (0.00002, "0.00002"), (0.009999999999, "0.01"), (5e-324, "0")):
        with pytest.raises(QuantityError) as refused:
            request_from_spec({"fraction": below})
        assert str(refused.value) == f"fraction {shown} is below the smallest share, 0.01; use e.g. '0.5'"
    for below in ("0.0099999", "0.000000000000000000001", ".001"):
        with pytest.raises(QuantityError, match=rf"annotation {ANNOTATION_FRACTION}: fraction '{below}' is below"):
            request_from_annotations({ANNOTATION_FRACTION: below})


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(sorted(_UNITS)))
def test_whole_units_give_their_bytes(count: int, unit: str) -> None:
    if count * _UNITS[unit] < 2**30:
        count = -(-(2**30) // _UNITS[unit])  # the least count of this unit at or above the floor
    assert request_from_spec({"memory": f"{count}{unit}"}).memory_bytes == count * _UNITS[unit]


@given(
    st.integers(min_value=1100, max_value=10**6),
    st.sampled_from(sorted(_ALIASES)),
    st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_aliases_in_any_case_equal_their_unit(count: int, alias: str, upper: list[bool]) -> None:
    spelt = "".join(c if up else c.lower() for c, up in zip(alias, upper + [True], strict=False))
    expected = request_from_spec({"memory": f"{count}{_ALIASES[alias]}"})
    assert request_from_spec({"memory": f"{count}{spelt}"}) == expected


@given(st.integers(min_value=MAX_BYTES + 1, max_value=10**30))
def test_counts_beyond_int64_are_refused(count: int) -> None:
    with pytest.raises(QuantityError, match="larger than 2\\^63-1 bytes"):
        request_from_spec({"memory": str(count)})


@given(st.integers(min_value=-(10**12), max_value=0))
def test_zero_and_negatives_are_refused(count: int) -> None:
    with pytest.raises(QuantityError, match="greater than zero"):
        request_from_spec({"memory": str(count)})


@given(st.floats(min_value=0.01, max_value=1.0))
def test_fractions_in_range_are_accepted(value: float) -> None:
    assert request_from_spec({"fraction": value}).fraction == value


@given(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True)))
def test_fractions_out_of_range_are_refused(value: float) -> None:
    with pytest.raises(QuantityError):
        request_from_spec({"fraction": value})


@given(st.text(max_size=80))
def test_any_memory_text_is_accepted_or_refused_cleanly(text: str) -> None:
    # Never a crash or another exception type: an annotation can hold anything.
    try:
        request = request_from_spec({"memory": text})
    except QuantityError as error:
        assert "memory" in str(error)
    else:
        assert request.memory_bytes is not None and 1 <= request.memory_bytes <= MAX_BYTES


@given(st.integers(min_value=2**30, max_value=10**12), st.integers(min_value=1, max_value=9))
def test_up_to_nine_places_are_judged_by_value_alone(whole: int, places: int) -> None:
    # 'N.000' with up to nine zeros is the whole number N; ten or more places are refused outright.
    assert request_from_spec({"memory": f"{whole}.{'0' * places}"}).memory_bytes == whole
    with pytest.raises(QuantityError, match="nine decimal places"):
        request_from_spec({"memory": f"{whole}.{'0' * (places + 9)}"})


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "memory": st.sampled_from(["4Gi", "8G"]),
            "fraction": st.sampled_from([0.25, 0.5]),
            "migProfile": st.sampled_from(["1g.18gb", "2g.35gb"]),
            "nodeName": st.sampled_from(["a", "b"]),
        },
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "memory": st.sampled_from(["4Gi", "8G"]),
            "fraction": st.sampled_from([0.25, 0.5]),
            "migProfile": st.sampled_from(["1g.18gb", "2g.35gb"]),
            "nodeName": st.sampled_from(["a", "b"]),
        },
    ),
)
def test_only_identical_specs_pass_the_update_check(old: dict, new: dict) -> None:
    if old == new:
        check_request_unchanged(old, new)
    else:
        with pytest.raises(RequestError, match="cannot change after creation"):
            check_request_unchanged(old, new)
