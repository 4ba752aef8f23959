"""core/books/claim_owner.py: which ResourceClaim may have a slice's device prepared (issue 24)."""

from __future__ import annotations

import pytest

from mig_operator.core.books.claim_owner import claim_refusal

SLICE = "team-a/nb"
UID = "3f1c0a2e-0000-4000-8000-000000000001"


def owner(uid: str = UID, controller: object = True, kind: str = "GpuSlice",
          api_version: str = "cdmo.io/v1alpha1") -> dict:
    return {"apiVersion": api_version, "kind": kind, "name": "nb", "uid": uid, "controller": controller}


@pytest.mark.parametrize(("namespace", "name", "refs", "why"), [
    ("team-a", "nb", [owner()], None),  # the controller's claim
    ("team-a", "nb", [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "x"}, owner()], None),
    ("team-b", "nb", [owner()], "this is ResourceClaim team-b/nb"),  # forged owner, other namespace
    ("team-b", "steal", [], "this is ResourceClaim team-b/steal"),
    ("team-a", "other", [owner()], "this is ResourceClaim team-a/other"),
    ("team-a", "nb", [], "not controlled by a GpuSlice"),
    ("team-a", "nb", [owner(controller=None)], "not controlled by a GpuSlice"),
    ("team-a", "nb", [owner(controller="true")], "not controlled by a GpuSlice"),  # a string is not true
    ("team-a", "nb", [owner(kind="Pod")], "not controlled by a GpuSlice"),
    ("team-a", "nb", [owner(api_version="evil.io/v1")], "not controlled by a GpuSlice"),
    ("team-a", "nb", [owner(uid="another")], "controlled by GpuSlice UID another, not by this slice"),
    ("team-a", "nb", ["junk", owner(uid="")], "controlled by GpuSlice UID , not by this slice"),
])
def test_only_the_slices_own_claim(namespace: str, name: str, refs: list, why: str | None) -> None:
    refusal = claim_refusal({"namespace": namespace, "name": name, "ownerReferences": refs}, UID, SLICE)
    if why is None:
        assert refusal is None
    else:
        assert refusal is not None and why in refusal
        assert refusal.startswith(f"belongs to GpuSlice {SLICE} (uid {UID}) and is prepared only for that "
                                  f"slice's own ResourceClaim {SLICE}")


def test_a_slice_whose_name_the_agent_does_not_know_matches_no_claim() -> None:
    assert claim_refusal({"namespace": "", "name": "", "ownerReferences": [owner()]}, UID, "") is not None
