"""Which nodes a pod's own scheduling constraints allow, as kube-scheduler judges them.

A sliced pod is pinned to its slice's node, so that node must be one the pod could run on anyway:
the controller picks the slice's node among the GPU nodes the pod's ``nodeSelector`` and required
node affinity allow. These are the scheduler's NodeAffinity rules (k8s.io/component-helpers
``nodeaffinity``): every ``nodeSelector`` pair must be a label of the node; of the required node
selector terms at least one must match, a term matching when all its ``matchExpressions`` (on
labels) and ``matchFields`` (``metadata.name`` only) do; an empty term matches nothing. Preferred
affinity does not restrict.

A node's taints of effect ``NoSchedule`` or ``NoExecute`` keep off every pod that does not tolerate
them (the scheduler's TaintToleration rule, k8s.io/api ``Toleration.ToleratesTaint``);
``PreferNoSchedule`` only discourages. A toleration matches a taint when its effect is empty or the
same, and either its operator is ``Exists`` (an empty key then matching every key) or its key and
value equal the taint's (operator ``Equal``, the default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _required_terms(spec: Mapping[str, Any]) -> Sequence[Mapping[str, Any]] | None:
    affinity = spec.get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    return required.get("nodeSelectorTerms") or []


def has_required_terms(spec: Mapping[str, Any]) -> bool:
    """Whether a pod spec has required node affinity (terms the scheduler must satisfy)."""
    return _required_terms(spec) is not None


def constrains_nodes(spec: Mapping[str, Any]) -> bool:
    """Whether a pod spec restricts its nodes at all (a ``nodeSelector`` or required node affinity)."""
    return bool(spec.get("nodeSelector")) or has_required_terms(spec)


def _expression_matches(expression: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key = expression.get("key", "")
    operator = expression.get("operator", "")
    wanted = list(expression.get("values") or [])
    present = key in values
    value = values.get(key, "")
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        if not present or len(wanted) != 1:
            return False
        try:
            have, bound = int(value), int(wanted[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False  # an operator the API server would have refused


def _term_matches(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return (all(_expression_matches(e, labels) for e in expressions)
            and all(_expression_matches(f, {"metadata.name": name}) for f in fields))


def node_allowed(spec: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    """Whether a pod with this spec may run on node ``name`` carrying ``labels``."""
    selector = spec.get("nodeSelector") or {}
    if any(labels.get(key) != value for key, value in selector.items()):
        return False
    terms = _required_terms(spec)
    if terms is None:
        return True
    return any(_term_matches(term, name, labels) for term in terms)


HARD_TAINT_EFFECTS = ("NoSchedule", "NoExecute")


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    if operator == "Equal":
        return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")
    return False  # an operator the API server would have refused


def taints_tolerated(spec: Mapping[str, Any], taints: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a pod with this spec tolerates every ``NoSchedule``/``NoExecute`` taint in ``taints``."""
    tolerations = spec.get("tolerations") or []
    return all(any(_tolerates(t, taint) for t in tolerations)
               for taint in taints if taint.get("effect") in HARD_TAINT_EFFECTS)
