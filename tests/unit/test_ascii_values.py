"""Every value a tenant writes is read as ASCII with a bounded length, and a value that cannot be read
raises the parser's own error (or makes its object invalid), never another exception.

Python's ``int()`` takes '٣', '１', ' 1', '1_0' and '+1'; ``str.isdigit()`` takes '²' and '①', which
``int()`` then refuses with a bare ValueError. Valid values are checked against a reading done here
digit by digit, not by the code under test.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_operator.cli.flags import address, peering_lifetime, webhook_service
from mig_operator.core.node.cdi import CDI_BASE_VERSION, CDI_DIGIT_NAME_VERSION, cdi_version
from mig_operator.core.placement.compute import parse_compute
from mig_operator.core.requests.compat import CLEARML, CLEARML_LABEL, RUNAI, RUNAI_KEYS, dialect_request
from mig_operator.core.requests.pod_admission import PodRefused, check_pod_devices
from mig_operator.core.requests.quantities import (
    MAX_INTEGER_DIGITS,
    IntegerError,
    QuantityError,
    parse_fraction,
    parse_integer,
    parse_memory,
    read_integer,
)
from mig_operator.core.requests.request import parse_profile_name
from mig_operator.core.requests.request_forms import MAX_POD_DEVICES, mig_resource_request, pod_devices
from mig_operator.core.requests.slice_spec import (
    ANNOTATION_COUNT,
    ANNOTATION_MEMORY,
    POD_ANNOTATIONS,
    request_from_annotations,
    request_from_spec,
)
from mig_operator.core.views.top_view import _named_slices
from mig_operator.gpu.device_files import read_majors
from mig_operator.kube.common.listen import ListenError, split_address
from mig_operator.kube.common.names import GROUP_ANNOTATION, GROUP_SIZE_ANNOTATION
from mig_operator.kube.controller.observe import pod_record, slice_record
from mig_operator.kube.webhook.admission import _ours
from mig_operator.kube.webhook.review import Refused
from mig_operator.kube.webhook.server import WebhookOptions, pod_handlers

# What int() or isdigit() take and the grammar refuses: superscript, circled, Arabic-Indic and
# full-width digits, space, '_', a sign, and more digits than the bound.
ODD = ["²", "①", "٣", "１", " 1", "1 ", "1_0", "+1", "-1", "", "1.0", "0x1", "1\n", "9" * 5000]
HUGE = 12 * 2**20  # 12 MiB of text


def ascii_value(text: str) -> int | None:
    """The number ``text`` writes in ASCII digits, read digit by digit; None when it is not that."""
    if not text or len(text) > MAX_INTEGER_DIGITS or any(c not in "0123456789" for c in text):
        return None
    value = 0
    for c in text:
        value = value * 10 + (ord(c) - ord("0"))
    return value


# Text that is mostly odd: any Unicode, ASCII digits, and the digits int() or isdigit() take.
DIGITS = st.sampled_from("0123456789²①٣１߂໓𝟘 _+-.")
TEXT = st.one_of(st.text(), st.text(DIGITS, max_size=24), st.sampled_from(ODD))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("text", ODD + ["1" * HUGE, "²" * HUGE])
def test_odd_integers_are_refused_with_the_parsers_error(text: str) -> None:
    assert read_integer(text) is None
    with pytest.raises(IntegerError) as refused:
        parse_integer(text, "annotation cdmo.io/gpu-count", "'2'")
    message = str(refused.value)
    assert "annotation cdmo.io/gpu-count" in message and "'2'" in message
    assert len(message) < 400  # the value is quoted clipped, even at 12 MiB


@pytest.mark.parametrize("text", ["0", "7", "0016", "65535", "9" * MAX_INTEGER_DIGITS])
def test_ascii_integers_read_as_written(text: str) -> None:
    assert read_integer(text) == ascii_value(text)
    assert parse_integer(text, "count", "'2'") == ascii_value(text)


def test_bounds_are_inclusive_and_bools_are_not_numbers() -> None:
    assert read_integer("2", 2, 16) == 2 and read_integer("16", 2, 16) == 16
    assert read_integer("1", 2, 16) is None and read_integer("17", 2, 16) is None
    assert read_integer(3, 1, 16) == 3 and read_integer(True) is None and read_integer(2.0) is None


@SETTINGS
@given(TEXT)
def test_any_text_is_read_as_ascii_or_refused(text: str) -> None:
    expected = ascii_value(text)
    assert read_integer(text) == expected
    try:
        assert parse_integer(text, "count", "'2'") == expected
    except IntegerError:
        assert expected is None


# ---- every tenant-facing parser, fed any text --------------------------------------------------


@SETTINGS
@given(TEXT)
def test_value_parsers_raise_only_their_own_error(text: str) -> None:
    for parse in (parse_memory, parse_fraction, parse_compute, parse_profile_name):
        try:
            parse(text)
        except QuantityError:
            pass
    for field in ("memory", "fraction", "migProfile", "compute", "nodeName"):
        try:
            request_from_spec({field: text})
        except QuantityError:
            pass


ANNOTATION_KEYS = st.one_of(st.sampled_from([*POD_ANNOTATIONS, *RUNAI_KEYS]), st.text(max_size=20),
                            st.text(max_size=8).map(lambda t: "cdmo.io/" + t))
ANNOTATIONS = st.dictionaries(ANNOTATION_KEYS, TEXT, max_size=4)


def a_pod(annotations: dict[str, str], labels: dict[str, str] | None = None,
          limits: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "1",
                         "annotations": annotations, "labels": labels or {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits or {}}}]}}


@SETTINGS
@given(ANNOTATIONS, st.dictionaries(st.sampled_from(["nvidia.com/mig-1g.10gb", "nvidia.com/gpu",
                                                     "clear.ml/fraction-1"]), TEXT, max_size=2),
       st.one_of(st.none(), TEXT))
def test_pod_parsers_raise_only_their_own_error(annotations: dict[str, str], limits: dict[str, str],
                                                clearml: str | None) -> None:
    """A pod's annotations, labels and extended resources, each any text: the webhook's handlers
    refuse (Refused) and core's parsers raise QuantityError or PodRefused, nothing else; the
    controller's record of the pod holds the reason instead of raising."""
    pod = a_pod(annotations, {CLEARML_LABEL: clearml} if clearml is not None else {}, limits)
    for parse in (lambda: pod_devices(annotations), lambda: request_from_annotations(annotations),
                  lambda: check_pod_devices(pod), lambda: mig_resource_request(pod),
                  lambda: mig_resource_request(pod, whole_gpus=True),
                  lambda: dialect_request(pod, (RUNAI, CLEARML))):
        try:
            parse()
        except (QuantityError, PodRefused):
            pass
    options = WebhookOptions(listen="127.0.0.1:9443", namespace="ops", compat=(RUNAI, CLEARML))
    for handler in pod_handlers(options).values():
        try:
            handler(pod)
        except Refused:
            pass
    ask = pod_record(pod).ask
    assert bool(ask.reason) == bool(ask.message)


