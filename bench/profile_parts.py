"""Where a py-spy profile of the controller goes, by part of the controller.

    .venv/bin/python bench/profile_parts.py FILE [FILE...]

FILE: ``py-spy record --format raw`` output (one collapsed stack, root first, and its sample count a
line), as ``bench/pod_latency.py --profile`` writes it. A stack whose leaf is a wait (the event loop's
``select``, an idle worker thread) is not CPU: py-spy counts those while the process waits for a core,
and they are left out. Every other stack goes to the part of the controller nearest its leaf (so a
part's own API calls, JSON and logging are its own), else to the machinery that ran it.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

# A leaf frame that waits rather than computes.
IDLE_LEAVES = ("EpollSelector.select (selectors.py", "_worker (concurrent/futures/thread.py",
               "Condition.wait (threading.py", "Event.wait (threading.py")
# Parts of the controller, by the frames that are theirs; the one nearest the leaf wins.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("binder", ("(mig_operator/kube/controller/binder.py", "(mig_operator/kube/controller/observe.py",
                "(mig_operator/core/books/ledger.py")),
    ("claims", ("(mig_operator/kube/controller/claims.py",)),
    ("pods: slice made, ungating", ("(mig_operator/kube/controller/pods.py",)),
    ("quotas", ("(mig_operator/kube/controller/quotas.py",)),
    ("events posted", ("(mig_operator/kube/common/events.py",)),
    ("webhook", ("(mig_operator/kube/webhook/", "(kopf/_core/engines/admission.py", "(kopf/_kits/webhooks.py",
                 "(aiohttp/web_", "_accept_connection")),
)
# What runs the parts, for stacks that reach none of them (searched from the leaf too).
MACHINERY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("watch streams (kopf)", ("(kopf/_cogs/clients/watching.py", "(kopf/_cogs/clients/api.py",
                              "watcher (kopf/_core/reactor/queueing.py")),
    ("per-event dispatch (kopf)", ("(kopf/_core/", "(mig_operator/kube/common/operator.py")),
    ("API calls: TLS writes", ("ClientRequest.write_bytes (aiohttp",)),
    ("sockets: TLS reads, HTTP parsing", ("_read_ready (asyncio/selector_events.py",)),
)
OTHER = "event loop, other"
IDLE = "idle"


def _frames(stack: str) -> list[str]:
    return stack.split(";")


def part_of(stack: str) -> str:
    """The part a collapsed stack (root first) is counted to."""
    frames = _frames(stack)
    if any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES):
        return IDLE
    for table in (PARTS, MACHINERY):
        for frame in reversed(frames):
            for name, marks in table:
                if any(mark in frame for mark in marks):
                    return name
    return OTHER


def samples(path: Path) -> Counter[str]:
    by_part: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and re.fullmatch(r"[0-9]+", count):
            by_part[part_of(stack)] += int(count)
    return by_part


def shares(path: Path) -> dict:
    """Samples that were CPU, and each part's share of them (idle samples left out)."""
    by_part = samples(path)
    idle = by_part.pop(IDLE, 0)
    total = sum(by_part.values())
    return {"samples": total, "idle_samples": idle,
            "shares": {name: round(n / total, 4) for name, n in by_part.most_common()} if total else {}}


def main() -> int:
    for arg in sys.argv[1:]:
        found = shares(Path(arg))
        print(f"{arg}: {found['samples']} samples of CPU ({found['idle_samples']} idle left out)")
        for name, share in found["shares"].items():
            print(f"  {name:<36} {100 * share:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
