"""`mig-operator check`: a verdict per part of an install, from what the API server showed.

Pure: each ``*_verdict`` turns observed objects (bodies as the API serves them, answers of a dry run)
into a ``Check``: ``ok``, ``warn`` (works, but look) or ``fail``, what was checked, and on a warn or a
fail what to do. Reading and the test slice are kube/check.py's; ``render_checks`` and ``report_json``
are the command's text and ``--json`` (docs/api.md, "mig-operator check").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..node.runtime_trust import CONDITION_TYPE as RUNTIME_TRUSTED
from ..node.runtime_trust import TRUST_LABEL, TRUST_VALUE
from ..times import read_time

OK, WARN, FAIL = "ok", "warn", "fail"
WORDS = {OK: "ok", WARN: "warn", FAIL: "FAIL"}
# The parts' pods, by the chart's labels.
PODS = "kubectl get pods -A -l app.kubernetes.io/name=mig-operator,app.kubernetes.io/component={}"
LOGS = "kubectl logs -n <namespace> <pod>"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``name`` (crds, webhook, controller, node/<name>, slice), ``status`` (ok, warn,
    fail), what was found, and what to do (empty when ok)."""

    name: str
    status: str
    message: str
    fix: str = ""


def _ago(then: datetime | None, now: datetime) -> str:
    return "never" if then is None else f"{max(0, round((now - then).total_seconds()))} s ago"


def crds_verdict(wanted: Mapping[str, Sequence[str]], served: Mapping[str, Collection[str]]) -> Check:
    """``wanted``: group/version -> resources the operator needs; ``served``: what discovery lists for each
    group/version it serves (a group/version it does not serve is absent)."""
    missing = [f"{plural}.{gv.split('/')[0]}" for gv, plurals in wanted.items() for plural in plurals
               if plural not in served.get(gv, ())]
    names = [f"{plural}.{gv.split('/')[0]}" for gv, plurals in wanted.items() for plural in plurals]
    if not missing:
        return Check("crds", OK, f"the API server serves {', '.join(names)}")
    return Check("crds", FAIL, f"the API server does not serve {', '.join(missing)}",
                 "install the chart (helm upgrade --install installs the CRDs) or apply them: "
                 "kubectl apply --server-side -f crds/")


@dataclass(frozen=True)
class DryRun:
    """What a server-side dry run of an annotated pod came to: ``mutated`` (the webhook's gate and label are
    on the answer), or the refusal's HTTP status and message."""

    mutated: bool = False
    status: int = 0
    message: str = ""


def webhook_verdict(configurations: Sequence[str], entry: str, namespace: str, run: DryRun) -> Check:
    """``configurations``: the MutatingWebhookConfigurations holding the webhook ``entry``; ``run``: the dry
    run of an annotated pod in ``namespace``."""
    pods = PODS.format("webhook")
    if not configurations:
        return Check("webhook", FAIL, f"no MutatingWebhookConfiguration has the webhook {entry}: annotated pods "
                     "get no slice", "install the chart (it makes the configuration) or run the controller with "
                     "--webhook and --webhook-config")
    where = f"configuration {', '.join(configurations)}"
    if run.status == 0 and not run.mutated:
        return Check("webhook", FAIL, f"{where} exists, but a dry-run annotated pod in {namespace} was admitted "
                     "without the webhook's scheduling gate and label: the API server did not call it",
                     f"check its namespaceSelector and matchConditions (is {namespace} excluded?), or run "
                     "check with --namespace of a namespace that uses GPU slices")
    if run.mutated:
        return Check("webhook", OK, f"{where} answers: a dry-run pod annotated in {namespace} got its scheduling "
                     "gate and slice label")
    text = " ".join(run.message.split())[:300]
    if "failed calling webhook" in text or "failed to call webhook" in text:
        return Check("webhook", FAIL, f"the API server cannot call the webhook of {where}: {text}",
                     f"is a webhook pod Ready ({pods})? Its logs ({LOGS}), its Service's endpoints and the "
                     "configuration's caBundle")
    if "denied the request" in text:
        return Check("webhook", WARN, f"the webhook of {where} answers, and refused the test pod in {namespace}: "
                     f"{text}", f"the refusal is what a user in {namespace} would get (a GpuQuota?); run check "
                     "with --namespace of a namespace that uses GPU slices")
    return Check("webhook", WARN, f"a dry-run pod in {namespace} could not be tried (HTTP {run.status}): {text}",
                 "run check as a user who may create pods there, or with another --namespace")