@pytest.mark.parametrize("count", ["²", "①", "٣", "１", " 1", "1_0", "+1", "1" * HUGE])
def test_an_odd_device_count_is_the_pods_refusal(count: str) -> None:
    pod = a_pod({ANNOTATION_MEMORY: "4G", ANNOTATION_COUNT: count})
    ask = pod_record(pod).ask
    assert ask.reason == "InvalidAnnotation" and not ask.devices
    assert ANNOTATION_COUNT in ask.message and "'2'" in ask.message
    with pytest.raises(Refused, match=ANNOTATION_COUNT):
        pod_handlers(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"))["gpu-slice"](pod)


def test_a_record_nested_past_the_decoder_is_the_pods_refusal() -> None:
    ask = pod_record(a_pod({"cdmo.io/requested-resources": "[" * 2000 + "]" * 2000})).ask
    assert ask.reason == "InvalidAnnotation" and "cdmo.io/requested-resources" in ask.message


@pytest.mark.parametrize(("count", "devices"), [("1", 1), ("2", 2), ("16", 16), ("007", 7)])
def test_ascii_device_counts_still_count(count: str, devices: int) -> None:
    assert len(pod_devices({ANNOTATION_MEMORY: "4G", ANNOTATION_COUNT: count})) == devices


# ---- the controller's record of a GpuSlice -------------------------------------------------------


def a_slice(annotations: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"uid": "s1", "namespace": "ns", "name": "odd", "resourceVersion": "1",
                         "annotations": annotations},
            "spec": {"migProfile": "1g.18gb"}, "status": status or {}}


@SETTINGS
@given(st.dictionaries(st.one_of(st.sampled_from([GROUP_ANNOTATION, GROUP_SIZE_ANNOTATION,
                                                  "cdmo.io/eligible-nodes", "cdmo.io/slice-try"]),
                                 st.text(max_size=20)), TEXT, max_size=4))
