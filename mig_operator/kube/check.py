"""`mig-operator check`'s reads and its test slice: discovery, a dry-run annotated pod, the controllers'
peering, the GPU nodes and their GpuNodes, then a 1Gi GpuSlice made Ready and deleted.

The verdicts are core/views/check.py's; the command line (cli/check.py) prints them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mig_operator.core.views.check import (
    FAIL,
    OK,
    Check,
    DryRun,
    controller_verdict,
    crds_verdict,
    node_verdicts,
    slice_verdict,
    webhook_verdict,
)

from .common.client import ApiError, KubeClient, core_path, gpunodes_path, slice_path, slices_path
from .common.names import (
    API_VERSION,
    MIG_NODE_LABEL,
    NODES,
    PEERING_NAME,
    POD_SLICE_LABEL,
    SCHEDULING_GATE,
    SLICE_KIND,
    SLICES,
)
from .controller.quotas import QUOTAS
from .webhook.server import WEBHOOK_ENTRY

PEERING_API = "kopf.dev/v1"
PEERINGS = "clusterkopfpeerings"
WANTED = {API_VERSION: (SLICES, NODES, QUOTAS), PEERING_API: (PEERINGS,)}
WEBHOOKS_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
TEST_MEMORY = "1Gi"
TEST_PREFIX = "mig-operator-check-"
# A GpuNode older than this has no running agent: its agent publishes at least every 30 s.
STALE_AFTER_S = 90.0
POLL_S = 0.25


class CheckError(Exception):
    """The API server cannot be reached or read at all: one line for the user."""


@dataclass(frozen=True)
class CheckOptions:
    namespace: str = "default"
    timeout_s: float = 60.0
    peering: str = PEERING_NAME


def test_slice_name() -> str:
    return TEST_PREFIX + secrets.token_hex(3)


async def _served(client: KubeClient) -> dict[str, set[str]]:
    served: dict[str, set[str]] = {}
    for gv in WANTED:
        try:
            found = await client.get(f"/apis/{gv}")
        except ApiError as exc:
            if exc.not_found:
                continue
            raise
        served[gv] = {str(r.get("name")) for r in found.get("resources") or [] if isinstance(r, dict)}
    return served


async def check_webhook(client: KubeClient, namespace: str) -> Check:
    configs = await client.list(WEBHOOKS_PATH)
    names = sorted(str(c["metadata"]["name"]) for c in configs
                   if any(w.get("name") == WEBHOOK_ENTRY for w in c.get("webhooks") or []))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": TEST_PREFIX, "annotations": {"cdmo.io/gpu-memory": TEST_MEMORY}},
           "spec": {"containers": [{"name": "check", "image": "registry.k8s.io/pause:3.10"}]}}
    run = DryRun()
    if names:
        try:
            answer = await client.request("POST", core_path("pods", namespace), body=pod, params={"dryRun": "All"},
                                          retry=False)
        except ApiError as exc:
            run = DryRun(status=exc.status or 1, message=exc.message)
        else:
            gated = any(g.get("name") == SCHEDULING_GATE for g in (answer.get("spec") or {}).get("schedulingGates")
                        or [])
            run = DryRun(mutated=gated and POD_SLICE_LABEL in ((answer.get("metadata") or {}).get("labels") or {}))
    return webhook_verdict(names, WEBHOOK_ENTRY, namespace, run)


async def check_controller(client: KubeClient, peering: str) -> Check:
    try:
        body = await client.get(f"/apis/{PEERING_API}/{PEERINGS}/{peering}")
    except ApiError as exc:
        if not exc.not_found:
            raise
        body = None
    return controller_verdict(peering, body, datetime.now(UTC))


async def check_nodes(client: KubeClient) -> list[Check]:
    nodes, gpunodes = await asyncio.gather(client.list(core_path("nodes"), label_selector=MIG_NODE_LABEL),
                                           client.list(gpunodes_path()))
    return node_verdicts(nodes, gpunodes, MIG_NODE_LABEL, datetime.now(UTC), STALE_AFTER_S)


async def _get(client: KubeClient, path: str) -> dict | None:
    try:
        return await client.get(path)
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def _until(probe: Callable[[], Any], deadline: float) -> Any:
    """``probe()``'s last answer: polled until it is truthy or ``deadline`` (monotonic) passes."""
    while True:
        found = await probe()
        if found or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(POLL_S)


async def check_slice(client: KubeClient, namespace: str, name: str, timeout_s: float) -> Check:
    """A test GpuSlice made and awaited Ready; deleted and awaited gone in every case (each wait within
    ``timeout_s``)."""
    ref, path = f"{namespace}/{name}", slice_path(namespace, name)
    body = {"apiVersion": API_VERSION, "kind": SLICE_KIND,
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "mig-operator-check"}},
            "spec": {"memory": TEST_MEMORY}}
    try:
        await client.create(slices_path(namespace), body)
    except ApiError as exc:
        return slice_verdict(ref, f"memory {TEST_MEMORY}", None, 0.0, timeout_s, True, exc.message)
    started = time.monotonic()
    last: dict | None = body
    try:
        async def settled() -> dict | None:
            nonlocal last
            last = await _get(client, path) or last
            phase = ((last or {}).get("status") or {}).get("phase")
            return last if phase in ("Ready", "Failed") else None

        await _until(settled, started + timeout_s)
        waited = time.monotonic() - started
    finally:
        gone = await _delete(client, path, timeout_s)
    return slice_verdict(ref, f"memory {TEST_MEMORY}", last, waited, timeout_s, gone)


async def _delete(client: KubeClient, path: str, timeout_s: float) -> bool:
    """Delete and wait until the object is gone (its finalizer released); whether it went in time."""
    try:
        await client.delete(path)
    except ApiError as exc:
        if not exc.not_found:
            raise

    async def gone() -> bool:
        return await _get(client, path) is None

    return bool(await _until(gone, time.monotonic() + timeout_s))


async def _guarded(name: str, check: Awaitable[Check | list[Check]]) -> list[Check]:
    """A check whose reads the API server refused (no right to read, or it went away) is that check's fail."""
    try:
        found = await check
    except ApiError as exc:
        return [Check(name, FAIL, f"cannot read what this check needs: {' '.join(str(exc).split())[:300]}",
                      "run check as a cluster admin (it reads Nodes, GpuNodes, webhook configurations and the "
                      "controllers' peering, and makes a GpuSlice and a dry-run pod)")]
    return found if isinstance(found, list) else [found]


async def run_checks(client: KubeClient, options: CheckOptions) -> list[Check]:
    """Every check in order; the rest need the CRDs, so a cluster without them gets the first two."""
    try:
        served = await _served(client)
    except ApiError as exc:
        raise CheckError(f"cannot read the API server's discovery: {exc}") from exc
    crds = crds_verdict(WANTED, served)
    checks = [crds, *await _guarded("webhook", check_webhook(client, options.namespace))]
    if crds.status != OK:
        return checks
    checks += await _guarded("controller", check_controller(client, options.peering))
    checks += await _guarded("nodes", check_nodes(client))
    checks += await _guarded("slice", check_slice(client, options.namespace, test_slice_name(), options.timeout_s))
    return checks