def controller_verdict(peering: str, body: Mapping[str, Any] | None, now: datetime) -> Check:
    """``body``: the ClusterKopfPeering ``peering`` (None when absent); a peer is alive until its
    ``lastseen`` plus ``lifetime`` (kopf's rule)."""
    fix = (f"is a controller pod running and Ready ({PODS.format('controller')})? Its logs ({LOGS}); "
           "a controller started with --peering NAME: check --peering NAME")
    if body is None:
        return Check("controller", FAIL, f"no ClusterKopfPeering {peering}: no controller has started", fix)
    peers = [p for p in (body.get("status") or {}).values() if isinstance(p, Mapping)]
    seen = [(when, p.get("lifetime")) for p in peers if (when := read_time(p.get("lastseen"))) is not None]
    alive = [when for when, life in seen if isinstance(life, int) and (now - when).total_seconds() <= life]
    if alive:
        return Check("controller", OK, f"{len(alive)} controller replica(s) alive in peering {peering} (last seen "
                     f"{_ago(max(alive), now)})")
    last = max((when for when, _ in seen), default=None)
    return Check("controller", FAIL, f"no live controller in peering {peering} (last seen {_ago(last, now)})", fix)


def _condition(conditions: Any, kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or [] if isinstance(c, Mapping) and c.get("type") == kind), None)


def _node_verdict(name: str, node: Mapping[str, Any] | None, gpunode: Mapping[str, Any] | None, label: str,
                  now: datetime, stale_after_s: float) -> Check:
    check = f"node/{name}"
    pods = (f"is the agent's pod on {name} running (kubectl get pods -A -o wide --field-selector "
            f"spec.nodeName={name} -l app.kubernetes.io/component=agent)? Its logs ({LOGS})")
    if gpunode is None:
        return Check(check, FAIL, f"node {name} is labelled {label} but has no GpuNode: no agent published its "
                     "GPUs", pods)
    st = gpunode.get("status") or {}
    seen = read_time(st.get("observedAt"))
    if seen is None or (now - seen).total_seconds() > stale_after_s:
        return Check(check, FAIL, f"GpuNode {name} was last published {_ago(seen, now)} (its agent publishes at "
                     f"least every 30 s): its agent is not running", pods)
    gpus = len(st.get("gpus") or [])
    published = f"GpuNode {name}: {gpus} GPU(s), published {_ago(seen, now)}"
    trust = _condition(st.get("conditions"), RUNTIME_TRUSTED)
    status = str((trust or {}).get("status") or "Unknown")
    said = " ".join(str((trust or {}).get("message") or (trust or {}).get("reason") or "not published").split())
    accepted = ((node or {}).get("metadata") or {}).get("labels", {}).get(TRUST_LABEL) == TRUST_VALUE
    toolkit = ("set accept-nvidia-visible-devices-envvar-when-unprivileged = false in the node's NVIDIA toolkit "
               "config (docs/operations.md, RuntimeTrusted)")
    if status == "True":
        return Check(check, OK, f"{published}, RuntimeTrusted True")
    if status == "False" and accepted:
        return Check(check, WARN, f"{published}, RuntimeTrusted False, accepted by its label {TRUST_LABEL}: {said}",
                     toolkit)
    if status == "False":
        return Check(check, FAIL, f"{published}, RuntimeTrusted False: it takes no new slice: {said}",
                     f"{toolkit}, or accept the risk: kubectl label node {name} {TRUST_LABEL}={TRUST_VALUE}")
    return Check(check, WARN, f"{published}, RuntimeTrusted {status}: {said}",
                 "fine where the runtime hands GPUs over only through CDI; else point the agent at the toolkit "
                 "config (chart value agent.toolkitConfig)")


