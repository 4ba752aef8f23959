"""Who may read /metrics (kube/common/metrics_auth.py): the bearer token read from the header, verdicts
kept briefly, and the HTTP answers of the metrics server for each verdict, with a stand-in for the API
server's TokenReview and SubjectAccessReview (tests/e2e/test_metrics_auth.py asks the real one)."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import pytest

from mig_operator.kube.common import metrics
from mig_operator.kube.common.metrics_auth import (
    MAX_TOKEN_CHARS,
    Gate,
    ReviewError,
    Verdict,
    VerdictCache,
    bearer_from_header,
)

READER, TENANT = "reader-token", "tenant-token"


class FakeReviewer:
    """The API server's answers by token; every token it is asked about is recorded."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.failure: ReviewError | None = None

    def review(self, token: str) -> Verdict:
        self.asked.append(token)
        if self.failure is not None:
            raise self.failure
        if token == READER:
            return Verdict(200, "system:serviceaccount:monitoring:prometheus")
        if token == TENANT:
            return Verdict(403, "system:serviceaccount:team-a:tenant", "no RBAC policy matched")
        return Verdict(401, reason="invalid bearer token")


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc.def-ghi_jkl~+/=", "abc.def-ghi_jkl~+/="),
    ("bearer   x", "x"),  # the scheme in any case, spaces before the token
    ("BEARER y", "y"),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer ", None),
    ("Basic dXNlcjpwYXNz", None),
    ("Bearer two words", None),
    ("Bearer tab\there", None),
    ("Bearer caf\u00e9", None),  # non-ASCII (a latin-1 byte as wsgiref hands it over)
    ("Bearer nul\x00", None),
    ("Bearer " + "a" * MAX_TOKEN_CHARS, "a" * MAX_TOKEN_CHARS),
    ("Bearer " + "a" * (MAX_TOKEN_CHARS + 1), None),
    ("Bearer " + "a" * (12 << 20), None),
])
def test_the_bearer_token_is_read_only_from_a_plain_bearer_header(header: str | None, token: str | None) -> None:
    assert bearer_from_header(header) == token


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_verdict_is_kept_for_its_time_and_the_least_recently_used_goes_first() -> None:
    clock = Clock()
    cache = VerdictCache(ttl_s=10, size=3, clock=clock)
    allowed = Verdict(200, "u")
    cache.put("a", allowed)
    clock.now += 9.9
    assert cache.get("a") == allowed
    clock.now += 0.1
    assert cache.get("a") is None and len(cache) == 0
    for token in "bcd":
        cache.put(token, allowed)
    assert cache.get("b") == allowed  # b used last: c is the least recently used now
    cache.put("e", allowed)
    assert [t for t in "bcde" if cache.get(t)] == ["b", "d", "e"]
    assert len(cache) == 3


def test_the_gate_asks_once_per_token_while_the_verdict_is_kept_and_never_for_an_unusable_header() -> None:
    clock, reviewer = Clock(), FakeReviewer()
    gate = Gate(reviewer, VerdictCache(ttl_s=10, clock=clock))
    for _ in range(3):
        assert gate.check(f"Bearer {READER}").status == 200
        assert gate.check(f"Bearer {TENANT}").status == 403
        assert gate.check("Bearer forged").status == 401
    assert reviewer.asked == [READER, TENANT, "forged"]
    clock.now += 10
    assert gate.check(f"Bearer {READER}").status == 200
    assert reviewer.asked == [READER, TENANT, "forged", READER]
    for header in (None, "Bearer " + "x" * (12 << 20), "Bearer \x01\x02", "Token abc"):
        assert gate.check(header) == Verdict(401, reason="no bearer token")
    assert len(reviewer.asked) == 4


def test_a_failure_to_ask_is_not_kept() -> None:
    reviewer = FakeReviewer()
    gate = Gate(reviewer)
    reviewer.failure = ReviewError(0, "connection refused")
    with pytest.raises(ReviewError):
        gate.check(f"Bearer {READER}")
    reviewer.failure = None
    assert gate.check(f"Bearer {READER}").status == 200
    assert reviewer.asked == [READER, READER]


# ---- the server ---------------------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[int, FakeReviewer]]:
    reviewer = FakeReviewer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = metrics.serve(sock, None, reviewer=reviewer)
    try:
        yield sock.getsockname()[1], reviewer
    finally:
        server.shutdown()
        server.server_close()


def get(port: int, path: str = "/metrics", token: str | None = None, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        connection.request(method, path, headers=sent)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


def test_the_server_answers_each_caller_as_the_api_server_says(served: tuple[int, FakeReviewer]) -> None:
    port, reviewer = served
    status, headers, body = get(port)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert "mig_operator_" not in body
    assert get(port, token="forged")[0] == 401
    status, _, body = get(port, token=TENANT)
    assert status == 403 and "system:serviceaccount:team-a:tenant" in body and "mig_operator_" not in body
    status, _, body = get(port, token=READER)
    assert status == 200 and "# TYPE mig_operator_binds_total counter" in body
    assert get(port, "/metrics/../secret", token=READER)[0] == 404
    assert get(port, "/", token=READER)[0] == 404
    assert get(port, token=READER, method="POST")[0] == 405
    assert reviewer.asked == ["forged", TENANT, READER]  # once each: the verdicts are kept


@pytest.mark.parametrize(("failure", "status"), [
    (ReviewError(0, "connection refused"), 503),
    (ReviewError(503, "the API server is starting"), 503),
    (ReviewError(403, "the part may not create tokenreviews"), 500),
])
def test_when_the_api_server_cannot_tell_no_metrics_are_served(
        served: tuple[int, FakeReviewer], failure: ReviewError, status: int) -> None:
    port, reviewer = served
    reviewer.failure = failure
    answer, _, body = get(port, token=READER)
    assert answer == status and "mig_operator_" not in body
    reviewer.failure = None
    assert get(port, token=READER)[0] == 200


def _hostile(port: int, header: bytes) -> bytes:
    """Send a request with ``header``; the first bytes of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
        return sock.recv(4096)


def test_a_hostile_authorization_header_is_refused_without_asking_and_the_server_keeps_serving(
        served: tuple[int, FakeReviewer]) -> None:
    port, reviewer = served
    huge = _hostile(port, b"Authorization: Bearer " + b"A" * (12 << 20))
    assert huge.split(b" ")[1] == b"431", huge[:200]  # Request Header Fields Too Large, before any review
    odd = _hostile(port, b"Authorization: Bearer \xff\xfe\x01abc")
    assert odd.split(b" ")[1] == b"401", odd[:200]
    assert get(port, token="a" * (MAX_TOKEN_CHARS + 1))[0] == 401
    assert reviewer.asked == []
    assert get(port, token=READER)[0] == 200
