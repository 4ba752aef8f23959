"""``mig-operator check``: whether an install works, a line per part (``ok``, ``warn``, ``FAIL``) with what to
do when it does not; exit 0 when nothing failed, 1 when something did, 2 for a bad flag."""

from __future__ import annotations

import argparse
import sys

from ..core.requests.quantities import QuantityError
from .flags import add_client_flags, client_credentials, dns_label, dns_subdomain, parse_duration, shown

DEFAULT_TIMEOUT_S = 60
MAX_TIMEOUT_S = 3600


def timeout_seconds(text: str) -> float:
    """``--timeout``: seconds (``60``) or a duration (``2m``), from 1 s to an hour."""
    try:
        seconds = None if text.strip().startswith("-") else parse_duration(text)
    except QuantityError:
        seconds = None
    if seconds is None or not 1 <= seconds <= MAX_TIMEOUT_S:
        raise QuantityError(f"--timeout {shown(text)} is not a number of seconds from 1 to {MAX_TIMEOUT_S}; "
                            f"use e.g. --timeout {DEFAULT_TIMEOUT_S}")
    return seconds


def add_check_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check an install: CRDs, webhook, controller, each GPU node's agent, "
                       "and a 1Gi test slice made Ready and deleted")
    add_client_flags(p)
    p.add_argument("--namespace", default="default", help="namespace of the test slice and the dry-run pod")
    p.add_argument("--timeout", default=str(DEFAULT_TIMEOUT_S), metavar="SECONDS",
                   help="how long the test slice may take to be Ready, and then to be gone")
    p.add_argument("--peering", default="mig-operator", help="the controllers' ClusterKopfPeering (controller "
                   "--peering)")
    p.add_argument("--json", action="store_true", help='one JSON object: {"ok", "checks": [{"name", "status", '
                   '"message", "fix"}]}')
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from ..core.views.check import passed, render_checks, report_json
    from ..kube.check import CheckError, CheckOptions, run_checks
    from ..kube.top import client_for

    options = CheckOptions(
        namespace=dns_label("--namespace", args.namespace, "default", "namespace"),
        timeout_s=timeout_seconds(args.timeout),
        peering=dns_subdomain("--peering", args.peering, "mig-operator", "peering name"),
    )
    client_credentials(args)

    async def run() -> int:
        client = client_for(args.kubeconfig, args.as_user, args.as_groups)
        try:
            checks = await run_checks(client, options)
        except CheckError as exc:
            print("mig-operator: " + " ".join(str(exc).split()), file=sys.stderr)
            return 1
        finally:
            await client.close()
        print(json.dumps(report_json(checks), indent=2) if args.json else render_checks(checks), end="\n"
              if args.json else "", flush=True)
        return 0 if passed(checks) else 1

    return asyncio.run(run())