def node_verdicts(nodes: Sequence[Mapping[str, Any]], gpunodes: Sequence[Mapping[str, Any]], label: str,
                  now: datetime, stale_after_s: float) -> list[Check]:
    """A check per GPU node: each Node labelled ``label`` and each GpuNode, by name."""
    def by_name(bodies: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
        return {str((b.get("metadata") or {}).get("name", "")): b for b in bodies}

    node_of, gpunode_of = by_name(nodes), by_name(gpunodes)
    names = sorted(set(node_of) | set(gpunode_of))
    if not names:
        return [Check("nodes", WARN, f"no GPU node: no Node is labelled {label} and no agent published a GpuNode",
                      f"label a GPU node: kubectl label node NODE {label}=mig (the agent runs on labelled nodes)")]
    return [_node_verdict(n, node_of.get(n), gpunode_of.get(n), label, now, stale_after_s) for n in names]


def slice_verdict(ref: str, request: str, body: Mapping[str, Any] | None, waited_s: float, timeout_s: float,
                  gone: bool, refused: str = "") -> Check:
    """The test slice ``ref`` (namespace/name): ``body`` as last read before its deletion (None: never
    made, ``refused`` says why), whether it was Ready within ``timeout_s`` and is gone since."""
    namespace, _, name = ref.partition("/")
    if body is None:
        return Check("slice", FAIL, f"the test slice {ref} could not be made: {' '.join(refused.split())[:300]}",
                     "run check as a user who may create GpuSlices there, or with another --namespace")
    st = body.get("status") or {}
    phase = str(st.get("phase") or "Pending")
    left = "" if gone else (f"; it is still there (its node's agent releases it: kubectl get gs -n {namespace} "
                            f"{name}; then kubectl delete gs -n {namespace} {name})")
    if phase == "Ready":
        where = f"{st.get('node', '?')} GPU {st.get('gpu', '?')}, {st.get('profile') or st.get('mode') or '?'}"
        if gone:
            return Check("slice", OK, f"test slice {ref} ({request}) Ready in {waited_s:.1f} s on {where}, and deleted")
        return Check("slice", FAIL, f"test slice {ref} ({request}) was Ready on {where} but not deleted within "
                     f"{timeout_s:g} s{left}", f"is the agent on {st.get('node', '?')} running? {LOGS}")
    reason = str(st.get("reason") or "")
    said = " ".join(str(st.get("message") or "").split())[:300]
    found = f"test slice {ref} ({request}) not Ready within {timeout_s:g} s: {phase}" + (
        f" ({reason})" if reason else "") + (f": {said}" if said else "") + left
    if phase == "Pending" and not reason and not st:
        fix = f"the controller never looked at it: is it running and active ({PODS.format('controller')})?"
    elif phase == "Pending":
        fix = "no GPU takes it now: see the reason, kubectl get gn and mig-operator top"
    elif phase in ("Bound", "Creating"):
        fix = f"the agent on {st.get('node', '?')} did not make it: is it running? Its logs ({LOGS})"
    else:
        fix = "see the message, and kubectl describe gs; --timeout gives it longer"
    return Check("slice", FAIL, found, fix)


def passed(checks: Sequence[Check]) -> bool:
    """All ok, warnings allowed."""
    return all(c.status != FAIL for c in checks)


def report_json(checks: Sequence[Check]) -> dict[str, Any]:
    """``check --json``: ``{"ok", "checks": [{"name", "status", "message", "fix"}]}`` (docs/api.md)."""
    return {"ok": passed(checks),
            "checks": [{"name": c.name, "status": c.status, "message": c.message, "fix": c.fix} for c in checks]}


def render_checks(checks: Sequence[Check]) -> str:
    """One line per check (``ok``, ``warn`` or ``FAIL``, its name, what was found), a warn's or a fail's
    fix on the next line, and a last line with the verdict."""
    lines = []
    for c in checks:
        lines.append(f"{WORDS[c.status]:<4}  {c.name}: {c.message}")
        if c.fix and c.status != OK:
            lines.append(f"      fix: {c.fix}")
    failed = sum(1 for c in checks if c.status == FAIL)
    warned = sum(1 for c in checks if c.status == WARN)
    lines.append(f"{'FAIL' if failed else 'ok'}: {len(checks)} checks, {failed} failed, {warned} warned")
    return "\n".join(lines) + "\n"
