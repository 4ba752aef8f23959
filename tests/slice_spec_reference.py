"""What the GpuSlice CRD's transition rules (``self == oldSelf``) check, in Python: the reference
the CRD's CEL is tested against."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mig_operator.core.requests.quantities import clip_repr
from mig_operator.core.requests.request import RequestError
from mig_operator.core.requests.slice_spec import IMMUTABLE_FIELDS


def check_request_unchanged(old_spec: Mapping[str, Any], new_spec: Mapping[str, Any]) -> None:
    """Refuse an update that changes the request (the CRD's transition rules, ``self == oldSelf``)."""
    for name in IMMUTABLE_FIELDS:
        if (name in old_spec) != (name in new_spec) or old_spec.get(name) != new_spec.get(name):
            raise RequestError(
                f"spec.{name} cannot change after creation (was {clip_repr(old_spec.get(name))}, "
                f"now {clip_repr(new_spec.get(name))}); delete the GpuSlice and create a new one"
            )
