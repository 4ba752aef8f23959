"""The checks every command's flags share: each returns the value or raises one line naming the flag
and the value as given, with a valid example (``main`` prints it, exit 2), before anything starts."""

from __future__ import annotations

import argparse
import os
import re
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..core.requests.durations import DURATION_EXAMPLE, parse_duration
from ..core.requests.quantities import QuantityError, read_integer
from ..core.requests.slice_spec import MAX_NODE_NAME_LENGTH, NODE_NAME

if TYPE_CHECKING:
    from ..kube.common.impersonation import Impersonation

EXIT_GPU_ERROR = 1
EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


# Kubernetes' own name rules: a DNS-1123 label (namespaces), a DNS-1035 label (Services).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL_LENGTH = 63
MAX_PEERING_LIFETIME_S = 3600
SERVICE_EXAMPLE = "mig-operator/mig-operator-webhook:443"


def shown(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:60] + "…")


def address(flag: str, text: str, example: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or read_integer(port, 1, 65535) is None:
        raise QuantityError(f"{flag} {shown(text)} is not HOST:PORT (a port from 1 to 65535); use e.g. "
                            f"{flag} {example}")
    return text


def duration_flag(flag: str, text: str) -> float:
    """A duration flag's value in seconds; an error names the flag and the value as given."""
    if text.strip().startswith("-"):
        raise QuantityError(f"{flag} {shown(text)} is negative; a duration is more than 0, "
                            f"e.g. {flag} {DURATION_EXAMPLE}")
    try:
        return parse_duration(text)
    except QuantityError as exc:
        raise QuantityError(f"{flag}: {exc}") from None


def interval_flag(flag: str, text: str) -> float:
    """A period flag's value in seconds, where 0 turns what it paces off; otherwise as ``duration_flag``."""
    if text.strip() in ("0", "0s", "0.0"):
        return 0.0
    return duration_flag(flag, text)


def dns_subdomain(flag: str, text: str, example: str, what: str) -> str:
    """A name Kubernetes takes as a DNS subdomain (nodes, cluster-scoped objects such as the peering)."""
    if len(text) > MAX_NODE_NAME_LENGTH or NODE_NAME.fullmatch(text) is None:
        raise QuantityError(f"{flag} {shown(text)} is not a {what} (a lower-case DNS subdomain: a-z, 0-9, "
                            f"'-' and '.', at most {MAX_NODE_NAME_LENGTH} characters); use e.g. {flag} {example}")
    return text


def dns_label(flag: str, text: str, example: str, what: str) -> str:
    if len(text) > MAX_LABEL_LENGTH or _DNS_LABEL.fullmatch(text) is None:
        raise QuantityError(f"{flag} {shown(text)} is not a {what} (a lower-case DNS label: a-z, 0-9 and '-', "
                            f"at most {MAX_LABEL_LENGTH} characters); use e.g. {flag} {example}")
    return text


def webhook_service(text: str) -> str:
    """``NAMESPACE/NAME[:PORT]``: a namespace, a Service name and a port the API server can call."""
    namespace, slash, rest = text.partition("/")
    name, colon, port = rest.partition(":")
    valid = (bool(slash) and len(namespace) <= MAX_LABEL_LENGTH and _DNS_LABEL.fullmatch(namespace) is not None
             and len(name) <= MAX_LABEL_LENGTH and _SERVICE_NAME.fullmatch(name) is not None
             and (not colon or read_integer(port, 1, 65535) is not None))
    if not valid:
        raise QuantityError(f"--webhook-service {shown(text)} is not NAMESPACE/NAME[:PORT] (a namespace, a Service "
                            f"name and a port from 1 to 65535); use e.g. --webhook-service {SERVICE_EXAMPLE}")
    return text


def peering_lifetime(text: str) -> int:
    seconds = read_integer(text, 1, MAX_PEERING_LIFETIME_S)
    if seconds is None:
        raise QuantityError(f"--peering-lifetime {shown(text)} must be a whole number of seconds from 1 to "
                            f"{MAX_PEERING_LIFETIME_S}; use e.g. --peering-lifetime 10")
    return seconds


def directory_flag(flag: str, text: str, example: str) -> str:
    """An absolute directory path (it may not exist yet); refused when something else is there."""
    if not text.startswith("/") or "\0" in text or "\n" in text or len(text) > 4000:
        raise QuantityError(f"{flag} {shown(text)} is not an absolute directory path; use e.g. {flag} {example}")
    if os.path.exists(text) and not os.path.isdir(text):
        raise QuantityError(f"{flag} {shown(text)} exists and is not a directory; use e.g. {flag} {example}")
    return text.rstrip("/") or "/"


def file_flag(flag: str, text: str, example: str) -> str:
    """An absolute file path (it may not exist: what it says then is reported, not refused)."""
    if not text.startswith("/") or text.endswith("/") or "\0" in text or "\n" in text or len(text) > 4000:
        raise QuantityError(f"{flag} {shown(text)} is not an absolute file path; use e.g. {flag} {example}")
    if os.path.isdir(text):
        raise QuantityError(f"{flag} {shown(text)} is a directory, not a file; use e.g. {flag} {example}")
    return text


def configure_logs(args: argparse.Namespace) -> None:
    from ..kube.common.logs import configure

    configure(args.log_format, args.log_level)


def check_credentials(kubeconfig: str | None, **acting: Any) -> Impersonation:
    """The credentials loaded once (``kube.common.client.check_credentials``: ``impersonation``, ``as_user``,
    ``as_groups``); whom a client command acts as."""
    from ..kube.common.client import CredentialsError
    from ..kube.common.client import check_credentials as check

    try:
        return check(kubeconfig, **acting)
    except CredentialsError as exc:
        raise QuantityError(str(exc)) from None


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds the ``with`` blocks, so temporary files go even when the process is stopped.
    # kopf installs its own handler while it runs (it stops gracefully, and the blocks unwind then).
    sys.exit(128 + signum)


def part_flags() -> argparse.ArgumentParser:
    """The flags of every long-running part (controller, webhook, agent), as an argparse parent."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG, ~/.kube/config)")
    common.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="one JSON object per line with json")
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="the least severe messages logged")
    common.add_argument("--metrics-address", help="serve Prometheus metrics on HOST:PORT (e.g. :9090), to callers "
                        "whose bearer token the API server allows to get /metrics; off by default")
    common.add_argument("--health-address", help="serve the liveness (/healthz) and readiness (/readyz) probes on "
                        "HOST:PORT (e.g. :8081), unauthenticated; off by default")
    return common


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """The identity flags of a command a person runs against a cluster (top, check), with kubectl's names."""
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG, ~/.kube/config); "
                   "its user's impersonation (as:, as-groups:) is honoured")
    p.add_argument("--as", dest="as_user", metavar="USER",
                   help="act as this user, as kubectl --as does (default: the kubeconfig user's as:, if any)")
    p.add_argument("--as-group", dest="as_groups", action="append", metavar="GROUP",
                   help="act with this group (repeat for more), as kubectl --as-group does; needs --as or as:")


def client_credentials(args: argparse.Namespace) -> Impersonation:
    """``add_client_flags``' credentials checked before anything starts; whom the command acts as."""
    return check_credentials(args.kubeconfig, impersonation=True, as_user=args.as_user, as_groups=args.as_groups)
