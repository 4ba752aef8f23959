"""The controller parses a slice's spec once per distinct spec (observe._request): a spec that Python
finds equal to another but a GpuSlice does not (True and 1, 1 and 1.0) never gets the other's answer."""

from __future__ import annotations

import pytest

from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.slice_spec import request_from_spec
from mig_operator.kube.controller.observe import slice_record

SPECS = [{"fraction": True}, {"fraction": 1}, {"fraction": 1.0}, {"fraction": 0.5}, {"memory": "4G"},
         {"memory": 4}, {"memory": True}, {"compute": 1, "memory": "4G"}, {"compute": True, "memory": "4G"},
         {"memory": "4G", "extra": {"a": 1}}, {"memory": ["4G"]}, {"migProfile": "1g.10gb"}]


def _direct(spec: dict) -> tuple[object, str]:
    try:
        return request_from_spec(spec), ""
    except QuantityError as exc:
        return None, str(exc)


def _body(spec: dict) -> dict:
    return {"metadata": {"uid": "u", "namespace": "ns", "name": "s"}, "spec": spec}


@pytest.mark.parametrize("order", [SPECS, SPECS[::-1]])
def test_each_spec_gets_its_own_parse_in_any_order(order: list[dict]) -> None:
    for _ in range(2):  # the second pass is served from the cache
        for spec in order:
            record = slice_record(_body(spec))
            assert (record.request, record.invalid) == _direct(spec), spec
