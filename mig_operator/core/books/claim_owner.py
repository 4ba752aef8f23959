"""Whether a ResourceClaim may have a slice's device prepared: only the slice's own claim may.

A slice's device is published under the slice's UID, and the controller writes one claim per slice:
same namespace and name as the slice, controlled by it (ownerReferences). kube-scheduler hands a
device to any claim whose selector matches it, so a claim written elsewhere (another namespace's
selector naming this slice, ``allocationMode: All``) could be allocated the device; the agent
prepares nothing for it. Pure: the caller reads the claim and knows the slice.
"""

from __future__ import annotations

from collections.abc import Mapping

SLICE_OWNER_KIND = "GpuSlice"
SLICE_OWNER_GROUP = "cdmo.io"


def controlling_slice(metadata: Mapping) -> str | None:
    """The UID of the GpuSlice that controls an object (its ownerReference with ``controller: true``)."""
    for ref in metadata.get("ownerReferences") or []:
        if not isinstance(ref, Mapping) or ref.get("controller") is not True:
            continue
        if ref.get("kind") == SLICE_OWNER_KIND and str(ref.get("apiVersion", "")).split("/")[0] == SLICE_OWNER_GROUP:
            return str(ref.get("uid") or "")
    return None


def claim_refusal(claim_metadata: Mapping, slice_uid: str, slice_ref: str) -> str | None:
    """Why the claim with ``claim_metadata`` must not get the device of slice ``slice_ref``
    (``namespace/name``, UID ``slice_uid``), as the tail of a sentence naming the device; None when
    it is that slice's own claim."""
    claim = f"{claim_metadata.get('namespace', '')}/{claim_metadata.get('name', '')}"
    owner = controlling_slice(claim_metadata)
    if claim != slice_ref:
        why = f"this is ResourceClaim {claim}"
    elif owner is None:
        why = f"ResourceClaim {claim} is not controlled by a GpuSlice (no ownerReference with controller: true)"
    elif owner != slice_uid:
        why = f"ResourceClaim {claim} is controlled by GpuSlice UID {owner}, not by this slice"
    else:
        return None
    return (f"belongs to GpuSlice {slice_ref} (uid {slice_uid}) and is prepared only for that slice's own "
            f"ResourceClaim {slice_ref}; {why}. To get a device, create a GpuSlice in your own namespace "
            f"(or annotate the pod with cdmo.io/gpu-memory)")
