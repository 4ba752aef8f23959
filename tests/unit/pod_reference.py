"""The GpuSlice spec a pod's annotations ask for, as the tests state it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mig_operator.core.requests.request_forms import pod_devices


def slice_spec_for(annotations: Mapping[str, str]) -> dict[str, Any] | None:
    """The GpuSlice spec a pod's annotations ask for (of its first device; already checked at
    admission, checked again); None when they ask for none."""
    devices = pod_devices(annotations)
    return dict(devices[0].spec) if devices else None
