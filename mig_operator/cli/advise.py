"""``mig-operator advise``: which slices' peaks would have fit a smaller MIG profile or fraction, which are too
small, and the memory and whole GPUs the cluster would get back; text or ``--json``."""

from __future__ import annotations

import argparse
import re
import sys
from fractions import Fraction

from ..core.requests.quantities import QuantityError
from ..core.usage.advice import DEFAULT_HEADROOM, MAX_HEADROOM
from .flags import add_client_flags, client_credentials, dns_label, shown

_HEADROOM = re.compile(r"[0-9]{1,6}(?:\.[0-9]{0,6})?|\.[0-9]{1,6}", re.ASCII)


def headroom_flag(text: str) -> float:
    """``--headroom``: the share added to a peak before it is fitted, from 0 to 1 (``0.10``: 10 %)."""
    value = Fraction(text) if _HEADROOM.fullmatch(text) else None
    if value is None or not 0 <= value <= MAX_HEADROOM:
        raise QuantityError(f"--headroom {shown(text)} is not a number from 0 to {MAX_HEADROOM:g} (the share "
                            f"added to a peak); use e.g. --headroom {DEFAULT_HEADROOM}")
    return float(value)


def add_advise_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("advise", help="slices whose peak would have fit a smaller profile or fraction, slices too "
                       "small, and what the cluster would get back")
    add_client_flags(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", help="this namespace's slices only (default: every namespace you may "
                       "list, else the kubeconfig context's namespace)")
    where.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace's slices")
    p.add_argument("--headroom", default=str(DEFAULT_HEADROOM), metavar="SHARE",
                   help="added to each peak before it is fitted, from 0 to 1")
    p.add_argument("--json", action="store_true", help='one JSON object: {"slices": [{"namespace", "name", '
                   '"node", "mode", "current", "peak", "verdict", "suggested", "memoryBack", "message"}], '
                   '"totals": {"memoryBack", "wholeGpus"}}')
    p.set_defaults(func=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    """Read the slices and GpuNodes once, print the report; notes (what could not be read) go to stderr."""
    import asyncio
    import json

    from ..core.views.advise_view import render_text, report_json
    from ..kube.advise import AdviseError, Scope, context_namespace, read_report
    from ..kube.top import client_for

    headroom = headroom_flag(args.headroom)
    if args.namespace is not None:
        dns_label("--namespace", args.namespace, "team-a", "namespace")
    client_credentials(args)
    if args.namespace is not None:
        scope = Scope(args.namespace)
    elif args.all_namespaces:
        scope = Scope(None)
    else:
        scope = Scope(None, fallback=context_namespace(args.kubeconfig))

    async def read() -> int:
        client = client_for(args.kubeconfig, args.as_user, args.as_groups)
        try:
            reading = await read_report(client, scope, headroom)
        except AdviseError as exc:
            print("mig-operator: " + " ".join(str(exc).split()), file=sys.stderr)
            return 1
        finally:
            await client.close()
        for note in reading.notes:
            print(f"mig-operator: {note}", file=sys.stderr)
        if args.json:
            print(json.dumps(report_json(reading.report), indent=2))
        else:
            print(render_text(reading.report), end="")
        return 0

    return asyncio.run(read())
