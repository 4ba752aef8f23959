"""``mig-operator top``: who holds which GPU slots and memory, what waits, and the namespaces' quotas,
once or again every ``--watch`` seconds."""

from __future__ import annotations

import argparse
import sys

from ..core.requests.quantities import QuantityError
from .flags import add_client_flags, client_credentials, dns_label, parse_duration, shown

DEFAULT_WATCH_S = 2
MIN_WATCH_S = 0.5
MAX_WATCH_S = 3600


def watch_seconds(text: str) -> float:
    """``top --watch``'s interval: seconds (``2``, ``0.5``) or a duration (``10s``, ``1m``)."""
    try:
        seconds = None if text.strip().startswith("-") else parse_duration(text)
    except QuantityError:
        seconds = None
    if seconds is None or not MIN_WATCH_S <= seconds <= MAX_WATCH_S:
        raise QuantityError(f"--watch {shown(text)} is not a number of seconds from {MIN_WATCH_S} to "
                            f"{MAX_WATCH_S}; use e.g. --watch {DEFAULT_WATCH_S}")
    return seconds


def add_top_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="who holds which GPU slots and memory, what waits, and the namespaces' quotas")
    add_client_flags(p)
    p.add_argument("-n", "--namespace", help="this namespace's slices and quota only, without the GPUs (default: "
                   "the whole cluster, else, where its lists are refused, the kubeconfig context's namespace)")
    p.add_argument("--watch", nargs="?", const=str(DEFAULT_WATCH_S), metavar="SECONDS",
                   help=f"draw again every SECONDS ({MIN_WATCH_S} to {MAX_WATCH_S}, default {DEFAULT_WATCH_S}) "
                   "until Ctrl-C")
    p.add_argument("--json", action="store_true",
                   help="one JSON object for scripts (with --watch: one per line)")
    p.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    """Draw the cluster's GPUs once, or again every ``--watch`` seconds until Ctrl-C."""
    import asyncio
    import json
    import shutil
    import time

    from ..core.views.top_json import view_json
    from ..core.views.top_view import WIDTH, render_text
    from ..kube.advise import Scope, context_namespace
    from ..kube.top import TopError, client_for, read_view

    interval = watch_seconds(args.watch) if args.watch is not None else None
    if args.namespace is not None:
        dns_label("--namespace", args.namespace, "team-a", "namespace")
    client_credentials(args)
    scope = (Scope(args.namespace) if args.namespace is not None
             else Scope(None, fallback=context_namespace(args.kubeconfig)))
    # On a terminal each picture replaces the last; in a pipe or a log they follow each other.
    clear = "\x1b[H\x1b[2J" if interval is not None and not args.json and sys.stdout.isatty() else ""

    async def draw() -> int:
        client = client_for(args.kubeconfig, args.as_user, args.as_groups)
        noted = ""  # the limit last said on stderr: said again only when it changes
        try:
            while True:
                try:
                    view = await read_view(client, scope)
                except TopError as exc:
                    line = "mig-operator: " + " ".join(str(exc).split())
                    if interval is None:
                        print(line, file=sys.stderr)
                        return 1
                    print(f"{line}; trying again in {interval:g} s", file=sys.stderr, flush=True)
                    await asyncio.sleep(interval)
                    continue
                if view.note and view.note != noted:
                    print(f"mig-operator: {view.note}", file=sys.stderr, flush=True)
                noted = view.note
                if args.json:
                    print(json.dumps(view_json(view), indent=None if interval is not None else 2), flush=True)
                else:
                    # The terminal's width (COLUMNS first), read again for each picture; WIDTH in a pipe.
                    text = render_text(view, shutil.get_terminal_size((WIDTH, 24)).columns)
                    if interval is None:
                        print(text, end="", flush=True)
                    else:
                        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                        print(f"{clear}--- mig-operator top at {stamp}, every {interval:g} s (Ctrl-C stops)\n"
                              + text, end="" if clear else "\n", flush=True)
                if interval is None:
                    return 0
                await asyncio.sleep(interval)
        finally:
            await client.close()

    try:
        return asyncio.run(draw())
    except KeyboardInterrupt:
        return 0  # how a watch is meant to end