def test_a_slice_record_never_raises(annotations: dict[str, str]) -> None:
    """Whatever its annotations say, a slice is recorded: grouped, on its own, or invalid naming the
    annotation; a group only of a readable size from 2 to MAX_POD_DEVICES."""
    info = slice_record(a_slice(annotations))
    size = ascii_value(annotations.get(GROUP_SIZE_ANNOTATION) or "")
    grouped = bool(annotations.get(GROUP_ANNOTATION)) and size is not None and 2 <= size <= MAX_POD_DEVICES
    assert (info.group is not None) == grouped
    if grouped:
        assert info.group_size == size
    unreadable = (bool(annotations.get(GROUP_ANNOTATION)) and GROUP_SIZE_ANNOTATION in annotations
                  and size is None)
    assert bool(info.invalid) == unreadable
    if unreadable:
        assert GROUP_SIZE_ANNOTATION in info.invalid and "'2'" in info.invalid


@pytest.mark.parametrize("size", ["²", "①", "٣", "１", " 2", "1_0", "+2", "x", "2" * HUGE])
def test_an_unreadable_group_size_makes_the_slice_invalid(size: str) -> None:
    info = slice_record(a_slice({GROUP_ANNOTATION: "x", GROUP_SIZE_ANNOTATION: size}))
    assert info.group is None and info.request is not None
    assert info.invalid.startswith(f"annotation {GROUP_SIZE_ANNOTATION}: ") and "'2'" in info.invalid
    assert len(info.invalid) < 600


def test_a_bound_slice_keeps_its_device_whatever_its_group_annotation_says() -> None:
    bound = {"phase": "Ready", "node": "n1", "gpu": 0, "mode": "mig", "profile": "1g.18gb", "profileId": 19,
             "placement": {"start": 0, "size": 1}}
    info = slice_record(a_slice({GROUP_ANNOTATION: "x", GROUP_SIZE_ANNOTATION: "²"}, bound))
    assert info.binding is not None and info.group is None and not info.invalid


@pytest.mark.parametrize(("size", "group_size"), [("2", 2), ("16", 16), ("02", 2), ("1", None), ("17", None)])
def test_readable_group_sizes(size: str, group_size: int | None) -> None:
    """A readable size outside 2 to 16 is no group: the slice is planned on its own, as one."""
    info = slice_record(a_slice({GROUP_ANNOTATION: "job", GROUP_SIZE_ANNOTATION: size}))
    assert not info.invalid
    assert (info.group, info.group_size) == (("job", group_size) if group_size else (None, 1))


# ---- the other readers of whole numbers ----------------------------------------------------------


@pytest.mark.parametrize("port", ["²", "٣", "１", " 1", "1_0", "+1", "0", "65536", "9" * 5000])
def test_ports_are_ascii(port: str) -> None:
    with pytest.raises(ListenError):
        split_address(f"127.0.0.1:{port}")
    with pytest.raises(QuantityError):
        address("--webhook", f"127.0.0.1:{port}", "127.0.0.1:9443")
    with pytest.raises(QuantityError):
        webhook_service(f"ops/hook:{port}")
    with pytest.raises(QuantityError):
        peering_lifetime(port)


def test_ascii_ports_still_parse() -> None:
    assert split_address("[::1]:9443") == ("::1", 9443)
    assert address("--webhook", ":65535", ":1") == ":65535"
    assert webhook_service("ops/hook:443") == "ops/hook:443"
    assert peering_lifetime("10") == 10


def test_text_from_tools_and_names_is_read_as_ascii(tmp_path: Any) -> None:
    assert _ours("gpu-slice-3") and not _ours("gpu-slice-٣") and not _ours("gpu-slice-²")
    assert _named_slices("3g.40gb") == 3 and _named_slices("³g.40gb") == 0
    assert cdi_version("7f0c") == CDI_DIGIT_NAME_VERSION and cdi_version("٣f0c") == CDI_BASE_VERSION
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text("Character devices:\n195 nvidia\n٣ odd\n²5 odder\n")
    assert read_majors(str(tmp_path)) == {"nvidia": 195}


def test_mps_server_pids_are_ascii() -> None:
    from mig_operator.gpu.mps import MpsDaemons

    class Answers(MpsDaemons):
        def __init__(self) -> None:  # no daemon: only the parsing of its answer
            pass

        def command(self, gpu_uuid: str, line: str) -> str:
            return "12 ٣ ² 0x5 7\n"

    assert Answers().servers("GPU-1") == [12, 7]
