"""Serving admission reviews without kopf's engine (kube/webhook/review.py): the patch of a change,
checked by applying it with the jsonpatch library (an independent RFC 6902 implementation); the
answer's shape (admission.k8s.io/v1 AdmissionReview); and the server over TLS."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
from typing import Any

import aiohttp
import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from mig_operator.kube.common.supervise import Loops
from mig_operator.kube.webhook.certs import make_certificate
from mig_operator.kube.webhook.review import SERVER_LOOP, ReviewServer, json_patch, review_response
from mig_operator.kube.webhook.server import HANDLER_ID, WebhookOptions, pod_handlers

# Keys with the two characters a JSON pointer escapes, as labels and annotations have them.
KEYS = st.sampled_from(["a", "b", "cdmo.io/gpu-slice", "x~y", "~1", "/", "0", "-"])
SCALARS = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, width=32) | st.text(max_size=3)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=20)


def canonical(value: Any) -> str:
    """True and 1 differ here, as in JSON; 0.0 and -0.0 are one number (adding 0.0 turns -0.0 into 0.0)."""
    numbers = json.loads(json.dumps(value), parse_float=lambda text: float(text) + 0.0)
    return json.dumps(numbers, sort_keys=True)


@settings(max_examples=400, deadline=None)
@given(before=st.dictionaries(KEYS, JSON, max_size=5), after=st.dictionaries(KEYS, JSON, max_size=5))
def test_the_patch_turns_the_pod_as_it_came_into_the_pod_as_changed(before: dict, after: dict) -> None:
    ops = json_patch(before, after)
    assert canonical(jsonpatch.apply_patch(before, ops)) == canonical(after)
    assert (ops == []) == (canonical(before) == canonical(after))


def annotated_pod(**labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train", "namespace": "team-a", "annotations": {"cdmo.io/gpu-memory": "4G"},
                         **({"labels": dict(labels)} if labels else {})},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {}},
                                    {"name": "side", "image": "busybox"}]}}


def ask(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    handler = pod_handlers(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"))[HANDLER_ID]
    return review_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                            "request": {"uid": "3f1c", "operation": operation, "object": pod}}, handler)


@pytest.mark.parametrize("labels", [{}, {"app": "train"}])
def test_an_annotated_pod_gets_its_gate_label_and_claim_as_one_json_patch(labels: dict[str, str]) -> None:
    pod = annotated_pod(**labels)
    answer = ask(pod)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "3f1c" and response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    served = jsonpatch.apply_patch(pod, ops)
    name = served["metadata"]["labels"]["cdmo.io/gpu-slice"]
    # Written out by hand: what the webhook adds to a pod asking for a slice (admission.py).
    assert served["metadata"]["labels"] == {**labels, "cdmo.io/gpu-slice": name}
    assert served["spec"]["schedulingGates"] == [{"name": "cdmo.io/gpu-slice"}]
    assert served["spec"]["resourceClaims"] == [{"name": "gpu-slice", "resourceClaimName": name}]
    assert [c.get("resources", {}).get("claims") for c in served["spec"]["containers"]] == [
        [{"name": "gpu-slice"}], [{"name": "gpu-slice"}]]
    if labels:  # an existing label map gains one key, its "/" escaped (RFC 6901)
        assert {"op": "add", "path": "/metadata/labels/cdmo.io~1gpu-slice", "value": name} in ops


def test_only_a_create_is_served_and_a_path_that_names_no_handler_passes_the_pod() -> None:
    assert ask(annotated_pod(), operation="UPDATE")["response"] == {"uid": "3f1c", "allowed": True}
    unknown = review_response({"request": {"uid": "u", "operation": "CREATE", "object": annotated_pod()}}, None)
    assert unknown["response"] == {"uid": "u", "allowed": True}


def test_a_pod_asking_for_nothing_passes_unchanged_and_a_bad_one_is_refused_with_its_value() -> None:
    plain = annotated_pod()
    plain["metadata"]["annotations"] = {"note": "x"}
    assert ask(plain)["response"] == {"uid": "3f1c", "allowed": True}
    bad = annotated_pod()
    bad["metadata"]["annotations"]["cdmo.io/gpu-memory"] = "4X"
    response = ask(bad)["response"]
    assert response["allowed"] is False and response["status"]["code"] == 400
    assert "'4X'" in response["status"]["message"] and "patch" not in response


def tls_review_server(tmp_path: Any) -> tuple[ReviewServer, socket.socket, int, str]:
    """The pod webhook's review server on a free loopback port with a certificate made here: the server,
    its socket, its port and the CA (PEM) that signed the certificate."""
    bundle = make_certificate(["127.0.0.1"])
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(bundle.cert_pem + bundle.ca_pem)
    key.write_bytes(bundle.key_pem)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = ReviewServer(sock, str(cert), str(key), pod_handlers(WebhookOptions(listen="x:1", namespace="ops")))
    return server, sock, sock.getsockname()[1], bundle.ca_pem.decode()


def test_the_server_answers_a_review_over_tls_and_refuses_what_is_not_one(tmp_path: Any) -> None:
    server, sock, port, ca = tls_review_server(tmp_path)

    async def scenario() -> tuple[dict, int]:
        task = asyncio.create_task(server.run())
        context = ssl.create_default_context(cadata=ca)
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(50):  # until it listens
                    try:
                        async with session.post(f"https://127.0.0.1:{port}/{HANDLER_ID}", ssl=context, json={
                                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                "request": {"uid": "9", "operation": "CREATE", "object": annotated_pod()}}) as got:
                            answer = await got.json()
                        break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
                async with session.post(f"https://127.0.0.1:{port}/{HANDLER_ID}", ssl=context, data=b"{") as got:
                    status = got.status
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()
        return answer, status

    answer, status = asyncio.run(scenario())
    assert answer["response"]["uid"] == "9" and answer["response"]["allowed"] is True
    assert "cdmo.io/gpu-slice" in base64.b64decode(answer["response"]["patch"]).decode()
    assert status == 400


def test_a_server_that_cannot_start_says_why_is_started_again_and_serves_once_it_can(tmp_path: Any) -> None:
    """The server is a supervised loop: with no certificate files yet it fails, is started again (each
    restart counted), and its readiness names the files; once they are written it serves and is ready."""
    bundle = make_certificate(["127.0.0.1"])
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"  # not written yet: nothing to serve with
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    loops = Loops("webhook-test")
    server = ReviewServer(sock, str(cert), str(key), {}, file_check_interval=0.05, loops=loops)
    before = REGISTRY.get_sample_value("mig_operator_loop_restarts_total",
                                       {"component": "webhook-test", "loop": SERVER_LOOP}) or 0.0

    async def scenario() -> tuple[list[str], float, int, list[str]]:
        task = server.start(base_delay_s=0.01, max_delay_s=0.02)
        for _ in range(500):
            if (REGISTRY.get_sample_value("mig_operator_loop_restarts_total",
                                          {"component": "webhook-test", "loop": SERVER_LOOP}) or 0.0) - before >= 3:
                break
            await asyncio.sleep(0.01)
        unready = server.readiness()
        restarts = (REGISTRY.get_sample_value("mig_operator_loop_restarts_total",
                                              {"component": "webhook-test", "loop": SERVER_LOOP}) or 0.0) - before
        cert.write_bytes(bundle.cert_pem + bundle.ca_pem)
        key.write_bytes(bundle.key_pem)
        context = ssl.create_default_context(cadata=bundle.ca_pem.decode())
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    try:
                        async with session.post(f"https://127.0.0.1:{port}/none", ssl=context,
                                                json={"request": {"uid": "1"}}) as got:
                            return unready, restarts, got.status, server.readiness()
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
            raise AssertionError("the server never served")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()

    unready, restarts, status, ready = asyncio.run(scenario())
    assert len(unready) == 1 and str(cert) in unready[0] and "cannot be loaded" in unready[0], unready
    assert restarts >= 3
    assert status == 200 and ready == []


def test_a_review_as_large_as_the_api_server_sends_is_served_and_a_larger_one_refused_saying_why(
        tmp_path: Any) -> None:
    server, sock, port, ca = tls_review_server(tmp_path)

    def review(uid: str, padding: int) -> bytes:
        pod = annotated_pod()
        pod["spec"]["containers"][0]["env"] = [{"name": "PAD", "value": "x" * padding}]
        return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "request": {"uid": uid, "operation": "CREATE", "object": pod}}).encode()

    # 3 MiB: what the API server takes in a request, past aiohttp's default limit (1 MiB); 13 MiB: past
    # the webhook's own (12 MiB).
    big, huge = review("big", 3 * 2**20), review("huge", 13 * 2**20)

    async def scenario() -> list[dict]:
        task = asyncio.create_task(server.run())
        context = ssl.create_default_context(cadata=ca)
        answers = []
        try:
            async with aiohttp.ClientSession() as session:
                for body in (big, huge):
                    for _ in range(50):  # until it listens
                        try:
                            async with session.post(f"https://127.0.0.1:{port}/{HANDLER_ID}", ssl=context, data=body,
                                                    headers={"Content-Type": "application/json"}) as got:
                                assert got.status == 200, await got.text()
                                answers.append(await got.json())
                            break
                        except aiohttp.ClientConnectionError:
                            await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()
        return answers

    served, refused = (a["response"] for a in asyncio.run(scenario()))
    assert served["uid"] == "big" and served["allowed"] is True
    assert "cdmo.io/gpu-slice" in base64.b64decode(served["patch"]).decode()
    assert refused["uid"] == "huge" and refused["allowed"] is False and refused["status"]["code"] == 413
    message = refused["status"]["message"]
    assert "too large" in message and str(len(huge)) in message and str(12 * 2**20) in message, message
