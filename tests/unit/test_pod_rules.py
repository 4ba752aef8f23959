"""Issue 19 item 17: a pod's taints and tolerations, and the back-off after its slice Failed.

Expected values are written out by hand from the scheduler's documented rules (a toleration matches
a taint when its effect is empty or equal, and operator Exists with an empty or equal key, or
operator Equal with equal key and value) and from the stated back-off (5 s doubling, four slices).
"""

from __future__ import annotations

import pytest

from mig_operator.core.node.lifecycle import SLICE_TRIES, slice_retry_delay
from mig_operator.core.placement.node_selection import taints_tolerated

RESERVED = {"key": "team", "value": "a", "effect": "NoSchedule"}
EVICT = {"key": "gpu", "value": "broken", "effect": "NoExecute"}
SOFT = {"key": "busy", "value": "yes", "effect": "PreferNoSchedule"}


def spec(*tolerations: dict) -> dict:
    return {"tolerations": list(tolerations)}


@pytest.mark.parametrize(("tolerations", "taints", "tolerated"), [
    ((), (), True),
    ((), (SOFT,), True),  # PreferNoSchedule only discourages
    ((), (RESERVED,), False),
    ((), (EVICT,), False),
    (({"key": "team", "operator": "Equal", "value": "a", "effect": "NoSchedule"},), (RESERVED,), True),
    (({"key": "team", "value": "a"},), (RESERVED,), True),  # Equal is the default; empty effect: any
    (({"key": "team", "value": "b"},), (RESERVED,), False),  # another value
    (({"key": "Team", "value": "a"},), (RESERVED,), False),  # keys are case-sensitive
    (({"key": "team", "value": "a", "effect": "NoExecute"},), (RESERVED,), False),  # another effect
    (({"key": "team", "operator": "Exists"},), (RESERVED,), True),
    (({"key": "team", "operator": "Exists", "effect": "NoExecute"},), (RESERVED,), False),
    (({"operator": "Exists"},), (RESERVED, EVICT), True),  # empty key with Exists: every taint
    (({"operator": "Exists", "effect": "NoSchedule"},), (RESERVED, EVICT), False),  # not the NoExecute one
    (({"key": "team", "value": "a"},), (RESERVED, EVICT), False),  # every hard taint must be tolerated
    (({"key": "team", "value": "a"}, {"key": "gpu", "operator": "Exists"}), (RESERVED, EVICT), True),
    (({"key": "team", "operator": "Bogus"},), (RESERVED,), False),
    (({"key": "", "operator": "Equal", "value": ""},), ({"key": "", "effect": "NoSchedule"},), True),
])
def test_taints_are_judged_as_the_scheduler_judges_them(tolerations: tuple, taints: tuple, tolerated: bool) -> None:
    assert taints_tolerated(spec(*tolerations), list(taints)) is tolerated


def test_a_pod_without_tolerations_field_tolerates_only_soft_taints() -> None:
    assert taints_tolerated({}, [SOFT]) is True
    assert taints_tolerated({"tolerations": None}, [RESERVED]) is False


def test_the_back_off_doubles_from_five_seconds_and_stops_after_four_slices() -> None:
    assert SLICE_TRIES == 4
    assert [slice_retry_delay(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert slice_retry_delay(4) is None
    assert slice_retry_delay(100) is None
    assert slice_retry_delay(2, base_s=0.5) == 1.0
    with pytest.raises(ValueError, match="failed_tries 0 must be at least 1"):
        slice_retry_delay(0)
